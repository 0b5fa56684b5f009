"""Multi-process test harness: run a function on W ranks of a gloo group over a file:// store.

``run_distributed(fn, world_size, *args)`` spawns W processes; rank r calls
``fn(rank, world_size, *args)`` inside an initialised gloo process group and its return value
(anything ``torch.save`` takes) comes back in a list indexed by rank. An exception on any rank
fails the call with that rank's traceback; a rank that hangs is killed after ``timeout`` seconds.
The processes are started by the one spawner of the tests and the benchmarks
(``flashfsdp_dev.ranks.spawn_ranks``), with one intra-op thread per rank, forked from a server
that imported :data:`PRELOAD` once (:func:`start_method`): a fresh interpreter importing torch and
flashfsdp costs ~2.5 s of CPU per rank, which over the suite's hundreds of ranks was most of its
CPU time.
"""

from __future__ import annotations

import functools
import multiprocessing
import os

import torch

from flashfsdp_dev.ranks import RanksFailed, spawn_ranks

# Imported once by the forkserver; the test modules themselves are imported in each rank.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.fsdp", "torch.testing._internal.common_fsdp",
           "torch.testing._internal.distributed._tensor.common_dtensor", "flashfsdp",
           "flashfsdp.kernels.dispatch", "tests.fsdp2_suite.common")


@functools.cache
def start_method() -> str:
    """``forkserver`` with :data:`PRELOAD` preloaded where the platform has it and no GPU is
    present, else ``spawn`` (on a GPU machine every rank starts clean, as CUDA wants). Decided
    once per process: the server, once started, keeps its preload and environment."""
    if "forkserver" not in multiprocessing.get_all_start_methods() or torch.cuda.is_available():
        return "spawn"
    # The server imports Triton with the environment it starts with (the first process set):
    # the kernels run under the interpreter for CPU tensors, as the root conftest sets it.
    os.environ.setdefault("TRITON_INTERPRET", "1")
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    return "forkserver"


def run_distributed(fn, world_size: int, *args, kernels: str | None = "reference", backend: str = "gloo",
                    timeout: float = 300):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results by rank.

    Args:
        fn: a module-level function (it is pickled by reference).
        world_size: W >= 1.
        kernels: force the kernel backend in the ranks ("reference", "triton") or None (automatic).
        backend: the torch.distributed backend ("gloo"; "nccl" for GPU tests).
        timeout: seconds before the ranks are killed and the call fails.

    Raises:
        AssertionError: a rank raised (the message holds the failed ranks' tracebacks).
        TimeoutError: ranks still running after ``timeout`` seconds.
    """
    try:
        return spawn_ranks(fn, world_size, args, backend=backend, threads=1, kernels=kernels, timeout=timeout,
                           start_method=start_method())
    except RanksFailed as exc:
        raise AssertionError(str(exc)) from None
    except TimeoutError as exc:
        raise TimeoutError(f"run_distributed: {exc}") from None
