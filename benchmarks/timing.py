"""Timing an operation (:func:`measure_ms`: ``triton.testing.do_bench`` on CUDA, the median of
``time.perf_counter`` intervals on CPU; :func:`per_call_us`: host work too short to time one call
at a time), the throughput it reaches, and systems timed in interleaved rounds
(:func:`interleaved_rounds`)."""

from __future__ import annotations

import math
import statistics
import time
import contextlib
from typing import Callable, Sequence

import torch


def measure_ms(fn: Callable[[], object], device: torch.device, *, warmup: int = 2, repeats: int = 7,
               cuda_warmup_ms: int = 25, cuda_rep_ms: int = 100, best: bool = False) -> float:
    """Median (``best``: minimum) wall time of ``fn()`` in milliseconds.

    CUDA: ``triton.testing.do_bench`` (L2 flushed between runs, CUDA events); host-side launch
    overhead shows up when it exceeds the GPU time. CPU: ``warmup`` untimed calls, then the median
    (minimum) of ``repeats`` ``time.perf_counter`` intervals. The minimum is for ceilings: the best
    a reference operation reaches, which the measured ones are compared against.
    """
    if device.type == "cuda":
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=cuda_warmup_ms, rep=cuda_rep_ms,
                                             return_mode="min" if best else "median"))
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return min(samples) if best else statistics.median(samples)


def per_call_us(fn: Callable[[], object], *, calls: int, rounds: int = 5) -> float:
    """Median over ``rounds`` of the mean time of ``calls`` calls of ``fn``, in microseconds."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(times)


def gigabytes_per_second(n_bytes: int, ms: float) -> float:
    """Throughput in GB/s (10^9 bytes per second)."""
    return n_bytes / (ms * 1e-3) / 1e9 if ms > 0 else math.inf


def interleaved_rounds(run_system: Callable, systems: Sequence[str], args, backend: str) -> dict[str, list[list]]:
    """Run every system in turn, round after round (A B C A B C ...), so that a machine whose speed
    drifts (shared cores) slows every system alike: ``args.rounds`` rounds of
    ``run_ranks(run_system, args.world_size, system, args)`` (in this process with ``args.in_process``).
    Returns, per system, each round's per-rank results."""
    from flashfsdp_dev.ranks import run_ranks, single_process_group  # noqa: PLC0415

    rounds: dict[str, list[list]] = {system: [] for system in systems}
    with single_process_group(backend) if args.in_process else contextlib.nullcontext():
        for _ in range(args.rounds):
            for system in systems:
                rounds[system].append(run_ranks(run_system, args.world_size, system, args, backend=backend,
                                                in_process=args.in_process))
    return rounds
