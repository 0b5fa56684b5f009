"""Many small fully_shard'ed modules: flashfsdp vs torch FSDP2 vs DDP vs unsharded, in one run.

    python -m benchmarks.small_units [--shape gated|host-bound] [--world-size W] [--rounds N] [--systems ...]
        [--steps N --warmup N --layers L --dim D --batch B --threads T] [--in-process] [--bucket-bytes N]

The shape FSDP2's users report as CPU-bound (pytorch/pytorch#173680; #134191: AdamW over many small
DTensor weights): every small module its own unit, a step mostly per-unit host work and collectives.

- ``gated`` (default): an ``nn.ModuleDict`` of ``--layers`` (24) layers
  ``norm(x + gate(relu(linear(x))))`` (``Linear(D, D)``, D = ``--dim`` = 128; a gate of 4 floats
  scaling by ``sigmoid(weight.sum())``; ``LayerNorm(D)``), a ``Linear(D, 10)`` head, cross-entropy.
  The sharded systems ``fully_shard`` every linear, gate and norm, then each layer, then the root
  (4 units per layer + the root); W = 2; torch ``AdamW(foreach=True)`` for every system.
- ``host-bound``: 48 blocks ``norm(x + relu(linear(x)))`` of ``Linear(32, 32)`` and
  ``LayerNorm(32)`` (each block a unit, then the root, which holds the head), W = 1,
  ``torch.optim.SGD``: the host cost per unit where communication is free.

Every system builds the same model from the same seed and steps one fixed batch per rank
(``--batch`` x D inputs and labels, from a generator seeded by the rank), so that losses compare
step by step. Systems run interleaved, round after round (A B C D A B C D ...), each run in fresh
rank processes (``--in-process``: W = 1 only, in this process). Columns per system (per rank the
median over the rounds, then the slowest, i.e. largest, rank):

- ``step_ms``: median step (forward, backward, ``optimizer.step()``, ``zero_grad()``) over
  ``--steps`` timed steps after ``--warmup``; ``fwd_bwd_ms``: the same up to the end of the
  backward; ``vs_fsdp2`` / ``vs_ddp`` / ``vs_unsharded``: step_ms ratios within the run.
- ``unit_overhead_us`` = (step_ms - unsharded step_ms) / ``units`` (fully_shard'ed modules), in µs;
  "unsharded": each rank trains its own replica, no communication (the compute-only step).
- ``collectives_per_step`` (and per kind: ``all_gather``, ``reduce_scatter``, ``all_reduce``,
  ``other``: broadcasts, control exchanges): issued per step by one rank, counted on
  ``--count-steps`` steps after the timed ones (counting never slows the timing).
  ``collectives_from``: flashfsdp's flight recorder (``flashfsdp.runtime.flight``: every
  collective its communicators issue; none at W = 1, where they are local), or, for the others,
  wrappers around the ``torch.distributed`` collectives (:data:`TORCH_COLLECTIVES`); DDP's bucket
  all-reduces, issued from C++, go through ``dist.all_reduce`` on the counted steps by its default
  Python hook (``ddp_comm_hooks.default_hooks.allreduce_hook``, the same reduction).
- ``loss_max_diff_vs_fsdp2``: the largest |loss - FSDP2's loss| over every rank, warm-up and timed
  step and round (flashfsdp in fp32: expected 0.0, bit-equal); ``final_loss``: rank 0's last.
- ``peak_mem_MiB``: per rank, after sharding and building the optimizer to the end of the timed
  steps (``flashfsdp.runtime.memory.PeakMemoryMeter``).

``--bucket-bytes N`` calls ``set_bucket_bytes(N)`` on the flashfsdp root, and the system
``flashfsdp-nobucket`` ``set_bucket_bytes(0)`` (coalesced and uncoalesced flashfsdp in one run);
both need ``FSDPModule.set_bucket_bytes`` (refused otherwise; ``flashfsdp-nobucket`` is a default
system only where it exists). Writes ``small_units_<shape>_w<W>.csv`` / ``.md`` / ``.png``
(``host-bound`` as ``host_bound``) to ``--out`` (default ``bench-results/<device>/``;
``--record``: ``benchmarks/results/<device>/``).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import importlib
import math
import statistics
import time
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

from benchmarks import plots
from benchmarks.environment import device_setup, environment_columns
from benchmarks.outputs import add_output_arguments, output_dir
from benchmarks.tables import format_table, write_csv, write_markdown
from benchmarks.timing import interleaved_rounds
from flashfsdp.runtime.memory import PeakMemoryMeter

SHAPES = {  # the defaults of each --shape
    "gated": {"world_size": 2, "layers": 24, "dim": 128, "batch": 32, "optimizer": "AdamW(foreach=True, lr=1e-3)"},
    "host-bound": {"world_size": 1, "layers": 48, "dim": 32, "batch": 8, "optimizer": "SGD(lr=1e-2)"},
}
BASE_SYSTEMS = ("flashfsdp", "fsdp2", "ddp", "unsharded")
NOBUCKET = "flashfsdp-nobucket"  # flashfsdp with root.set_bucket_bytes(0): one collective per unit
CLASSES = 10  # the head's outputs
GATE_SIZE = 4  # floats of each gate module
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "other")
# torch.distributed functions counted for FSDP2, DDP and unsharded, and the kind each counts as.
TORCH_COLLECTIVES = {
    "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather", "all_gather": "all_gather",
    "all_gather_coalesced": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter", "reduce_scatter": "reduce_scatter", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce", "broadcast": "other",
}
COLUMNS = ["system", "world_size", "units", "params", "step_ms", "fwd_bwd_ms", "vs_fsdp2", "vs_ddp", "vs_unsharded",
           "unit_overhead_us", "collectives_per_step"] + [f"{k}_per_step" for k in KINDS] + [
           "collectives_from", "loss_max_diff_vs_fsdp2", "final_loss", "peak_mem_MiB"]


class Gate(nn.Module):
    """A module of :data:`GATE_SIZE` floats: scales its input by ``sigmoid(weight.sum())``."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.full((GATE_SIZE,), 0.25))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(self.weight.sum())


