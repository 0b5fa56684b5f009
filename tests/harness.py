"""Multi-process test harness: run a function on W ranks of a gloo group over a file:// store.

``run_distributed(fn, world_size, *args)`` spawns W processes; rank r calls
``fn(rank, world_size, *args)`` inside an initialised gloo process group and its return value
(anything ``torch.save`` takes) comes back in a list indexed by rank. An exception on any rank
fails the call with that rank's traceback; a rank that hangs is killed after ``timeout`` seconds.
"""

from __future__ import annotations

import os
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, init_file: str, out_dir: str, kernels: str | None, backend: str, fn, args) -> None:
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["RANK"] = str(rank)
    torch.set_num_threads(1)
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        if kernels is not None:
            from flashfsdp.kernels.dispatch import use_backend  # noqa: PLC0415

            with use_backend(kernels):
                result = fn(rank, world_size, *args)
        else:
            result = fn(rank, world_size, *args)
        torch.save({"ok": result}, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears the group down while another still talks to it
    except BaseException:
        torch.save({"error": traceback.format_exc()}, os.path.join(out_dir, f"rank{rank}.pt"))
        raise
    finally:
        dist.destroy_process_group()


def run_distributed(fn, world_size: int, *args, kernels: str | None = "reference", backend: str = "gloo",
                    timeout: float = 300):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return the results by rank.

    Args:
        fn: a module-level function (it is pickled by reference).
        world_size: W >= 1.
        kernels: force the kernel backend in the ranks ("reference", "triton") or None (automatic).
        backend: the torch.distributed backend ("gloo"; "nccl" for GPU tests).
        timeout: seconds before the ranks are killed and the call fails.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "store")
        ctx = mp.start_processes(
            _worker, args=(world_size, init_file, tmp, kernels, backend, fn, args), nprocs=world_size,
            join=False, start_method="spawn",
        )
        try:
            import time  # noqa: PLC0415

            deadline = time.monotonic() + timeout
            while not ctx.join(timeout=max(0.1, deadline - time.monotonic())):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"run_distributed: ranks still running after {timeout} s")
        except mp.ProcessRaisedException as exc:
            errors = []
            for r in range(world_size):
                path = os.path.join(tmp, f"rank{r}.pt")
                if os.path.exists(path):
                    res = torch.load(path, weights_only=False)
                    if "error" in res:
                        errors.append(f"--- rank {r} ---\n{res['error']}")
            raise AssertionError("\n".join(errors) or str(exc)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        results = []
        for r in range(world_size):
            results.append(torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False)["ok"])
        return results
