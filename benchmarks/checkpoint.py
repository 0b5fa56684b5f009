"""Checkpoint save and load: flashfsdp vs torch FSDP2 + DCP, sharded and full, in one run.

    python -m benchmarks.checkpoint [--world-size W] [--dim D --layers L --heads H] [--repeats N] [--out DIR]

Both systems shard the same Llama-style model (``flashfsdp.models.llama``, one unit per block plus
the root) with an AdamW optimizer whose state exists (one step before timing). Operations, each
collective over the W ranks (spawned with ``flashfsdp_dev.ranks.run_ranks``):

- sharded save / load (model + optimizer): ``flashfsdp.checkpoint.save`` / ``load`` against
  ``dcp.save`` / ``dcp.load`` of ``get_model_state_dict`` + ``get_optimizer_state_dict`` for FSDP2,
  both with DCP's ``FileSystemWriter`` / ``FileSystemReader``;
- full save / load (model only): ``flashfsdp.get_full_state_dict`` + ``torch.save`` on rank 0 /
  ``torch.load`` on rank 0 + ``flashfsdp.set_full_state_dict``, against
  ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` / ``set_model_state_dict(...,
  broadcast_from_rank0=True)`` for FSDP2.

Every operation runs once cold first (the first call allocates what later calls reuse: reported in
the ``cold_*`` columns) and then ``--repeats`` times warm (the main columns). Per operation: wall
time (slowest rank, median of the warm repeats), peak memory growth during the operation per rank
(median over the warm repeats, ``flashfsdp.runtime.memory.PeakMemoryMeter``: CUDA
``max_memory_allocated`` above what was allocated before; CPU: the resident set's high-water mark,
reset at the operation's start after ``malloc_trim``, above the resident set then), and the
checkpoint's size on disk. For the full state dict, the goal's bound per
rank: the bytes of the largest unsharded unit plus this rank's shard of the parameters; on CPU rank
0's growth includes the full state dict itself (it is the result, gathered to host memory by
design; on CUDA it is not in device memory), so the verdict compares the growth minus that
(``held_MiB``) with the bound. The last lines printed are one verdict per goal: sharded save/load no
slower than FSDP2's; full-state-dict peak per rank <= largest unit + shard. Defaults: CPU, W = 2 on
gloo, ~100M parameters (fp32); CUDA: every local GPU on NCCL, the ~1.1B preset. Writes CSV and
Markdown and ``checkpoint.png`` (times and memory per operation) to ``--out`` (default
``bench-results/<device>/``; ``--record``: ``benchmarks/results/<device>/``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks.environment import device_setup, environment_columns
from benchmarks.outputs import add_output_arguments, output_dir
from benchmarks.plots import bar_chart
from benchmarks.step import _model, _wrap
from benchmarks.tables import format_table, memory_verdict, write_csv, write_markdown
from flashfsdp.runtime.memory import PeakMemoryMeter
from flashfsdp_dev.ranks import run_ranks

SYSTEMS = ("flashfsdp", "fsdp2")
OPERATIONS = (("sharded", "save"), ("sharded", "load"), ("full", "save"), ("full", "load"))


def _operations(system: str, model: nn.Module, opt: torch.optim.Optimizer, where: str) -> dict:
    """(kind, op) -> a function doing it collectively, for ``system``."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint import state_dict as dsd  # noqa: PLC0415

    import flashfsdp  # noqa: PLC0415

    rank = dist.get_rank()
    full = os.path.join(where, f"{system}_full.pt")

    def full_save(get) -> None:
        sd = get()
        if rank == 0:
            torch.save(sd, full)
        dist.barrier()

    def full_load(set_) -> None:
        set_(torch.load(full, weights_only=True) if rank == 0 else None)

    if system == "flashfsdp":
        return {
            ("sharded", "save"): lambda i: flashfsdp.checkpoint.save(_sharded_path(where, system, i), model, opt, step=1),
            ("sharded", "load"): lambda i: flashfsdp.checkpoint.load(_sharded_path(where, system, i), model, opt),
            ("full", "save"): lambda i: full_save(lambda: flashfsdp.get_full_state_dict(model)),
            ("full", "load"): lambda i: full_load(lambda sd: flashfsdp.set_full_state_dict(model, sd)),
        }

    def fsdp2_save(i: int) -> None:
        state = {"model": dsd.get_model_state_dict(model), "optim": dsd.get_optimizer_state_dict(model, opt)}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(_sharded_path(where, system, i)))

    def fsdp2_load(i: int) -> None:
        state = {"model": dsd.get_model_state_dict(model), "optim": dsd.get_optimizer_state_dict(model, opt)}
        dcp.load(state, storage_reader=dcp.FileSystemReader(_sharded_path(where, system, i)))
        dsd.set_model_state_dict(model, state["model"])
        dsd.set_optimizer_state_dict(model, opt, state["optim"])

    full_options = dsd.StateDictOptions(full_state_dict=True, cpu_offload=True)
    load_options = dsd.StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
    return {
        ("sharded", "save"): fsdp2_save,
        ("sharded", "load"): fsdp2_load,
        ("full", "save"): lambda i: full_save(lambda: dsd.get_model_state_dict(model, options=full_options)),
        ("full", "load"): lambda i: full_load(lambda sd: dsd.set_model_state_dict(model, sd or {}, options=load_options)),
    }


