"""Checkpoint save and load: flashfsdp vs torch FSDP2 + DCP, sharded and full, in one run.

    python -m benchmarks.checkpoint [--world-size W] [--dim D --layers L --heads H] [--repeats N]

Both systems shard the same Llama-style model (``flashfsdp.models.llama``, one unit per block plus
the root) with an AdamW optimizer whose state exists (one step before timing). Operations, each
collective over the W ranks (spawned with ``benchmarks.distributed.run_ranks``):

- sharded save / load (model + optimizer): ``flashfsdp.checkpoint.save`` / ``load`` against
  ``dcp.save`` / ``dcp.load`` of ``get_model_state_dict`` + ``get_optimizer_state_dict`` for FSDP2,
  both with DCP's ``FileSystemWriter`` / ``FileSystemReader``;
- full save / load (model only): ``flashfsdp.get_full_state_dict`` + ``torch.save`` on rank 0 /
  ``torch.load`` on rank 0 + ``flashfsdp.set_full_state_dict``, against
  ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` / ``set_model_state_dict(...,
  broadcast_from_rank0=True)`` for FSDP2.

Per operation: wall time (slowest rank, median of ``--repeats``), peak memory growth during the
operation (largest rank, median of ``--repeats``; CUDA: ``max_memory_allocated`` above what was
allocated before; CPU: the resident set sampled every 2 ms from ``/proc/self/statm`` above its value
before, after ``malloc_trim``), and the checkpoint's size on disk. Defaults: CPU, W = 2 on gloo, ~100M parameters (fp32); CUDA: every
local GPU on NCCL, the ~1.1B preset. Writes CSV and Markdown to ``benchmarks/results/<device>/``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.common import environment, environment_columns, format_table, results_dir, write_csv, write_markdown
from benchmarks.distributed import run_ranks
from benchmarks.step import _model, _wrap

SYSTEMS = ("flashfsdp", "fsdp2")
OPERATIONS = (("sharded", "save"), ("sharded", "load"), ("full", "save"), ("full", "load"))


class PeakMemory:
    """Peak memory growth of this process during a ``with`` block (bytes, in ``.peak``).

    CUDA: ``torch.cuda.max_memory_allocated`` minus what was allocated at entry. CPU: the resident
    set size, sampled every ``interval`` seconds by a thread reading ``/proc/self/statm``, minus its
    value at entry (freed heap is handed back with glibc's ``malloc_trim`` first, so that the entry
    value is not inflated by memory the block will reuse).
    """

    def __init__(self, device: torch.device, interval: float = 0.002):
        self.device, self.interval, self.peak = device, interval, 0
        self._page = os.sysconf("SC_PAGE_SIZE")

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * self._page

    def _sample(self) -> None:
        while not self._stop.is_set():
            self._max = max(self._max, self._rss())
            time.sleep(self.interval)

    def __enter__(self) -> "PeakMemory":
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            return self
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        self._base = self._max = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
            return
        self._stop.set()
        self._thread.join()
        self.peak = max(self._max, self._rss()) - self._base


def _operations(system: str, model: nn.Module, opt: torch.optim.Optimizer, where: str) -> dict:
    """(kind, op) -> a function doing it collectively, for ``system``."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint import state_dict as dsd  # noqa: PLC0415

    import flashfsdp  # noqa: PLC0415

    rank = dist.get_rank()
    sharded, full = os.path.join(where, f"{system}_sharded"), os.path.join(where, f"{system}_full.pt")

    def full_save(get) -> None:
        sd = get()
        if rank == 0:
            torch.save(sd, full)
        dist.barrier()

    def full_load(set_) -> None:
        set_(torch.load(full, weights_only=True) if rank == 0 else None)

    if system == "flashfsdp":
        return {
            ("sharded", "save"): lambda: flashfsdp.checkpoint.save(sharded, model, opt, step=1),
            ("sharded", "load"): lambda: flashfsdp.checkpoint.load(sharded, model, opt),
            ("full", "save"): lambda: full_save(lambda: flashfsdp.get_full_state_dict(model)),
            ("full", "load"): lambda: full_load(lambda sd: flashfsdp.set_full_state_dict(model, sd)),
        }

    def fsdp2_save() -> None:
        state = {"model": dsd.get_model_state_dict(model), "optim": dsd.get_optimizer_state_dict(model, opt)}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(sharded, overwrite=True))

    def fsdp2_load() -> None:
        state = {"model": dsd.get_model_state_dict(model), "optim": dsd.get_optimizer_state_dict(model, opt)}
        dcp.load(state, storage_reader=dcp.FileSystemReader(sharded))
        dsd.set_model_state_dict(model, state["model"])
        dsd.set_optimizer_state_dict(model, opt, state["optim"])

    full_options = dsd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    load_options = dsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    return {
        ("sharded", "save"): fsdp2_save,
        ("sharded", "load"): fsdp2_load,
        ("full", "save"): lambda: full_save(lambda: dsd.get_model_state_dict(model, options=full_options)),
        ("full", "load"): lambda: full_load(lambda sd: dsd.set_model_state_dict(model, sd or {}, options=load_options)),
    }


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _run_system(rank: int, world_size: int, system: str, args, where: str) -> dict:
    torch.set_num_threads(max(1, args.threads))
    device = torch.device("cuda", rank) if torch.cuda.is_available() and not args.cpu else torch.device("cpu")
    model = _wrap(system, _model(args, device), args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 256, (1, 33), generator=torch.Generator().manual_seed(rank)).to(device)
    logits = model(tokens[:, :-1])  # one step, so that the optimizer state exists
    nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    ops = _operations(system, model, opt, where)
    out = {}
    for _ in range(args.repeats):
        for key in OPERATIONS:
            dist.barrier()
            with PeakMemory(device) as mem:
                t0 = time.perf_counter()
                ops[key]()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dist.barrier()
                ms = (time.perf_counter() - t0) * 1e3
            out.setdefault(key, []).append((ms, mem.peak))
    sizes = {kind: _size(os.path.join(where, f"{system}_sharded" if kind == "sharded" else f"{system}_full.pt"))
             for kind in ("sharded", "full")}
    return {"ops": out, "sizes": sizes, "params": sum(p.numel() for p in _model(args, torch.device("meta")).parameters())}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--world-size", type=int, default=torch.cuda.device_count() if cuda else 2)
    parser.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is available")
    parser.add_argument("--dim", type=int, default=2048 if cuda else 768)
    parser.add_argument("--layers", type=int, default=22 if cuda else 14)
    parser.add_argument("--heads", type=int, default=16 if cuda else 12)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (CPU)")
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temporary directory)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error("--world-size must be >= 1")
    args.seq, args.param_dtype = 32, "fp32"  # what benchmarks.step's _model/_wrap read; checkpoints are fp32
    device = torch.device("cuda", 0) if cuda and not args.cpu else torch.device("cpu")
    env = environment(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    where = tempfile.mkdtemp(prefix="flashfsdp-ckpt-bench-", dir=args.dir)
    rows = []
    try:
        for system in args.systems:
            results = run_ranks(_run_system, args.world_size, system, args, where, backend=backend)
            for kind, op in OPERATIONS:
                per_rank = [r["ops"][(kind, op)] for r in results]
                # per repeat the slowest rank and the largest growth; then the median over repeats
                ms = statistics.median(max(rank[i][0] for rank in per_rank) for i in range(args.repeats))
                peak = statistics.median(max(rank[i][1] for rank in per_rank) for i in range(args.repeats))
                rows.append({"system": system, "state_dict": kind, "what": "model+optim" if kind == "sharded" else "model",
                             "op": op, "world_size": args.world_size, "params_M": results[0]["params"] / 1e6,
                             "ms": ms, "peak_mem_MiB": peak / 2**20, "size_MiB": results[0]["sizes"][kind] / 2**20,
                             **env.stamp()})
    finally:
        shutil.rmtree(where, ignore_errors=True)
    by = {(r["system"], r["state_dict"], r["op"]): r for r in rows}
    for r in rows:
        other = by.get(("fsdp2", r["state_dict"], r["op"]))
        r["vs_fsdp2"] = r["ms"] / other["ms"] if other else float("nan")
    columns = ["system", "state_dict", "what", "op", "world_size", "params_M", "ms", "peak_mem_MiB", "size_MiB",
               "vs_fsdp2"]
    print(f"{env.device_name}: W={args.world_size} {backend}, Llama dim {args.dim} x {args.layers} layers, fp32, "
          f"AdamW; median of {args.repeats}")
    print(format_table(rows, columns))
    out = results_dir(env.slug)
    write_csv(rows, out / "checkpoint.csv")
    mem = "max_memory_allocated growth" if device.type == "cuda" else "resident-set growth (sampled every 2 ms)"
    notes = [f"Llama dim {args.dim}, {args.layers} layers ({rows[0]['params_M']:.1f}M parameters), fp32 master "
             f"weights, AdamW state; W = {args.world_size} ({backend}); median of {args.repeats} repeats of each "
             f"operation (slowest rank); peak memory = the largest per-rank {mem} during the operation "
             f"(median over repeats; on CPU it includes the allocator's retention and is noisy by tens of MiB).",
             "sharded: flashfsdp.checkpoint.save/load vs dcp.save/load of FSDP2's get_model_state_dict + "
             "get_optimizer_state_dict (same DCP file-system writer/reader); full: model only, gathered to rank 0 "
             "and torch.save'd / torch.load'ed on rank 0 and broadcast.",
             "vs_fsdp2: time divided by FSDP2's time for the same operation (below 1: flashfsdp is faster). On CPU "
             "the times are bound by the disk and by the other work on the machine; repeated runs differ by tens "
             "of percent, so read ratios near 1 as equal."]
    write_markdown(rows, columns + environment_columns(), out / "checkpoint.md", title="Checkpoint save and load",
                   env=env, notes=notes)
    return rows


if __name__ == "__main__":
    main()
