"""Run a benchmark function on W local ranks (torch.multiprocessing spawn, gloo or NCCL).

``run_ranks(fn, W, *args)`` starts W processes; rank r joins a process group over a loopback
TCP store and calls ``fn(rank, W, *args)``; the return values come back as a list by rank.
For quick W = 1 runs, ``run_ranks(..., in_process=True)`` inside :func:`single_process_group`
calls ``fn(0, 1, *args)`` in this process instead (no process start-up, but every call shares
the process: its memory, its caches, its imported modules).
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, backend, out_dir, fn, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_RANK=str(rank))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world_size)
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


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
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback is in the message).
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
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world_size, _free_port(), backend, tmp, fn, args), nprocs=world_size,
                           start_method="spawn")
        return [torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False) for r in range(world_size)]