def _sharded_path(where: str, system: str, round_index: int) -> str:
    """Round ``round_index``'s sharded checkpoint: a new directory every round, as a training loop
    saves ``step_N`` directories (replacing one in place would add flashfsdp's atomic swap, the
    deletion of the old checkpoint, which DCP's in-place overwrite skips)."""
    return os.path.join(where, f"{system}_sharded_{round_index}")


def _size(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _unit_sizes(model: nn.Module) -> tuple[int, int]:
    """(bytes of the largest unsharded unit, bytes of this rank's shard of every parameter).

    A unit is a fully_shard'ed module (flashfsdp's or FSDP2's) with the parameters that no nested
    one owns; full sizes come from ``_flashfsdp_full_shape`` (flashfsdp) or the DTensor's global
    shape (FSDP2), this rank's from the local piece / local tensor. Tied parameters count once.
    """
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    def is_unit(m: nn.Module) -> bool:
        return hasattr(m, "_flashfsdp_state") or isinstance(m, FSDPModule)

    def full_bytes(p: torch.Tensor) -> int:
        shape = getattr(p, "_flashfsdp_full_shape", p.shape)
        return torch.Size(shape).numel() * p.element_size()

    largest, seen = 0, set()
    for unit in (m for m in model.modules() if is_unit(m)):
        nested = {id(p) for m in unit.modules() if m is not unit and is_unit(m) for p in m.parameters()}
        own = [p for p in unit.parameters() if id(p) not in nested and id(p) not in seen]
        seen.update(id(p) for p in own)
        largest = max(largest, sum(full_bytes(p) for p in own))
    shard = sum((p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
                for p in {id(p): p for p in model.parameters()}.values())
    return largest, shard


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
    for i in range(1 + args.repeats):  # the first round is the cold one
        if i and rank == 0:  # the previous round's checkpoint goes, outside the timed region
            shutil.rmtree(_sharded_path(where, system, i - 1), ignore_errors=True)
        for key in OPERATIONS:
            dist.barrier()
            with PeakMemoryMeter(device) as mem:
                t0 = time.perf_counter()
                ops[key](i)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                dist.barrier()
                ms = (time.perf_counter() - t0) * 1e3
            out.setdefault(key, []).append((ms, mem.peak))
    sizes = {"sharded": _size(_sharded_path(where, system, args.repeats)),
             "full": _size(os.path.join(where, f"{system}_full.pt"))}
    full_bytes = sum(p.numel() * p.element_size() for p in _model(args, torch.device("meta")).parameters())
    largest_unit, shard = _unit_sizes(model)
    # rank 0 holds the full state dict (the result) in host memory during the full operations
    held = full_bytes if rank == 0 and device.type == "cpu" else 0
    return {"ops": out, "sizes": sizes, "params": sum(p.numel() for p in _model(args, torch.device("meta")).parameters()),
            "largest_unit": largest_unit, "shard": shard, "held": held}


def _per_rank(values) -> str:
    return " / ".join(f"{v:.1f}" for v in values)


def _row(system: str, kind: str, op: str, results: list[dict], args, env) -> dict:
    """One table row: warm medians (slowest rank / per rank), the cold run, and the memory bound."""
    runs = [r["ops"][(kind, op)] for r in results]  # per rank: [(ms, peak bytes)] cold first
    warm = range(1, 1 + args.repeats)
    peaks = [statistics.median(rank[i][1] for i in warm) / 2**20 for rank in runs]
    row = {"system": system, "state_dict": kind, "what": "model+optim" if kind == "sharded" else "model", "op": op,
           "world_size": args.world_size, "params_M": results[0]["params"] / 1e6,
           "ms": statistics.median(max(rank[i][0] for rank in runs) for i in warm),
           "peak_mem_MiB": max(peaks), "peak_per_rank_MiB": _per_rank(peaks),
           "cold_ms": max(rank[0][0] for rank in runs), "cold_peak_MiB": max(rank[0][1] for rank in runs) / 2**20,
           "size_MiB": results[0]["sizes"][kind] / 2**20, "largest_unit_MiB": results[0]["largest_unit"] / 2**20,
           "held_MiB": "", "bound_MiB": "", "verdict": "", "within_bound": "", "growth_MiB": max(peaks), **env.stamp()}
    if kind == "full":
        bounds = [(r["largest_unit"] + r["shard"]) / 2**20 for r in results]
        held = [r["held"] / 2**20 for r in results]
        growth = [peak - h for peak, h in zip(peaks, held)]
        row.update(held_MiB=_per_rank(held), bound_MiB=_per_rank(bounds), growth_MiB=max(growth),
                   within_bound=all(g <= b for g, b in zip(growth, bounds)),
                   verdict="; ".join(memory_verdict(g, b, f"rank {i}") for i, (g, b) in enumerate(zip(growth, bounds))))
    return row



def _verdicts(rows: list[dict]) -> list[str]:
    """One line per goal, from the rows."""
    by = {(r["system"], r["state_dict"], r["op"]): r for r in rows}
    lines = []
    ratios = {op: by[("flashfsdp", "sharded", op)]["vs_fsdp2"] for op in ("save", "load")
              if ("flashfsdp", "sharded", op) in by and ("fsdp2", "sharded", op) in by}
    if ratios:
        slower = [op for op, ratio in ratios.items() if ratio > 1]
        noise = slower and all(ratios[op] <= 1.1 for op in slower)
        lines.append("Goal: sharded save/load no slower than FSDP2's: "
                     + ", ".join(f"{op} {ratio:.2f}x" for op, ratio in ratios.items()) + " of FSDP2's time -> "
                     + ("MET" if not slower else f"NOT MET ({', '.join(slower)} slower"
                        + (", within the ~10% run-to-run noise)" if noise else ")")))
    full = [by[("flashfsdp", "full", op)] for op in ("save", "load") if ("flashfsdp", "full", op) in by]
    if full:
        lines.append("Goal: full-state-dict peak per rank (minus the result rank 0 holds) <= largest unit + shard: "
                     + "; ".join(f"{r['op']}: {r['verdict']}" for r in full)
                     + (" -> MET" if all(r["within_bound"] for r in full) else " -> NOT MET"))
    return lines


COLUMNS = ["system", "state_dict", "what", "op", "world_size", "params_M", "ms", "vs_fsdp2", "peak_mem_MiB",
           "peak_per_rank_MiB", "held_MiB", "largest_unit_MiB", "bound_MiB", "verdict", "cold_ms", "cold_peak_MiB",
           "size_MiB"]


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module docstring); exits with the reason on bad values."""
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
    add_output_arguments(parser)
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error("--world-size must be >= 1")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    # what benchmarks.step's _model/_wrap read; checkpoints are fp32, the embedding tied as in step's default
    args.seq, args.param_dtype, args.embedding_unit = 32, "fp32", False
    args.device = "cuda" if cuda and not args.cpu else "cpu"
    return args


def _notes(args, rows: list[dict], backend: str, verdicts: list[str]) -> list[str]:
    mem = ("max_memory_allocated growth" if args.device == "cuda"
           else "resident-set growth (peak RSS since a reset at the operation's start)")
    return [f"Llama dim {args.dim}, {args.layers} layers ({rows[0]['params_M']:.1f}M parameters), fp32 master "
            f"weights, AdamW state; W = {args.world_size} ({backend}); every operation runs once cold (cold_ms, "
            f"cold_peak_MiB: the first call allocates what later calls reuse), then {args.repeats} warm repeats: ms "
            f"is their median (slowest rank), peak_per_rank_MiB each rank's median {mem} during the operation "
            f"(peak_mem_MiB the largest rank's; on CPU it includes the allocator's retention and is noisy by tens "
            f"of MiB).",
            "sharded: flashfsdp.checkpoint.save/load vs dcp.save/load of FSDP2's get_model_state_dict + "
            "get_optimizer_state_dict (same DCP file-system writer/reader); every round saves into a new "
            "directory, as a training loop saves step_N (the previous round's is removed outside the timed "
            "region; replacing a checkpoint in place would add flashfsdp's atomic swap, the deletion of the old "
            "one); full: model only, gathered to rank 0 and torch.save'd / torch.load'ed on rank 0 and broadcast.",
            "Full rows: bound_MiB is the goal's bound per rank, the largest unsharded unit (largest_unit_MiB) plus "
            "this rank's shard of the parameters; held_MiB is the full state dict rank 0 holds in the measured "
            "memory (CPU only: it is the result, in host memory by design); verdict compares peak - held with the "
            "bound per rank. The bound counts the shard, which is resident before the operation, so a growth "
            "within it is lenient by one shard.",
            "vs_fsdp2: time divided by FSDP2's time for the same operation (below 1: flashfsdp is faster). On CPU "
            "the times are bound by the disk and by the other work on the machine; repeated runs differ by tens "
            "of percent, so read ratios near 1 as equal.",
            *verdicts]


def main(argv=None) -> list[dict]:
    """Run the benchmark (see the module docstring); return the rows written."""
    args = parse_args(argv)
    device, env, backend = device_setup(args.device)
    where = tempfile.mkdtemp(prefix="flashfsdp-ckpt-bench-", dir=args.dir)
    rows = []
    try:
        for system in args.systems:
            results = run_ranks(_run_system, args.world_size, system, args, where, backend=backend)
            rows += [_row(system, kind, op, results, args, env) for kind, op in OPERATIONS]
    finally:
        shutil.rmtree(where, ignore_errors=True)
    by = {(r["system"], r["state_dict"], r["op"]): r for r in rows}
    for r in rows:
        other = by.get(("fsdp2", r["state_dict"], r["op"]))
        r["vs_fsdp2"] = r["ms"] / other["ms"] if other else float("nan")
    verdicts = _verdicts(rows)
    print(f"{env.device_name}: W={args.world_size} {backend}, Llama dim {args.dim} x {args.layers} layers, fp32, "
          f"AdamW; median of {args.repeats} warm repeats after one cold run")
    print(format_table(rows, COLUMNS))
    for line in verdicts:
        print(line)
    out = output_dir(env.slug, out=args.out, record=args.record)
    write_csv(rows, out / "checkpoint.csv")
    write_markdown(rows, COLUMNS + environment_columns(), out / "checkpoint.md", title="Checkpoint save and load",
                   env=env, notes=_notes(args, rows, backend, verdicts))
    plot(rows, out / "checkpoint.png", title=f"Checkpoints, W={args.world_size}, {rows[0]['params_M']:.3g}M params, "
         f"{env.device_name} (median of {args.repeats} warm repeats)")
    return rows


def plot(rows: list[dict], path, *, title: str):
    """``checkpoint.png``: per operation, each system's time and its largest rank's memory growth
    (``growth_MiB``: for the full state dict, minus the result rank 0 holds, as the verdict counts
    it), with flashfsdp's full-state-dict bound (largest unit + shard, largest rank) beside it;
    returns the figure."""
    operations = list(dict.fromkeys(f"{r['state_dict']} {r['op']}" for r in rows))
    systems = list(dict.fromkeys(r["system"] for r in rows))
    by = {(r["system"], f"{r['state_dict']} {r['op']}"): r for r in rows}

    def values(system: str, key: str) -> list[float]:
        return [float(by[(system, op)][key]) if (system, op) in by else float("nan") for op in operations]

    def bound(op: str) -> float:
        row = by.get(("flashfsdp", op))
        return max(float(b) for b in row["bound_MiB"].split(" / ")) if row and row["bound_MiB"] else float("nan")

    memory = {system: values(system, "growth_MiB") for system in systems}
    memory["bound: largest unit + shard"] = [bound(op) for op in operations]
    return bar_chart(path, {"time (ms, slowest rank)": (operations, {s: values(s, "ms") for s in systems}),
                            "memory growth during the operation, less the result held (MiB, largest rank)":
                                (operations, memory)},
                     ylabel="", xlabel="state dict and operation", title=title)


if __name__ == "__main__":
    main()
