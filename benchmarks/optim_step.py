"""Optimizer step alone: flashfsdp.optim.AdamW (one flat tensor per unit) vs torch's AdamW on
flashfsdp's DTensor parameters vs torch's AdamW on FSDP2 DTensors.

    python -m benchmarks.optim_step [--world-size 2] [--layers 48] [--dim 128] [--repeats 10] [--rounds 3] [--out DIR]

Every rank builds the Llama of ``benchmarks.step`` (fp32, one unit per block plus the root) twice,
sharded by flashfsdp and by torch's FSDP2, runs one forward and backward on each (so that every
parameter has a gradient), and then times ``optimizer.step()`` alone, the gradients left as they
are, for each system in turn, round after round (the rounds interleave the systems, so a machine
whose speed drifts slows each alike):

- ``flashfsdp flat AdamW``: ``flashfsdp.optim.AdamW`` (torch's fused AdamW kernel over one run per unit);
- ``torch AdamW(foreach) on flashfsdp DTensors`` / ``torch AdamW(fused) on flashfsdp DTensors``: the
  stock optimizer over the same DTensor parameters, handed one plain tensor per run of consecutive
  parameters for the step (``bindings/optimizer_local_step.py``; fused: runs split where a chunk
  is not a whole number of CPU vectors, for FSDP2's bits);
- ``torch AdamW(foreach) on FSDP2 DTensors``: what an FSDP2 job steps;
- ``torch AdamW(foreach) on plain tensors (the runs)``: the same optimizer over plain tensors of
  the sizes of flashfsdp's runs (copies, with gradients): the update's own cost, the floor of any
  hand-over (its element-wise passes over every element are the same);
- ``torch AdamW(single-tensor) on flashfsdp DTensors`` / ``... on FSDP2 DTensors``: ``foreach=False``
  (torch's per-tensor loop, the CPU default): flashfsdp hands it one local tensor per parameter, so
  that its temporaries are FSDP2's;
- ``flashfsdp clip_grad_norm_ + flat AdamW`` / ``flashfsdp flat AdamW(max_grad_norm)``: clipping
  (max norm 1.0) and the step, as two calls (norm, a scaling pass, the step) and folded into the
  step (norm, then the fused call divides each gradient by 1/coef as it reads it).

``step_ms``: median over ``--repeats`` steps (after one warm-up), slowest rank, median over the
rounds; ``tensors``: tensors per step and rank that the update runs over (the flat optimizer's
runs; what a stock optimizer's step is handed — counted by a step pre-hook: runs on flashfsdp,
one DTensor per parameter on FSDP2); ``faults_per_step``: minor page faults per step on rank 0
(``getrusage``, warm-up included), median over the rounds. Writes ``optim_step_w<W>.csv`` / ``.md`` / ``.png`` to
``--out`` (default ``bench-results/<device>/``; ``--record``: ``benchmarks/results/<device>/``).
Targets for a 48-unit model on CPU: flat AdamW ≤ 0.5× torch AdamW(foreach) on FSDP2, and torch
AdamW(foreach) on flashfsdp's parameters ≤ 0.3× the same optimizer on FSDP2's.
"""

from __future__ import annotations

import argparse
import contextlib
import resource
import statistics

import torch
import torch.nn as nn

from benchmarks.environment import device_setup, environment_columns
from benchmarks.outputs import add_output_arguments, output_dir
from benchmarks.plots import bar_chart
from benchmarks.step import _model, _wrap
from benchmarks.tables import format_table, write_csv, write_markdown
from benchmarks.timing import measure_ms
from flashfsdp_dev.ranks import run_ranks, single_process_group

SYSTEMS = {  # name: (how the model is sharded, how the optimizer is built)
    "flashfsdp flat AdamW": ("flashfsdp", "flat"),
    "torch AdamW(foreach) on flashfsdp DTensors": ("flashfsdp", "foreach"),
    "torch AdamW(fused) on flashfsdp DTensors": ("flashfsdp", "fused"),
    "torch AdamW(foreach) on FSDP2 DTensors": ("fsdp2", "foreach"),
    "torch AdamW(foreach) on plain tensors (the runs)": ("flashfsdp", "plain"),
    "torch AdamW(single-tensor) on flashfsdp DTensors": ("flashfsdp", "single"),
    "torch AdamW(single-tensor) on FSDP2 DTensors": ("fsdp2", "single"),
    "flashfsdp clip_grad_norm_ + flat AdamW": ("flashfsdp", "flat+clip"),
    "flashfsdp flat AdamW(max_grad_norm)": ("flashfsdp", "flat-clip"),
}
MAX_NORM = 1.0
BASELINE = "torch AdamW(foreach) on FSDP2 DTensors"
COLUMNS = ["system", "world_size", "units", "params_M", "tensors", "step_ms", "vs_fsdp2_foreach", "faults_per_step"]


