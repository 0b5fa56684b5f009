"""Run a benchmark function on W local ranks (torch.multiprocessing spawn, gloo or NCCL).

``run_ranks(fn, W, *args)`` starts W processes; rank r joins a process group over a loopback
TCP store and calls ``fn(rank, W, *args)``; the return values come back as a list by rank.
"""

from __future__ import annotations

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


def run_ranks(fn, world_size: int, *args, backend: str | None = None) -> list:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks; return the results by rank.

    Args:
        fn: a module-level function (pickled by reference).
        world_size: W >= 1.
        backend: "gloo" or "nccl"; default NCCL when CUDA is available, else gloo.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (its traceback is in the message).
    """
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world_size, _free_port(), backend, tmp, fn, args), nprocs=world_size,
                           start_method="spawn")
        return [torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False) for r in range(world_size)]
