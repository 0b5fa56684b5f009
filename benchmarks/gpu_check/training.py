"""Short training runs that compare flashfsdp with an unsharded model or torch's FSDP2 on a GPU, with
a delay injected on every side stream (the stream stress test) or the expandable-segments
allocator with a cache release after every phase.

[Note: injected delays]
:func:`delayed_side_streams` makes every entry of a side stream (``DeviceStreams.use``: copy-in +
all-gather, reduce-scatter, accumulation) first enqueue ``torch.cuda._sleep(cycles)`` on that
stream. A missing wait between a side stream and the compute stream then lets compute read a
buffer before the all-gather wrote it (or free one the reduce-scatter still reads), and the losses
move; with every wait in place the results are bit-for-bit those of the run without delays.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.nn as nn

SYSTEMS = ("flashfsdp", "fsdp2", "unsharded")


@contextlib.contextmanager
def delayed_side_streams(cycles: int) -> Iterator[list[int]]:
    """Inside the block, every use of a CUDA side stream starts with a ``cycles``-long GPU sleep on
    it (see [Note: injected delays]); yields a one-element list counting the delays injected."""
    from flashfsdp.runtime.streams import DeviceStreams  # noqa: PLC0415

    original = DeviceStreams.use
    injected = [0]

    @contextlib.contextmanager
    def use(self, stream):
        with original(self, stream):
            if stream is not None:
                torch.cuda._sleep(cycles)
                injected[0] += 1
            yield

    DeviceStreams.use = use
    try:
        yield injected
    finally:
        DeviceStreams.use = original


def _model(dim: int, layers: int, device: torch.device) -> nn.Module:
    from flashfsdp.models.llama import Llama, LlamaConfig  # noqa: PLC0415

    with torch.device(device):
        model = Llama(LlamaConfig(dim=dim, n_layers=layers, n_heads=max(1, dim // 64), max_seq_len=64))
    model.init_weights(0)
    return model


def _wrap(system: str, model: nn.Module, param_dtype: torch.dtype | None, communicator: str) -> nn.Module:
    if system == "unsharded":
        return model
    if system == "flashfsdp":
        import flashfsdp as lib  # noqa: PLC0415

        kwargs = {"communicator": communicator}
    else:
        import torch.distributed.fsdp as lib  # noqa: PLC0415

        kwargs = {}
    policy = lib.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for block in model.layers:
        lib.fully_shard(block, mp_policy=policy, **kwargs)
    return lib.fully_shard(model, mp_policy=policy, **kwargs)


def train_losses(rank: int, world_size: int, system: str, *, dtype: str = "fp32", steps: int = 6,
                 delay_cycles: int = 0, empty_cache: bool = False, communicator: str = "auto",
                 dim: int = 256, layers: int = 4) -> dict:
    """Train ``system`` for ``steps`` AdamW steps on rank ``rank`` (a spawned rank's function; CUDA
    device ``cuda:0`` unless the spawner set another); returns the losses (float per step) and the
    kernel backend counts.

    Args:
        system: "flashfsdp", "fsdp2" or "unsharded".
        dtype: "fp32" or "bf16" (the compute dtype of the sharded systems; fp32 master weights).
        delay_cycles: > 0: run inside :func:`delayed_side_streams` (flashfsdp's side streams).
        empty_cache: release the allocator's cache after every forward and backward.
        communicator: flashfsdp's ``communicator`` argument.
    """
    from flashfsdp.kernels import dispatch  # noqa: PLC0415

    device = torch.device("cuda", torch.cuda.current_device())
    param_dtype = {"fp32": None, "bf16": torch.bfloat16}[dtype]
    model = _wrap(system, _model(dim, layers, device), param_dtype, communicator)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(7 + rank)
    dispatch.reset_backend_counts()
    losses = []
    delays = delayed_side_streams(delay_cycles) if delay_cycles > 0 else contextlib.nullcontext([0])
    with delays as injected:
        for _ in range(steps):
            tokens = torch.randint(0, 256, (2, 65), generator=gen).to(device)
            logits = model(tokens[:, :-1])
            if empty_cache:
                torch.cuda.empty_cache()
            loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
            loss.backward()
            if empty_cache:
                torch.cuda.empty_cache()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return {"losses": losses, "counts": dispatch.backend_counts(), "delays": injected[0]}


def max_abs_difference(a: list[float], b: list[float]) -> float:
    """The largest |a_i - b_i| (inf if the lengths differ)."""
    if len(a) != len(b):
        return float("inf")
    return max((abs(x - y) for x, y in zip(a, b)), default=0.0)


def triton_ran(counts: dict) -> bool:
    """Whether the counts (``dispatch.backend_counts()``) show Triton kernels on CUDA tensors and
    no call of an op on CUDA tensors on the reference path."""
    on_triton = any(key[1:] == ("triton", "cuda") for key in counts)
    return on_triton and not any(key[1:] == ("reference", "cuda") for key in counts)
