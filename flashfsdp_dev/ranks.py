"""Run a function on W local ranks (torch.multiprocessing, gloo or NCCL): the one spawner of the
tests (``tests.harness.run_distributed``, the ported suites' ``tests.fsdp2_suite.runner``) and of
the benchmarks.

``spawn_ranks(fn, W, args)`` starts W processes; rank r joins a process group over a file store
and calls ``fn(rank, W, *args)``; the return values (anything ``torch.save`` takes) come back as a
list by rank. A rank that raises or exits fails the call with every failed rank's traceback
(:class:`RanksFailed`); ranks still running after ``timeout`` seconds are killed.

``run_ranks(fn, W, *args)`` is the benchmarks' front end. For quick W = 1 runs,
``run_ranks(..., in_process=True)`` inside :func:`single_process_group` calls ``fn(0, 1, *args)`` in
this process instead (no process start-up, but every call shares the process: its memory, its
caches, its imported modules). :func:`single_process_group` also serves the tests that need a
one-rank group in the test process itself.
"""

from __future__ import annotations

import contextlib
import faulthandler
import gc
import os
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RanksFailed(RuntimeError):
    """One or more ranks raised; the message holds their tracebacks, rank by rank."""


@dataclass(frozen=True)
class _RankSetup:
    """What every rank does before it calls the function."""

    backend: str
    threads: int | None  # torch's intra-op threads per rank (None: torch's default)
    kernels: str | None  # force flashfsdp's kernel backend ("reference", "triton"); None: automatic
    env: dict | None = None  # the caller's environment, for ranks forked from a server started earlier


