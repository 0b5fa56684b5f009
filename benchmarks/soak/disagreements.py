"""The fault table's disagreement scenarios: the ranks stop doing the same thing, and each must say so.

Every scenario trains the tiny model of ``benchmarks.soak.workload`` at W = 2, each rank in its own
process (``benchmarks.soak.supervisor``, with the collective timeout of the fault runs); then the
ranks part ways:

- "save vs forward": after two steps rank 0 calls ``flashfsdp.checkpoint.save`` while rank 1 runs
  a third step;
- "uneven batches, then save": rank 0 has two batches, rank 1 three; each saves after its last;
- "skipped backward, then save": rank 1 runs the second step's forward without its backward;
  both then save;
- "differing gradient sync, then save": rank 1 turns ``set_requires_gradient_sync`` off for the
  second step (so it checks its backward again, alone); both then save;
- "int8 all-gathers on one rank": rank 1 builds the model with
  ``MixedPrecisionPolicy(all_gather_dtype=torch.int8)``.

Each scenario runs under the fault runs' collective timeout, and (:data:`DESYNC_TIMEOUT_S`) under
gloo's default timeout of 30 minutes with the default desync window (``flashfsdp.debug.
set_desync_window``, 5 s): the ranks compare their flight-recorder positions through the store once
a collective outlasts the window, and name the desync long before the timeout.

Measured per rank: what it raised, the seconds from the moment it parted ways (its divergent call)
to its exception (``*_surfaced_s``), and whether its message names both ranks' positions
(``named``). The diagnosis printed is rank 0's message. Targets: every rank raises (no hang, no
abort), within the collective timeout or the desync window (whichever is shorter) +
``TARGET_SLACK_S``, naming both ranks.
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from benchmarks.soak import workload
from benchmarks.soak.faults import TARGET_SLACK_S
from benchmarks.soak.supervisor import run_independent

WORLD_SIZE = 2
DESYNC_TIMEOUT_S = 1800.0  # gloo's default collective timeout, for the desync-window rows


@dataclass(frozen=True)
class Disagreement:
    """One scenario: its name, and the words both ranks' messages must hold (one per rank)."""

    name: str
    named: tuple[str, str]


DISAGREEMENTS = (
    Disagreement("save vs forward", ("rank 0 waits in the control exchange of checkpoint.save",
                                     "rank 1 waits in the all-gather")),
    Disagreement("uneven batches, then save", ("rank 0 waits in the control exchange of checkpoint.save",
                                               "rank 1 waits in the all-gather")),
    Disagreement("skipped backward, then save", ("rank 0 waits in the all-gather",
                                                 "rank 1 waits in the control exchange of checkpoint.save")),
    Disagreement("differing gradient sync, then save", ("rank 0 waits in the all-gather",
                                                        "rank 1 waits in the control exchange of the backward check")),
    Disagreement("int8 all-gathers on one rank", ("all_gather_dtype None on rank 0",
                                                  "all_gather_dtype torch.int8 on rank 1")),
)

QUICK_DISAGREEMENT = "int8 all-gathers on one rank"  # ``--quick``'s: it surfaces at once, no timeout


def _build(rank: int, int8: bool = False):
    """The workload's model (bf16 parameters, int8 all-gathers on rank 1 when ``int8``) and AdamW."""
    import flashfsdp  # noqa: PLC0415
    from flashfsdp.models import Llama, LlamaConfig  # noqa: PLC0415

    policy = flashfsdp.MixedPrecisionPolicy()
    if int8:
        policy = flashfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                all_gather_dtype=torch.int8 if rank == 1 else None)
    model = Llama(LlamaConfig(dim=workload.DIM, n_layers=workload.LAYERS, n_heads=workload.HEADS,
                              max_seq_len=workload.SEQ))
    model.init_weights(0)
    for block in model.layers:
        flashfsdp.fully_shard(block, mp_policy=policy)
    flashfsdp.fully_shard(model, mp_policy=policy)
    return workload.Job(model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                        torch.Generator().manual_seed(1000 + rank))


def _forward(job) -> torch.Tensor:
    tokens = torch.randint(0, 256, (workload.BATCH, workload.SEQ + 1), generator=job.generator)
    logits = job.model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())


def _play(name: str, rank: int, ckpt: str) -> float:
    """Run scenario ``name`` on ``rank``; returns ``time.monotonic()`` of its divergent call."""
    from flashfsdp import checkpoint  # noqa: PLC0415

    job = _build(rank, int8=name == "int8 all-gathers on one rank")
    if name.startswith("int8"):
        parted = time.monotonic()
        workload.train_step(job)
        return parted
    steps = {"save vs forward": 2, "uneven batches, then save": 2 + rank}.get(name, 1)
    for _ in range(steps):
        workload.train_step(job)
    parted = time.monotonic()
    if name == "save vs forward" and rank == 1:
        workload.train_step(job)
    elif name == "skipped backward, then save":
        loss = _forward(job)
        if rank == 0:
            loss.backward()
    elif name == "differing gradient sync, then save":
        job.model.set_requires_gradient_sync(rank == 0)
        _forward(job).backward()
    checkpoint.save(ckpt, job.model, step=steps + 1)
    return parted


def _disagreeing_rank(rank: int, world_size: int, name: str, ckpt: str, window_s: float | None) -> dict:
    """One rank of a scenario under the desync window ``window_s`` (None: off): what it raised and
    how long after parting ways (JSON)."""
    from flashfsdp.debug import set_desync_window  # noqa: PLC0415
    from flashfsdp.kernels.dispatch import use_backend  # noqa: PLC0415

    set_desync_window(window_s)
    parted = time.monotonic()
    try:
        with use_backend("reference"):
            parted = _play(name, rank, ckpt)
    except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
        return {"raised": type(exc).__name__, "message": str(exc), "surfaced_s": time.monotonic() - parted}
    return {"raised": None, "message": None, "surfaced_s": None}


def run_disagreement(scenario: Disagreement, timeout_s: float, ckpt_dir: str, window_s: float | None = None) -> dict:
    """Run one scenario at W = 2 with the collective timeout ``timeout_s`` and the desync window
    ``window_s`` (None: off); returns its row."""
    ckpt = os.path.join(ckpt_dir, re.sub(r"\W+", "_", scenario.name) + f"_{timeout_s:g}")
    bound = min(timeout_s, window_s or timeout_s)
    ends = run_independent(_disagreeing_rank, WORLD_SIZE, (scenario.name, ckpt, window_s), timeout_s=timeout_s,
                           limit_s=bound + 60)
    row = {"scenario": scenario.name, "timeout_s": timeout_s, "window_s": window_s}
    named_everywhere, in_time = True, True
    for end in ends:
        result = end.result or {}
        message = result.get("message") or end.error or ""
        row[f"rank{end.rank}"] = result.get("raised") or end.how
        row[f"rank{end.rank}_surfaced_s"] = result.get("surfaced_s")
        named = all(words in message for words in scenario.named)
        row[f"rank{end.rank}_named"] = named
        named_everywhere &= named
        in_time &= result.get("surfaced_s") is not None and result["surfaced_s"] <= bound + TARGET_SLACK_S
        if end.rank == 0:
            row["diagnosis"] = " | ".join(line for line in message.splitlines() if line.strip())[:600]
    row["all_ended"] = all(end.how != "hung" for end in ends)
    row["meets_target"] = bool(named_everywhere and in_time and row["all_ended"])
    return row
