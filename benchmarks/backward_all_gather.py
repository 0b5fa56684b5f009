"""Bytes all-gathered in backward per step, for ``benchmarks.step``'s ``bwd_all_gather_MB`` column.

- flashfsdp: its profile's counter ``all_gather_bytes_backward`` (``flashfsdp.profile()``: the
  unsharded buffers of every all-gather issued while a backward runs: pre-backward, backward
  prefetch, recomputation), which backward all-gather elision lowers.
- torch FSDP2: the outputs of the ``torch.distributed.all_gather_single`` calls its all-gathers
  make while a backward runs, counted by wrapping that function for the measured steps.

Both are the all-gathers' output bytes on one rank (what the estimate's and the simulator's
"all-gathered, backward" rows count), not the bytes sent.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from flashfsdp._torch_private import current_graph_task_id

FLASHFSDP_COUNTER = "all_gather_bytes_backward"


def flashfsdp_backward_bytes(summary: dict) -> int:
    """The backward all-gather bytes of a ``Profile.summary()`` (over all its steps)."""
    return summary["counters"].get(FLASHFSDP_COUNTER, 0)


@contextlib.contextmanager
def fsdp2_backward_bytes() -> Iterator[dict]:
    """Within the block, count in ``counted["bytes"]`` the output bytes of the all-gathers that
    torch's ``fully_shard`` issues during a backward (``dist.all_gather_single`` is wrapped and put
    back afterwards)."""
    counted = {"bytes": 0}
    # torch >= 2.12's FSDP2 calls dist.all_gather_single; earlier releases all_gather_into_tensor.
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    original = getattr(dist, name)

    def counting(output_tensor: torch.Tensor, input_tensor: torch.Tensor, *args, **kwargs):
        if current_graph_task_id() != -1:
            counted["bytes"] += output_tensor.numel() * output_tensor.element_size()
        return original(output_tensor, input_tensor, *args, **kwargs)

    setattr(dist, name, counting)
    try:
        yield counted
    finally:
        setattr(dist, name, original)
