"""Multi-process test harness: run a function on W ranks of a gloo group over a file:// store.

``run_distributed(fn, world_size, *args)`` spawns W processes; rank r calls
``fn(rank, world_size, *args)`` inside an initialised gloo process group and its return value
(anything ``torch.save`` takes) comes back in a list indexed by rank. An exception on any rank
fails the call with that rank's traceback; a rank that hangs is killed after ``timeout`` seconds.
The processes are started by the benchmarks' spawner (``benchmarks.distributed.spawn_ranks``),
with one intra-op thread per rank.
"""

from __future__ import annotations

from benchmarks.distributed import RanksFailed, spawn_ranks


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
        return spawn_ranks(fn, world_size, args, backend=backend, threads=1, kernels=kernels, timeout=timeout)
    except RanksFailed as exc:
        raise AssertionError(str(exc)) from None
    except TimeoutError as exc:
        raise TimeoutError(f"run_distributed: {exc}") from None