def _call(setup: _RankSetup, fn, rank: int, world_size: int, args: tuple):
    if setup.kernels is None:
        return fn(rank, world_size, *args)
    from flashfsdp.kernels.dispatch import use_backend  # noqa: PLC0415

    with use_backend(setup.kernels):
        return fn(rank, world_size, *args)


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, setup: _RankSetup, fn, args) -> None:
    if setup.env is not None:
        os.environ.clear()
        os.environ.update(setup.env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # A fatal signal (gloo's abort on a mismatched collective, a segfault) leaves no traceback of
    # its own: faulthandler writes every thread's Python stack to this file for the caller's report.
    faults = open(os.path.join(out_dir, f"rank{rank}.faults"), "w")  # noqa: SIM115 - open for the rank's life
    faulthandler.enable(file=faults, all_threads=True)
    if setup.threads is not None:
        torch.set_num_threads(setup.threads)
    if setup.backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(setup.backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        result = _call(setup, fn, rank, world_size, args)
        _save_result({"ok": result}, out_dir, rank)
        dist.barrier()  # no rank tears the group down while another still talks to it
    except BaseException:
        _save_result({"error": traceback.format_exc()}, out_dir, rank)
        raise
    finally:
        # The rank's models (reference cycles holding communicators and gloo work handles) go
        # before their process group: collected after it, at interpreter exit, gloo could abort
        # the process ("terminate called without an active exception") after the result was saved.
        gc.collect()
        dist.destroy_process_group()


def _save_result(result: dict, out_dir: str, rank: int) -> None:
    """Write ``rank{rank}.pt`` whole or not at all (a temporary file, then a rename): the spawner
    kills the ranks still running once one has failed, and a rank killed while writing its
    traceback left a truncated file that the failure report could not read."""
    path = os.path.join(out_dir, f"rank{rank}.pt")
    torch.save(result, path + ".tmp")
    os.replace(path + ".tmp", path)


def _rank_errors(out_dir: str, world_size: int) -> list[str]:
    """Each failed rank's traceback, and the Python stacks faulthandler wrote for a rank killed by
    a fatal signal (saying whether that rank had returned its result before)."""
    errors = []
    for r in range(world_size):
        path = os.path.join(out_dir, f"rank{r}.pt")
        res = torch.load(path, weights_only=False) if os.path.exists(path) else {}
        if "error" in res:
            errors.append(f"--- rank {r} ---\n{res['error']}")
        faults = os.path.join(out_dir, f"rank{r}.faults")
        text = open(faults).read().strip() if os.path.exists(faults) else ""
        if text:
            when = "after it returned its result" if "ok" in res else "before it returned"
            errors.append(f"--- rank {r}: fatal signal {when} ---\n{text}")
    return errors


def failure_message(out_dir: str, exit_codes: list) -> str:
    """What :class:`RanksFailed` says: every failed rank, whichever the join noticed first — a rank
    that exited by itself (a positive exit code, no result: ``os._exit``), then each traceback and
    fatal-signal stack (:func:`_rank_errors`). A rank that exits makes the others fail in their
    next collective, and on a loaded machine their tracebacks may reach the join first.

    Args:
        out_dir: the ranks' result folder (``rank{r}.pt``, ``rank{r}.faults``).
        exit_codes: by rank, the process's exit code, None where the spawner killed it or it had
            not exited (negative codes, signals, are left to the fault stacks).
    """
    exits = [f"--- rank {r}: exited with exit code {code} before it returned ---"
             for r, code in enumerate(exit_codes)
             if code is not None and code > 0 and not os.path.exists(os.path.join(out_dir, f"rank{r}.pt"))]
    return "\n".join(exits + _rank_errors(out_dir, len(exit_codes)))


def spawn_ranks(fn, world_size: int, args: tuple = (), *, backend: str = "gloo", threads: int | None = None,
                kernels: str | None = None, timeout: float | None = None, start_method: str = "spawn") -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; return the results by rank.

    Args:
        fn: a module-level function (pickled by reference).
        world_size: W >= 1.
        args: the further arguments of ``fn`` (pickled).
        backend: the torch.distributed backend, "gloo" or "nccl" (rank r on GPU r mod the count).
        threads: torch's intra-op threads in each rank; None: torch's default.
        kernels: force flashfsdp's kernel backend in the ranks ("reference", "triton"); None: automatic.
        timeout: seconds before the ranks are killed and the call fails; None: no limit.
        start_method: "spawn" (a new interpreter per rank: what the benchmarks measure) or
            "forkserver" (ranks forked from a server that imported its preloaded modules once,
            started by the first call; the ranks get this process's environment as it is now).

    Raises:
        RanksFailed: a rank raised or exited with a nonzero code (the message holds the tracebacks
            of the ranks that raised, else which rank exited how).
        TimeoutError: ranks still running after ``timeout`` seconds.
    """
    setup = _RankSetup(backend, threads, kernels, None if start_method == "spawn" else dict(os.environ))
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.start_processes(_worker, args=(world_size, os.path.join(tmp, "store"), tmp, setup, fn, args),
                                 nprocs=world_size, join=False, start_method=start_method)
        failed, killed = None, set()
        try:
            deadline = time.monotonic() + timeout if timeout is not None else None
            while not ctx.join(timeout=None if deadline is None else max(0.1, deadline - time.monotonic())):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"ranks still running after {timeout} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:  # raised; or exited nonzero (os._exit)
            failed = exc
        finally:
            for r, p in enumerate(ctx.processes):
                if p.is_alive():
                    p.kill()
                    killed.add(r)
            for p in ctx.processes:
                p.join()
        if failed is not None:
            codes = [None if r in killed else p.exitcode for r, p in enumerate(ctx.processes)]
            raise RanksFailed(failure_message(tmp, codes) or str(failed)) from None
        return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)["ok"] for r in range(world_size)]


@contextlib.contextmanager
def single_process_group(backend: str = "gloo"):
    """A torch.distributed world of one rank (this process) for the block, over an in-memory store.

    Raises:
        RuntimeError: if torch.distributed is already initialised in this process.
    """
    if dist.is_initialized():
        raise RuntimeError("single_process_group: torch.distributed is already initialised in this process")
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, backend: str | None = None, in_process: bool = False) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return the results by rank.

    Args:
        fn: a module-level function (pickled by reference).
        world_size: W >= 1.
        backend: "gloo" or "nccl"; default NCCL when CUDA is available, else gloo.
        in_process: call ``fn(0, 1, *args)`` here, inside :func:`single_process_group` (W = 1
            only); torch's intra-op thread count is restored afterwards.

    Raises:
        RanksFailed: a rank raised (the message holds its traceback).
        ValueError: ``in_process`` with ``world_size != 1`` or outside a one-rank process group.
    """
    if in_process:
        if world_size != 1 or not (dist.is_initialized() and dist.get_world_size() == 1):
            raise ValueError(
                f"run_ranks: in_process needs world_size 1 inside single_process_group(), got world_size "
                f"{world_size} and {'a group of ' + str(dist.get_world_size()) if dist.is_initialized() else 'no group'}"
            )
        threads = torch.get_num_threads()
        try:
            return [fn(0, 1, *args)]
        finally:
            torch.set_num_threads(threads)
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    return spawn_ranks(fn, world_size, args, backend=backend)