def _optimizer(kind: str, params) -> torch.optim.Optimizer:
    import flashfsdp.optim  # noqa: PLC0415

    if kind in ("flat", "flat+clip"):
        return flashfsdp.optim.AdamW(params, lr=1e-6, weight_decay=0.01)
    if kind == "flat-clip":
        return flashfsdp.optim.AdamW(params, lr=1e-6, weight_decay=0.01, max_grad_norm=MAX_NORM)
    return torch.optim.AdamW(params, lr=1e-6, weight_decay=0.01, foreach=kind in ("foreach", "plain"),
                             fused=kind == "fused")  # "single": foreach=False, fused=False


def _params(kind: str, model: nn.Module) -> list:
    """What the optimizer of ``kind`` is built over: the model's parameters, or for "plain" a plain
    copy of each run of them (``runtime/flat_runs.py``), its gradient a copy of the run's."""
    from flashfsdp.runtime.flat_runs import plan_runs  # noqa: PLC0415

    if kind != "plain":
        return list(model.parameters())
    runs, rest = plan_runs([p for p in model.parameters() if p.grad is not None], lambda p: 0)
    if rest:
        raise RuntimeError(f"optim_step: {len(rest)} parameter(s) outside any run; the plain row needs runs only")
    copies = []
    for run in runs:
        copy = nn.Parameter(run.flat.detach().clone())
        copy.grad = run.grad().clone()
        copies.append(copy)
    return copies


def _with_grads(sharding: str, args, device: torch.device) -> nn.Module:
    model = _wrap(sharding, _model(args, device), args, device)
    tokens = torch.randint(0, 256, (2, args.seq + 1), generator=torch.Generator().manual_seed(0)).to(device)
    logits = model(tokens[:, :-1])
    nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1)).backward()
    return model


def _count_handed(optim: torch.optim.Optimizer) -> dict:
    """Record, at each step, the tensors the step is handed (a per-optimizer pre-hook runs after
    the global ones, which hand flashfsdp's runs over): ``{"tensors": n}`` of the last step."""
    seen = {}
    optim.register_step_pre_hook(lambda opt, args, kwargs: seen.update(
        tensors=sum(p.grad is not None for g in opt.param_groups for p in g["params"])))
    return seen


def _tensors(optim: torch.optim.Optimizer, handed: dict) -> int:
    """Tensors the update runs over per step: the flat optimizer's runs, else what the step was handed."""
    from flashfsdp.runtime.flat_runs import plan_runs  # noqa: PLC0415

    if not hasattr(optim, "_flat_step"):
        return handed["tensors"]
    params = [p for g in optim.param_groups for p in g["params"] if p.grad is not None]
    runs, rest = plan_runs(params, optim._age)
    return len(runs) + len(rest)


def _step_fn(kind: str, model: nn.Module, optim: torch.optim.Optimizer):
    """What is timed: ``optim.step``, after ``flashfsdp.clip_grad_norm_`` for ``flat+clip``."""
    if kind != "flat+clip":
        return optim.step
    import flashfsdp  # noqa: PLC0415

    def clip_then_step():
        flashfsdp.clip_grad_norm_(model, MAX_NORM)
        optim.step()
    return clip_then_step