class Layer(nn.Module):
    """``norm(x + gate(relu(linear(x))))`` (gated) or ``norm(x + relu(linear(x)))`` (a host-bound
    block): a ``Linear(dim, dim)``, a :class:`Gate` if gated, a ``LayerNorm(dim)``."""

    def __init__(self, dim: int, gated: bool):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        self.gate = Gate() if gated else None
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.linear(x))
        return self.norm(x + (self.gate(y) if self.gate is not None else y))


class SmallUnitsModel(nn.Module):
    """``layers`` (an ``nn.ModuleDict`` of :class:`Layer`, applied in order), then a
    ``Linear(dim, CLASSES)`` head: returns the logits."""

    def __init__(self, shape: str, layers: int, dim: int):
        super().__init__()
        self.layers = nn.ModuleDict({f"layer{i}": Layer(dim, shape == "gated") for i in range(layers)})
        self.head = nn.Linear(dim, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x)


def build_model(shape: str, layers: int, dim: int, device: torch.device | str = "cpu") -> SmallUnitsModel:
    """The model of ``shape`` ("gated" or "host-bound"), initialised from seed 0 (the caller's
    random state is left as it was), on ``device``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        with torch.device(device):
            return SmallUnitsModel(shape, layers, dim)


def unit_modules(model: SmallUnitsModel, shape: str) -> list[nn.Module]:
    """The modules the sharded systems ``fully_shard`` before the root, in that order: each
    layer's linear, gate and norm, then the layer (gated); each block (host-bound)."""
    if shape == "host-bound":
        return list(model.layers.values())
    return [m for layer in model.layers.values() for m in (layer.linear, layer.gate, layer.norm, layer)]


def unit_count(shape: str, layers: int) -> int:
    """Units of the sharded systems: 4 per gated layer or 1 per host-bound block, and the root."""
    return layers * (4 if shape == "gated" else 1) + 1


def bucket_bytes_supported() -> bool:
    """Whether flashfsdp's units take ``set_bucket_bytes`` (``--bucket-bytes``, ``flashfsdp-nobucket``)."""
    import flashfsdp  # noqa: PLC0415

    return hasattr(flashfsdp.FSDPModule, "set_bucket_bytes")


def default_systems() -> list[str]:
    """flashfsdp, (flashfsdp-nobucket where bucketing exists), fsdp2, ddp, unsharded."""
    return ["flashfsdp"] + ([NOBUCKET] if bucket_bytes_supported() else []) + list(BASE_SYSTEMS[1:])