def _run(rank: int, world_size: int, args) -> dict:
    torch.set_num_threads(max(1, args.threads))
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    models = {sharding: _with_grads(sharding, args, device) for sharding in ("flashfsdp", "fsdp2")}
    optims = {name: _optimizer(kind, _params(kind, models[sharding])) for name, (sharding, kind) in SYSTEMS.items()}
    handed = {name: _count_handed(optim) for name, optim in optims.items()}
    times: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    faults: dict[str, list[float]] = {name: [] for name in SYSTEMS}
    steps = {name: _step_fn(kind, models[sharding], optims[name]) for name, (sharding, kind) in SYSTEMS.items()}
    for _ in range(args.rounds):
        for name, step in steps.items():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            times[name].append(measure_ms(step, device, warmup=1, repeats=args.repeats))
            faults[name].append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / (1 + args.repeats))
    return {"times": times, "faults": faults,
            "tensors": {name: _tensors(optim, handed[name]) for name, optim in optims.items()},
            "params": sum(p.numel() for p in _model(args, torch.device("meta")).parameters())}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; raises SystemExit (argparse's error) for sizes below 1."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is available")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--layers", type=int, default=48)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (CPU)")
    add_output_arguments(parser)
    parser.add_argument("--in-process", action="store_true", help="W = 1 only: run the rank in this process")
    args = parser.parse_args(argv)
    for key in ("world_size", "dim", "layers", "heads", "seq", "repeats", "rounds"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be >= 1, got {getattr(args, key)}")
    if args.in_process and args.world_size != 1:
        parser.error(f"--in-process runs one rank: it needs --world-size 1, got {args.world_size}")
    args.device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    args.param_dtype, args.embedding_unit = "fp32", False  # what benchmarks.step's _model/_wrap read
    return args


def main(argv=None) -> list[dict]:
    """Run the benchmark (see the module docstring); return the rows written."""
    args = parse_args(argv)
    device, env, backend = device_setup(args.device)
    with single_process_group(backend) if args.in_process else contextlib.nullcontext():
        results = run_ranks(_run, args.world_size, args, backend=backend, in_process=args.in_process)
    rows = []
    for name in SYSTEMS:
        per_round = [max(r["times"][name][i] for r in results) for i in range(args.rounds)]
        rows.append({"system": name, "world_size": args.world_size, "units": args.layers + 1,
                     "params_M": results[0]["params"] / 1e6, "tensors": results[0]["tensors"][name],
                     "step_ms": statistics.median(per_round)})
    base = next(r["step_ms"] for r in rows if r["system"] == BASELINE)
    rows = [r | {"vs_fsdp2_foreach": r["step_ms"] / base,
                 "faults_per_step": statistics.median(results[0]["faults"][r["system"]])} | env.stamp() for r in rows]
    print(f"{env.device_name}: W={args.world_size} {backend}, Llama dim {args.dim} x {args.layers} layers, fp32")
    print(format_table(rows, COLUMNS))
    out = output_dir(env.slug, out=args.out, record=args.record)
    tag = f"optim_step_w{args.world_size}"
    write_csv(rows, out / f"{tag}.csv")
    notes = [f"Llama dim {args.dim}, {args.layers} layers + the root = {args.layers + 1} units, fp32, W = "
             f"{args.world_size} ({backend}); optimizer.step() alone on fixed gradients, median of {args.repeats} "
             f"steps after 1 warm-up, slowest rank, median over {args.rounds} interleaved rounds.",
             "tensors: per rank and step, what the update runs over (flat AdamW: runs of consecutive parameters, one "
             "per unit here; torch's AdamW on flashfsdp: the plain tensors its step is handed, one per run, or per "
             "parameter for the single-tensor step; on FSDP2: one DTensor per parameter).",
             "torch's foreach AdamW makes 8 element-wise passes and allocates all its temporaries at once at every "
             "step; where they lie at the top of glibc's heap when the step frees them, glibc trims them back to the "
             "OS and the next step faults them in again (faults_per_step: ~3,500 per step here, 14 MB). Which "
             "system is hit depends on the process's heap layout, not on the tensors' sizes: runs capped at "
             "FSDP2's tensor sizes fault as often, and FSDP2's own step does in other layouts. The plain-tensors "
             "row is the update's own cost, the floor of any hand-over.",
             "On a CPU shared with other work (the 2-core CI machine), timings vary by tens of percent from run to run: "
             "compare the ratios within one run."]
    write_markdown(rows, COLUMNS + environment_columns(), out / f"{tag}.md", title="Optimizer step", env=env,
                   notes=notes)
    names = [r["system"] for r in rows]
    bar_chart(out / f"{tag}.png", {"optimizer step (ms)": (names, {"step_ms": [r["step_ms"] for r in rows]})},
              ylabel="ms", title=f"AdamW step, W={args.world_size}, {env.device_name}")
    return rows


if __name__ == "__main__":
    main()