def _wrap(system: str, model: SmallUnitsModel, args, device: torch.device) -> nn.Module:
    """``model`` as ``system`` runs it: fully_shard'ed module by module then at the root
    (flashfsdp, FSDP2), in DistributedDataParallel, or as it is (unsharded)."""
    if system.startswith("flashfsdp") or system == "fsdp2":
        import flashfsdp  # noqa: PLC0415
        from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

        shard = flashfsdp.fully_shard if system.startswith("flashfsdp") else fully_shard
        for module in unit_modules(model, args.shape):
            shard(module)
        root = shard(model)
        if system == NOBUCKET or (system == "flashfsdp" and args.bucket_bytes is not None):
            root.set_bucket_bytes(0 if system == NOBUCKET else args.bucket_bytes)
        return root
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def _optimizer(shape: str, params) -> torch.optim.Optimizer:
    if shape == "gated":
        return torch.optim.AdamW(params, lr=1e-3, foreach=True)
    return torch.optim.SGD(params, lr=1e-2)


@contextlib.contextmanager
def counting_torch_collectives() -> Iterator[collections.Counter]:
    """Within the block, count by kind the calls of :data:`TORCH_COLLECTIVES` made through the
    ``torch.distributed`` namespace (one calling another inside torch calls it directly, unseen:
    each call counts once); the functions are put back after."""
    counts: collections.Counter = collections.Counter()
    originals = {name: getattr(dist, name) for name in TORCH_COLLECTIVES if hasattr(dist, name)}

    def counting(name: str, original):
        def call(*args, **kwargs):
            counts[TORCH_COLLECTIVES[name]] += 1
            return original(*args, **kwargs)
        return call

    for name, original in originals.items():
        setattr(dist, name, counting(name, original))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def flight_counts(entries) -> collections.Counter:
    """Flight-recorder entries counted by kind (broadcasts and control exchanges as "other").

    Raises:
        RuntimeError: the ring lost entries (its first one is not the first recorded).
    """
    entries = list(entries)
    if entries and entries[0].seq != 1:
        raise RuntimeError(f"flight recorder: the ring lost {entries[0].seq - 1} entries of the counted steps; "
                           f"configure a larger ring")
    return collections.Counter(e.kind if e.kind in KINDS else "other" for e in entries)


def _count_collectives(system: str, model: nn.Module, step, steps: int, units: int) -> tuple[dict, str]:
    """Per kind, collectives per step over ``steps`` more steps; and where the count came from."""
    if system.startswith("flashfsdp"):
        from flashfsdp.runtime import flight  # noqa: PLC0415

        flight.configure(max(flight.DEFAULT_ENTRIES, 16 * units * steps))  # room for every collective counted
        try:
            for _ in range(steps):
                step()
            counts = flight_counts(flight.entries())
        finally:
            flight.configure()
        source = "flight recorder"
    else:
        if system == "ddp":  # its bucket all-reduces through dist.all_reduce from now on (see the docstring)
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: PLC0415

            model.register_comm_hook(None, default_hooks.allreduce_hook)
        with counting_torch_collectives() as counts:
            for _ in range(steps):
                step()
        source = "torch.distributed"
    return {kind: counts.get(kind, 0) / steps for kind in KINDS}, source


def _run_system(rank: int, world_size: int, system: str, args) -> dict:
    """One run of ``system`` on this rank: timed steps, then counted ones; see the module docstring."""
    torch.set_num_threads(max(1, args.threads))
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    # Every system's libraries are loaded before any is measured, so that none counts them.
    for module in ("flashfsdp", "torch.distributed.fsdp", "torch.nn.parallel",
                   "torch.distributed.algorithms.ddp_comm_hooks.default_hooks"):
        importlib.import_module(module)
    memory = PeakMemoryMeter(device)
    model = _wrap(system, build_model(args.shape, args.layers, args.dim, device), args, device)
    opt = _optimizer(args.shape, model.parameters())
    memory.reset()
    gen = torch.Generator().manual_seed(1000 + rank)
    inputs = torch.randn(args.batch, args.dim, generator=gen).to(device)
    labels = torch.randint(0, CLASSES, (args.batch,), generator=gen).to(device)
    losses: list[torch.Tensor] = []
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def step() -> float:
        """One step; returns when its backward ended (``time.perf_counter``)."""
        loss = nn.functional.cross_entropy(model(inputs), labels)
        loss.backward()
        sync()
        backward_end = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
        return backward_end

    for _ in range(args.warmup):
        step()
    times, fwd_bwd = [], []
    for _ in range(args.steps):
        sync()
        t0 = time.perf_counter()
        backward_end = step()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        fwd_bwd.append((backward_end - t0) * 1e3)
    peak = memory.peak_bytes()
    counted = args.warmup + args.steps
    units = unit_count(args.shape, args.layers)
    per_step, source = _count_collectives(system, model, step, args.count_steps, units)
    return {"step_ms": statistics.median(times), "fwd_bwd_ms": statistics.median(fwd_bwd), "peak_bytes": peak,
            "memory": memory.description, "losses": [float(x) for x in losses[:counted]],
            "collectives": per_step, "collectives_from": source,
            "params": sum(p.numel() for p in build_model(args.shape, args.layers, args.dim, "meta").parameters())}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=tuple(SHAPES), default="gated",
                        help="gated: 24 gated layers, every module a unit, W = 2, AdamW (default); "
                             "host-bound: 48 blocks, W = 1, SGD")
    parser.add_argument("--world-size", type=int, default=None, help="ranks (default: 2 gated, 1 host-bound)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is available")
    parser.add_argument("--layers", type=int, default=None, help="layers or blocks (default: 24 gated, 48 host-bound)")
    parser.add_argument("--dim", type=int, default=None, help="width D (default: 128 gated, 32 host-bound)")
    parser.add_argument("--batch", type=int, default=None, help="rows per rank (default: 32 gated, 8 host-bound)")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per run (default 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps before them (default 5)")
    parser.add_argument("--count-steps", type=int, default=2,
                        help="steps after the timed ones on which collectives are counted (default 2)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every system, interleaved (default 3)")
    parser.add_argument("--systems", nargs="+", choices=BASE_SYSTEMS + (NOBUCKET,), default=None,
                        help="default: flashfsdp, flashfsdp-nobucket (where set_bucket_bytes exists), fsdp2, ddp, "
                             "unsharded")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (default 1)")
    parser.add_argument("--bucket-bytes", type=int, default=None,
                        help="flashfsdp only: root.set_bucket_bytes(N) (needs FSDPModule.set_bucket_bytes)")
    add_output_arguments(parser)
    parser.add_argument("--in-process", action="store_true",
                        help="W = 1 only: run every system in this process, not one fresh process per run "
                             "(quick checks: the systems then share the process's memory and caches)")
    return parser


def parse_args(argv=None, cuda_available: bool | None = None) -> argparse.Namespace:
    """The command line (``argv``, default ``sys.argv[1:]``) with the ``--shape``'s defaults, and
    ``device``: "cuda" where ``cuda_available`` (default ``torch.cuda.is_available()``) and not
    ``--cpu``, else "cpu". Raises SystemExit (argparse's error, naming the argument) for a world
    size below 1, ``--in-process`` with W > 1, a size below 1, a system named twice, or a bad
    bucketing request (:func:`_check_bucketing`)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    args.device = "cuda" if cuda_available and not args.cpu else "cpu"
    for key, value in SHAPES[args.shape].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    args.systems = args.systems or default_systems()
    if args.world_size < 1:
        parser.error(f"--world-size must be >= 1, got {args.world_size}")
    if args.in_process and args.world_size != 1:
        parser.error(f"--in-process runs one rank: it needs --world-size 1, got {args.world_size}")
    if args.device == "cuda" and args.world_size > torch.cuda.device_count():
        parser.error(f"--world-size {args.world_size}: only {torch.cuda.device_count()} GPUs (use --cpu for gloo)")
    for key in ("layers", "dim", "batch", "steps", "count_steps", "rounds", "threads"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    if len(set(args.systems)) != len(args.systems):
        parser.error(f"--systems names a system twice: {' '.join(args.systems)}")
    _check_bucketing(parser, args)
    return args


def _check_bucketing(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (argparse's error) ``--bucket-bytes`` or ``flashfsdp-nobucket`` where flashfsdp has
    no ``set_bucket_bytes``, a negative ``--bucket-bytes``, or one without flashfsdp to apply to."""
    missing = "this flashfsdp has no FSDPModule.set_bucket_bytes"
    if args.bucket_bytes is not None:
        if not bucket_bytes_supported():
            parser.error(f"--bucket-bytes: {missing} (no bucketing of collectives to set)")
        if args.bucket_bytes < 0:
            parser.error(f"--bucket-bytes must be >= 0, got {args.bucket_bytes}")
        if "flashfsdp" not in args.systems:
            parser.error("--bucket-bytes sets flashfsdp's buckets, but --systems does not name flashfsdp")
    if NOBUCKET in args.systems and not bucket_bytes_supported():
        parser.error(f"--systems {NOBUCKET}: {missing} (no bucketing of collectives to turn off)")


def _loss_diff(runs: list[list[dict]], reference: list[list[dict]]) -> float:
    """The largest |loss - reference loss| over rounds, ranks and steps (runs paired round by round)."""
    return max(abs(a - b) for run, ref in zip(runs, reference) for mine, theirs in zip(run, ref)
               for a, b in zip(mine["losses"], theirs["losses"], strict=True))


def _rows(rounds: dict[str, list[list[dict]]], args, env) -> list[dict]:
    """One row per system (see the module docstring for the columns) from every round's per-rank
    results: per rank the median over the rounds, then the slowest (largest) rank."""
    units = unit_count(args.shape, args.layers)
    rows = []
    for system in args.systems:
        runs = rounds[system]
        ranks = range(len(runs[0]))

        def worst(key: str) -> float:
            return max(statistics.median(run[r][key] for run in runs) for r in ranks)  # noqa: B023

        per_kind = {kind: max(run[r]["collectives"][kind] for run in runs for r in ranks) for kind in KINDS}
        row = {"system": system, "world_size": args.world_size, "units": units, "params": runs[0][0]["params"],
               "step_ms": worst("step_ms"), "fwd_bwd_ms": worst("fwd_bwd_ms"),
               "collectives_per_step": sum(per_kind.values()),
               **{f"{kind}_per_step": per_kind[kind] for kind in KINDS},
               "collectives_from": runs[0][0]["collectives_from"],
               "loss_max_diff_vs_fsdp2": _loss_diff(runs, rounds["fsdp2"]) if "fsdp2" in rounds else math.nan,
               "final_loss": runs[0][0]["losses"][-1], "peak_mem_MiB": worst("peak_bytes") / 2**20}
        rows.append(row)
    by = {r["system"]: r for r in rows}
    for r in rows:
        for name in ("fsdp2", "ddp", "unsharded"):
            r[f"vs_{name}"] = r["step_ms"] / by[name]["step_ms"] if name in by else math.nan
        r["unit_overhead_us"] = ((r["step_ms"] - by["unsharded"]["step_ms"]) * 1e3 / units if "unsharded" in by
                                 else math.nan)
    return [{c: r[c] for c in COLUMNS} | env.stamp() for r in rows]


def _plot(path, rows: list[dict], spreads: dict[str, tuple[float, float]], *, title: str):
    """``small_units_<shape>_w<W>.png``: step time (error bars: min to max over the rounds), the
    overhead per unit, collectives per step by kind and peak memory, per system; returns the figure."""
    names = [r["system"] for r in rows]
    return plots.bar_chart(path, {
        "step time (ms)": (names, {"step_ms": [r["step_ms"] for r in rows],
                                   "fwd_bwd_ms": [r["fwd_bwd_ms"] for r in rows]},
                           {"step_ms": [spreads[n] for n in names]}),
        "(step - unsharded step) per unit (µs)": (names, {"unit_overhead_us": [r["unit_overhead_us"] for r in rows]}),
        "collectives per step (one rank)": (names, {kind: [r[f"{kind}_per_step"] for r in rows] for kind in KINDS}),
        "peak memory per rank (MiB)": (names, {"peak": [r["peak_mem_MiB"] for r in rows]}),
    }, ylabel="", xlabel="system", title=title)


def _notes(args, backend: str, memory: str) -> list[str]:
    units, d = unit_count(args.shape, args.layers), args.dim
    gate = f" gate({GATE_SIZE} floats, scales by sigmoid(weight.sum()))," if args.shape == "gated" else ""
    where = "every linear, gate and norm, then every layer" if args.shape == "gated" else "every block"
    bucket = f" flashfsdp: root.set_bucket_bytes({args.bucket_bytes})." if args.bucket_bytes is not None else ""
    if NOBUCKET in args.systems:
        bucket += f" {NOBUCKET}: root.set_bucket_bytes(0) (no coalescing of collectives)."
    runs = "this process (--in-process)" if args.in_process else "fresh rank processes"
    return [
        f"{args.shape}{' (the shape of pytorch/pytorch#173680)' if gate else ''}: an nn.ModuleDict of {args.layers} layers "
        f"norm(x + {'gate(' if gate else ''}relu(linear(x)){')' if gate else ''}) of Linear({d}, {d}),{gate} "
        f"LayerNorm({d}); then Linear({d}, {CLASSES}), cross-entropy. flashfsdp and FSDP2 fully_shard {where}, then "
        f"the root: {units} units.",
        f"W = {args.world_size} ({backend}); torch.optim.{args.optimizer} for every system; fp32; one fixed batch of "
        f"{args.batch} x {d} per rank (seeded by the rank), the same for every system; {args.threads} intra-op "
        f"thread(s) per rank.{bucket}",
        f"step_ms: median of {args.steps} steps (forward, backward, optimizer.step(), zero_grad()) after {args.warmup} "
        f"warm-up, slowest rank; median over {args.rounds} interleaved rounds, each run in {runs}. fwd_bwd_ms: the "
        f"same to the end of the backward. vs_fsdp2 / vs_ddp / vs_unsharded: step_ms ratios within the run.",
        f"unit_overhead_us = (step_ms - unsharded step_ms) / {units} units, in µs: what sharding or replication costs "
        f"per unit per step over the compute-only step ('unsharded': each rank its own replica, no communication).",
        f"collectives_per_step: collectives one rank issues per step, on {args.count_steps} steps after the timed "
        f"ones, and by kind (other: broadcasts, control exchanges). collectives_from: flashfsdp's flight recorder "
        f"(every collective its communicators issue; none at W = 1) or wrappers around torch.distributed's "
        f"{', '.join(TORCH_COLLECTIVES)}; DDP's bucket all-reduces pass through dist.all_reduce on the counted steps "
        f"by its default allreduce_hook.",
        "loss_max_diff_vs_fsdp2: largest |loss - FSDP2's loss| over every rank, warm-up and timed step and round "
        "(flashfsdp in fp32: expected 0.0, bit-equal); final_loss: rank 0's last timed step.",
        f"peak_mem_MiB: per rank (largest rank), from after sharding/wrapping and building the optimizer to the end "
        f"of the timed steps: {memory}.",
    ]


def main(argv=None) -> list[dict]:
    """Run the benchmark (see the module docstring); print the table, write the files, return the rows."""
    args = parse_args(argv)
    _, env, backend = device_setup(args.device)
    # each figure is the median over interleaved rounds of every system
    rounds = interleaved_rounds(_run_system, args.systems, args, backend)
    rows = _rows(rounds, args, env)
    memory = rounds[args.systems[0]][0][0]["memory"]
    print(f"{env.device_name}: small units, {args.shape}, W={args.world_size} {backend}, {args.layers} layers of "
          f"dim {args.dim}, {unit_count(args.shape, args.layers)} units, {args.optimizer}")
    print(format_table(rows, COLUMNS))
    out = output_dir(env.slug, out=args.out, record=args.record)
    tag = f"small_units_{args.shape.replace('-', '_')}_w{args.world_size}"
    write_csv(rows, out / f"{tag}.csv")
    write_markdown(rows, COLUMNS + environment_columns(), out / f"{tag}.md",
                   title=f"Many small units ({args.shape}), W={args.world_size}", env=env,
                   notes=_notes(args, backend, memory))
    spreads = {system: (min(steps), max(steps)) for system, runs in rounds.items()
               for steps in [[max(r["step_ms"] for r in run) for run in runs]]}  # slowest rank per round
    _plot(out / f"{tag}.png", rows, spreads,
          title=f"Many small units ({args.shape}), W={args.world_size}, {env.device_name} "
                f"(bars: median over {args.rounds} rounds; error bars: min to max over the rounds)")
    print(f"wrote {out / tag}.csv/.md/.png")
    return rows


if __name__ == "__main__":
    main()
