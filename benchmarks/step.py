"""End-to-end training step: flashfsdp vs torch FSDP2 vs DDP vs unsharded, in one run.

    python -m benchmarks.step [--cpu] [--world-size W] [--steps N] [--dim D --layers L --seq S --batch B] [--host-bound] [--out DIR]

Every system trains the same Llama-style model (``flashfsdp.models.llama``) from the same seed on
the same batches with torch's AdamW (``flashfsdp-flat-adamw``, named in ``--systems``: flashfsdp
with ``flashfsdp.optim.AdamW``, one fused call per unit's flat shard), one block per unit plus the
root for the sharded systems. Per system:

- ``step_ms``: median step time over ``--steps`` timed steps after ``--warmup`` (slowest rank);
  ``tokens_per_s`` over all ranks.
- ``peak_mem_MiB``: peak memory per rank (largest rank) from after the model is built and
  sharded (or wrapped) to the end of the timed steps, the same for every system
  (``flashfsdp.runtime.memory.PeakMemoryMeter``: CUDA ``max_memory_allocated``; CPU peak RSS).
- ``overhead_ms`` = step time - the unsharded step time: what sharding or replication costs over
  pure compute, exposed communication first. It is the measurable proxy of exposed communication
  for systems without a trace (FSDP2, DDP), and is also reported for flashfsdp. "unsharded" runs
  on the same W ranks at once, each rank training its own full replica on its own per-rank batch
  (the same ``--batch`` sequences the other systems give each rank) with no communication at all:
  the compute-only step under the same contention for cores.
- flashfsdp only, from ``flashfsdp.profile()`` over ``--profile-steps`` extra steps (largest
  rank): ``traced_comm_ms`` (busy time of the all-gather and reduce-scatter streams per step) and
  ``traced_exposed_ms`` (time the compute stream waited on them per step); see
  ``flashfsdp.runtime.trace``.
- ``unit_overhead_us`` = ``overhead_ms`` / units, in µs, units = layers + 1 (one per block and
  the root): the host cost of sharding per unit per step where communication is free;
  ``unit_hook_overhead_us`` the same of ``fwd_bwd_ms`` (the step up to the end of its backward:
  forward, backward and every hook, not the optimizer step), so that the hooks' cost is told
  apart from the optimizer's (torch's AdamW over DTensor parameters dispatches per parameter).

``--host-bound``: the host-bound case (48 tiny blocks, W = 1, unsharded vs flashfsdp vs FSDP2, no
trace), where a step is mostly the runtime's per-unit host work; written as ``step_host_bound_w1``.

Defaults follow the device that runs: CPU (no CUDA, or ``--cpu``): W = 2 ranks on gloo, a model
whose step takes about a second, fp32; CUDA: W = every local GPU on NCCL (flashfsdp through CuPy),
a ~1B-parameter model in bf16. Writes CSV, Markdown and PNGs (bars per system; a timeline of one
flashfsdp step) to ``--out`` (default
``bench-results/<device>/``; ``--record``: ``benchmarks/results/<device>/``).
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import time

import torch
import torch.nn as nn

from benchmarks import plots
from benchmarks.backward_all_gather import flashfsdp_backward_bytes, fsdp2_backward_bytes
from benchmarks.environment import device_setup, environment_columns
from benchmarks.outputs import add_output_arguments, output_dir
from benchmarks.tables import format_table, write_csv, write_markdown
from benchmarks.timing import interleaved_rounds
from flashfsdp.runtime.memory import PeakMemoryMeter

SYSTEMS = ("flashfsdp", "fsdp2", "ddp", "unsharded")
# Run only when named in --systems: flashfsdp with all_gather_dtype=torch.int8 (ZeRO++ qwZ).
EXTRA_SYSTEMS = ("flashfsdp-int8",)
# "<system>+compile": that system with each block compiled after sharding (block.compile(), the
# --compile-backend); run only when named, written as <tag>_compile.
COMPILED = "+compile"
EXTRA_SYSTEMS += ("flashfsdp" + COMPILED, "fsdp2" + COMPILED)
# flashfsdp with backward all-gather elision off (set_backward_all_gather_elision(False)); with
# --embedding-unit the embedding's backward all-gather is then made as by FSDP2.
EXTRA_SYSTEMS += ("flashfsdp-no-elision",)
# flashfsdp stepped by flashfsdp.optim.AdamW (one fused call per unit's flat shard) instead of
# torch's AdamW over its DTensor parameters (every other system steps torch's AdamW).
FLAT_OPTIM = "flashfsdp-flat-adamw"
EXTRA_SYSTEMS += (FLAT_OPTIM,)
# Defaults per device type: ("cuda" needs the GPUs' count, filled in by parse_args).
DEFAULTS = {
    "cpu": {"world_size": 2, "dim": 384, "layers": 6, "heads": 6, "seq": 128, "batch": 4, "param_dtype": "fp32"},
    "cuda": {"world_size": None, "dim": 2048, "layers": 18, "heads": 16, "seq": 2048, "batch": 4, "param_dtype": "bf16"},
}
# --host-bound: a model whose step is mostly per-unit host work (see the module docstring).
HOST_BOUND = {"world_size": 1, "dim": 32, "layers": 48, "heads": 2, "seq": 16, "batch": 2, "param_dtype": "fp32",
              "profile_steps": 0, "systems": ["unsharded", "flashfsdp", "fsdp2"]}
COLUMNS = ["system", "world_size", "params_M", "step_ms", "fwd_bwd_ms", "tokens_per_s", "peak_mem_MiB", "overhead_ms",
           "unit_overhead_us", "unit_hook_overhead_us", "traced_comm_ms", "traced_exposed_ms", "all_gather_MB", "bwd_all_gather_MB", "vs_fsdp2",
           "vs_unsharded"]


def _model(args, device: torch.device) -> nn.Module:
    from flashfsdp.models.llama import Llama, LlamaConfig  # noqa: PLC0415

    config = LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, max_seq_len=args.seq,
                         tie_embeddings=not args.embedding_unit)  # a tied embedding stays with the output
    with torch.device(device):
        model = Llama(config)
    model.init_weights(0)
    return model


def _wrap(system: str, model: nn.Module, args, device: torch.device) -> nn.Module:
    dtype = {"bf16": torch.bfloat16, "fp32": None}[args.param_dtype]
    if system.startswith("flashfsdp"):
        import flashfsdp  # noqa: PLC0415

        policy = flashfsdp.MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        if system == "flashfsdp-int8":  # int8 dequantises into a param_dtype: fp32 when none is set
            policy = flashfsdp.MixedPrecisionPolicy(param_dtype=dtype or torch.float32, reduce_dtype=torch.float32,
                                                    all_gather_dtype=torch.int8)
        if args.embedding_unit:
            flashfsdp.fully_shard(model.tok_embeddings, mp_policy=policy)
        for block in model.layers:
            flashfsdp.fully_shard(block, mp_policy=policy)
        model = flashfsdp.fully_shard(model, mp_policy=policy)
        model.set_backward_all_gather_elision(system != "flashfsdp-no-elision")
        return model
    if system == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        if args.embedding_unit:
            fully_shard(model.tok_embeddings, mp_policy=policy)
        for block in model.layers:
            fully_shard(block, mp_policy=policy)
        return fully_shard(model, mp_policy=policy)
    if dtype is not None:
        model = model.to(dtype)
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_system(rank: int, world_size: int, system: str, args) -> dict:
    torch.set_num_threads(max(1, args.threads))
    device = torch.device("cuda", rank) if args.device == "cuda" else torch.device("cpu")
    # Every system's libraries are loaded before the CPU baseline, so that none counts them.
    for module in ("flashfsdp", "flashfsdp.models.llama", "torch.distributed.fsdp", "torch.nn.parallel"):
        importlib.import_module(module)

    memory = PeakMemoryMeter(device)
    model = _wrap(system.removesuffix(COMPILED), _model(args, device), args, device)
    if system.endswith(COMPILED):  # compiled at the first (warm-up) step
        for block in model.layers:
            block.compile(backend=args.compile_backend)
    if system == FLAT_OPTIM:
        import flashfsdp.optim  # noqa: PLC0415

        opt = flashfsdp.optim.AdamW(model.parameters(), lr=1e-4)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # After sharding, before any step: the full model built before fully_shard does not count.
    memory.reset()
    gen = torch.Generator().manual_seed(1000 + rank)

    def step() -> float:
        """One step; returns when its forward and backward ended (``time.perf_counter``)."""
        tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen).to(device)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        _sync(device)
        backward_end = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return backward_end

    for _ in range(args.warmup):
        step()
    times, fwd_bwd = [], []
    for _ in range(args.steps):
        _sync(device)
        t0 = time.perf_counter()
        backward_end = step()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        fwd_bwd.append((backward_end - t0) * 1e3)
    out = {"step_ms": statistics.median(times), "fwd_bwd_ms": statistics.median(fwd_bwd),
           "peak_bytes": memory.peak_bytes(), "memory": memory.description,
           "params": sum(p.numel() for p in _model(args, torch.device("meta")).parameters())}
    if args.profile_steps > 0:
        out.update(_profiled(rank, system, model, step, device, args.profile_steps))
    return out


def _profiled(rank: int, system: str, model: nn.Module, step, device: torch.device, steps: int) -> dict:
    """``steps`` more steps, profiled: flashfsdp's communication, exposed time and all-gathered
    bytes per step (rank 0's spans of the last step for the timeline), or FSDP2's backward
    all-gather bytes per step; nothing for the other systems."""
    out: dict = {}
    if system.startswith("flashfsdp"):
        import flashfsdp  # noqa: PLC0415

        with flashfsdp.profile(device.type) as prof:
            for _ in range(steps):
                step()
        summary = prof.summary()
        out.update(comm_ms=summary["comm_ms"] / steps, exposed_ms=summary["exposed_ms"] / steps,
                   all_gather_bytes=_all_gathered_bytes(summary) / steps,
                   bwd_all_gather_bytes=flashfsdp_backward_bytes(summary) / steps)
        if rank == 0 and system == "flashfsdp":
            out["spans"] = [(s.kind, s.unit, s.stream, s.step, float(s.start), float(s.end)) for s in prof.spans
                            if s.step == prof.step]
    if system == "fsdp2":  # counting its backward all-gathers
        with fsdp2_backward_bytes() as counted:
            for _ in range(steps):
                step()
        out["bwd_all_gather_bytes"] = counted["bytes"] / steps
    return out


def _all_gathered_bytes(summary: dict) -> int:
    """Bytes this rank's all-gathers delivered over a profile (``Profile.summary()``): its counters
    of the bytes each unit's all-gathers write, forward and backward (T x param_dtype bytes per
    unit, or the packed int8 chunks and scales; a unit gathered in a bucket counts its own)."""
    counters = summary["counters"]
    return counters.get("all_gather_bytes_forward", 0) + counters.get("all_gather_bytes_backward", 0)


def _round_spreads(rounds: dict[str, list[list[dict]]]) -> dict[str, dict[str, tuple[float, float]]]:
    """Per system, (min, max) over the rounds of each round's figure (slowest rank's step_ms,
    largest rank's peak in MiB, and step_ms minus the same round's unsharded step_ms)."""
    def per_round(system: str, key: str, scale: float = 1.0) -> list[float]:
        return [max(r[key] for r in run) * scale for run in rounds[system]]

    spreads = {}
    for system in rounds:
        steps = per_round(system, "step_ms")
        overhead = ([s - u for s, u in zip(steps, per_round("unsharded", "step_ms"))] if "unsharded" in rounds
                    else [math.nan])
        peaks = per_round(system, "peak_bytes", 2**-20)
        spreads[system] = {"step_ms": (min(steps), max(steps)), "overhead_ms": (min(overhead), max(overhead)),
                           "peak_mem_MiB": (min(peaks), max(peaks))}
    return spreads


def _plot(path, rows: list[dict], spreads: dict[str, dict[str, tuple[float, float]]], *, title: str):
    """The bars of ``step_w<W>.png`` (step time, overhead, peak memory per system) with error bars
    from the rounds; returns the figure."""
    names = [r["system"] for r in rows]

    def spread(key: str) -> list[tuple[float, float]]:
        return [spreads[name][key] for name in names]

    return plots.bar_chart(path, {
        "step time (ms)": (names, {"step_ms": [r["step_ms"] for r in rows]}, {"step_ms": spread("step_ms")}),
        "communication overhead per step (ms)": (names, {
            "step - unsharded step": [r["overhead_ms"] for r in rows],
            "traced exposed (flashfsdp)": [r["traced_exposed_ms"] for r in rows]},
            {"step - unsharded step": spread("overhead_ms")}),
        "peak memory per rank (MiB)": (names, {"peak": [r["peak_mem_MiB"] for r in rows]},
                                       {"peak": spread("peak_mem_MiB")}),
    }, ylabel="", xlabel="system", title=title)


def _timeline(path, spans):
    """``step_w<W>_timeline.png``: one traced flashfsdp step of rank 0 on three lanes, with a legend
    of the span colours beside the plot; returns the figure."""
    plt = plots.pyplot()
    lanes = {"compute": 2, "all_gather": 1, "reduce_scatter": 0}
    colors = {"forward": "tab:blue", "backward": "tab:orange", "copy_in": "tab:gray", "all_gather": "tab:green",
              "pack": "tab:gray", "reduce_scatter": "tab:red", "accumulate": "tab:purple"}
    t0 = min(s[4] for s in spans)
    fig, ax = plt.subplots(figsize=(12, 3))
    for kind, unit, stream, _, start, end in spans:
        lane = lanes.get(stream, 3) + (0.5 if kind.startswith("wait_") else 0)
        color = "black" if kind.startswith("wait_") else colors.get(kind, "tab:olive")
        ax.broken_barh([((start - t0) / 1e3, max((end - start) / 1e3, 0.01))], (lane - 0.2, 0.4), color=color)
    ax.set_yticks([0, 1, 2, 2.5], ["reduce-scatter", "all-gather", "compute", "waits (exposed)"])
    ax.set_xlabel("ms since the step's first span (rank 0)")
    ax.set_title("flashfsdp: one training step")
    kinds = dict.fromkeys(kind for kind, *_ in spans if not kind.startswith("wait_"))
    plots.color_legend(ax, {**{kind.replace("_", " "): colors.get(kind, "tab:olive") for kind in kinds},
                            "wait (exposed communication)": "black"}, title="span")
    return plots.save(fig, path)


def parse_args(argv=None, cuda_available: bool | None = None) -> argparse.Namespace:
    """The command line, with device-dependent defaults filled in for the device that will run.

    Args:
        argv: arguments (default ``sys.argv[1:]``).
        cuda_available: whether CUDA may be used (default ``torch.cuda.is_available()``); with
            ``--cpu`` or without CUDA every default is the CPU one.

    Returns the namespace with ``device`` ("cpu" or "cuda") added.
    Raises SystemExit (argparse's error) for a world size below 1 or a non-positive size.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-size", type=int, default=None,
                        help="ranks (default: 2 on CPU, every local GPU on CUDA)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is available")
    parser.add_argument("--dim", type=int, default=None, help="default: 384 on CPU, 2048 on CUDA")
    parser.add_argument("--layers", type=int, default=None, help="default: 6 on CPU, 18 on CUDA")
    parser.add_argument("--heads", type=int, default=None, help="default: 6 on CPU, 16 on CUDA")
    parser.add_argument("--seq", type=int, default=None, help="default: 128 on CPU, 2048 on CUDA")
    parser.add_argument("--batch", type=int, default=None, help="sequences per rank per step (default 4)")
    parser.add_argument("--param-dtype", choices=("bf16", "fp32"), default=None,
                        help="default: fp32 on CPU, bf16 on CUDA")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=None,
                        help="traced flashfsdp steps (0: no trace; default 3, 0 with --host-bound)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (CPU)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every system, interleaved")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS + EXTRA_SYSTEMS, default=None,
                        help="default: all but flashfsdp-int8 (int8 all-gathers); unsharded, flashfsdp, fsdp2 "
                             "with --host-bound")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend of the +compile systems (default inductor)")
    parser.add_argument("--embedding-unit", action="store_true",
                        help="untied embedding wrapped as a unit of its own (flashfsdp and FSDP2), whose backward "
                             "needs no all-gather: compare flashfsdp, flashfsdp-no-elision and fsdp2 in "
                             "bwd_all_gather_MB")
    parser.add_argument("--host-bound", action="store_true",
                        help="the host-bound case: 48 tiny blocks, W = 1 (any size option given still applies)")
    add_output_arguments(parser)
    parser.add_argument("--in-process", action="store_true",
                        help="W = 1 only: run every system in this process, not one fresh process per run "
                             "(quick checks: the systems then share the process's memory and caches)")
    args = parser.parse_args(argv)
    if cuda_available is None:
        cuda_available = torch.cuda.is_available()
    args.device = "cuda" if cuda_available and not args.cpu else "cpu"
    defaults = {**DEFAULTS[args.device], "profile_steps": 3, "systems": list(SYSTEMS)}
    for key, value in (HOST_BOUND if args.host_bound else defaults).items():
        if getattr(args, key) is None:
            setattr(args, key, value if value is not None else max(1, torch.cuda.device_count()))
    if args.world_size < 1:
        parser.error("--world-size must be >= 1")
    if args.in_process and args.world_size != 1:
        parser.error(f"--in-process runs one rank: it needs --world-size 1, got {args.world_size}")
    for key in ("dim", "layers", "heads", "seq", "batch", "steps", "rounds"):
        if getattr(args, key) < 1:
            parser.error(f"--{key} must be >= 1, got {getattr(args, key)}")
    return args


def _notes(args, backend: str, memory: str) -> list[str]:
    if args.param_dtype == "bf16":
        dtypes = ("dtypes: flashfsdp and FSDP2 keep fp32 parameters and AdamW state and compute in bf16 "
                  "(MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)); DDP and unsharded run the model "
                  "cast to bf16 as given (bf16 parameters, gradients, AdamW state and DDP all-reduce, no fp32 "
                  "master copy), so their memory and step time are those of pure bf16 training, not of the same "
                  "mixed precision.")
    else:
        dtypes = "dtypes: every system holds, computes and reduces in fp32 (no mixed precision)."
    return [
        f"Llama dim {args.dim}, {args.layers} layers, seq {args.seq}, {args.batch} sequences per rank, "
        f"{args.param_dtype}; W = {args.world_size} ({backend}); median of {args.steps} steps after {args.warmup} "
        f"warm-up, median over {args.rounds} interleaved rounds of every system.",
        dtypes,
        f"peak_mem_MiB: per rank (largest rank), from after the model is sharded/wrapped to the end of the timed "
        f"steps, for every system alike: {memory}.",
        "overhead_ms = step_ms - unsharded step_ms, for every system: the measurable proxy of exposed communication "
        "(it also holds every other cost of sharding/replication: copy-in, packing, extra allocation). 'unsharded' "
        "runs on the same W ranks at once, each training its own replica on its own per-rank batch, with no "
        "communication: the compute-only step.",
        f"unit_overhead_us = overhead_ms / {args.layers + 1} units (one per block and the root), in µs: the host "
        "cost of sharding per unit per step where communication costs little (W = 1: the host-bound case); "
        "unit_hook_overhead_us: the same of fwd_bwd_ms (forward and backward with every hook, no optimizer step).",
        "traced_comm_ms / traced_exposed_ms: flashfsdp only, from its own trace (flashfsdp.profile) over "
        f"{args.profile_steps} extra steps, per step, largest rank: busy time of the all-gather and reduce-scatter "
        "streams (collectives from issue to completion, union per stream) and time the compute stream waited on "
        "them. FSDP2 and DDP have no such trace.",
        "all_gather_MB: flashfsdp only, bytes its all-gathers delivered per step on the largest rank (the "
        "collectives' outputs: T x param_dtype bytes per unit, or W x (S + 4 per 256 values) with "
        "all_gather_dtype=int8), counted from the same trace; flashfsdp-int8 runs param_dtype "
        f"{args.param_dtype if args.param_dtype == 'bf16' else 'fp32 (explicit)'} with int8 all-gathers.",
        "bwd_all_gather_MB: bytes all-gathered during backward per step on the largest rank (the outputs), over "
        f"{args.profile_steps} extra steps: flashfsdp from its trace, FSDP2 by wrapping torch.distributed."
        "all_gather_single; flashfsdp skips the backward all-gather of units whose backward reads no parameter "
        "(flashfsdp-no-elision does not)" + (", here the embedding (--embedding-unit)." if args.embedding_unit else "."),
    ] + _compile_notes(args)


def _compile_notes(args) -> list[str]:
    if not any(s.endswith(COMPILED) for s in args.systems):
        return []
    return [f"+compile: the system with each block compiled after sharding (block.compile(backend="
            f"'{args.compile_backend}'), hooks included; the units' hooks run eagerly between the blocks' graphs), "
            f"the root uncompiled; compilation happens in the {args.warmup} warm-up steps, not timed."]


def _rows(rounds: dict[str, list[list[dict]]], args, env) -> tuple[list[dict], list | None, str]:
    """One row per system from every round's per-rank results (each figure: the median over the
    rounds, the slowest rank's), with the overheads against the unsharded model and the ratio
    to FSDP2; rank 0's spans for the timeline; the memory meter's description."""
    rows, spans, memory = [], None, "?"
    for system in args.systems:
        runs = rounds[system]
        results = runs[0]
        for key in ("step_ms", "fwd_bwd_ms", "peak_bytes", "comm_ms", "exposed_ms", "all_gather_bytes",
                    "bwd_all_gather_bytes"):
            if key in results[0]:
                for rank, r in enumerate(results):
                    r[key] = statistics.median(run[rank][key] for run in runs)
        memory = results[0]["memory"]
        step_ms = max(r["step_ms"] for r in results)
        tokens = args.world_size * args.batch * args.seq
        row = {"system": system, "world_size": args.world_size, "params_M": results[0]["params"] / 1e6,
               "step_ms": step_ms, "fwd_bwd_ms": max(r["fwd_bwd_ms"] for r in results),
               "tokens_per_s": tokens / (step_ms / 1e3),
               "peak_mem_MiB": max(r["peak_bytes"] for r in results) / 2**20,
               "traced_comm_ms": max((r["comm_ms"] for r in results if "comm_ms" in r), default=math.nan),
               "traced_exposed_ms": max((r["exposed_ms"] for r in results if "exposed_ms" in r), default=math.nan),
               "all_gather_MB": max((r["all_gather_bytes"] / 1e6 for r in results if "all_gather_bytes" in r),
                                    default=math.nan),
               "bwd_all_gather_MB": max((r["bwd_all_gather_bytes"] / 1e6 for r in results
                                         if "bwd_all_gather_bytes" in r), default=math.nan),
               **env.stamp()}
        spans = results[0].get("spans", spans)
        rows.append(row)
    by = {r["system"]: r for r in rows}
    for r in rows:
        r["overhead_ms"] = r["step_ms"] - by["unsharded"]["step_ms"] if "unsharded" in by else math.nan
        r["unit_overhead_us"] = r["overhead_ms"] * 1e3 / (args.layers + 1)
        r["unit_hook_overhead_us"] = ((r["fwd_bwd_ms"] - by["unsharded"]["fwd_bwd_ms"]) * 1e3 / (args.layers + 1)
                                      if "unsharded" in by else math.nan)
        r["vs_fsdp2"] = r["step_ms"] / by["fsdp2"]["step_ms"] if "fsdp2" in by else math.nan
        r["vs_unsharded"] = r["step_ms"] / by["unsharded"]["step_ms"] if "unsharded" in by else math.nan
    return rows, spans, memory


def main(argv=None) -> list[dict]:
    """Run the benchmark (see the module docstring); return the rows written."""
    args = parse_args(argv)
    device, env, backend = device_setup(args.device)
    # each figure is the median over interleaved rounds of every system
    rounds = interleaved_rounds(_run_system, args.systems, args, backend)
    spreads = _round_spreads(rounds)
    rows, spans, memory = _rows(rounds, args, env)
    rows = [{c: r[c] for c in COLUMNS} | env.stamp() for r in rows]
    print(f"{env.device_name}: W={args.world_size} {backend}, Llama dim {args.dim} x {args.layers} layers, "
          f"seq {args.seq}, {args.batch} seq/rank, {args.param_dtype}")
    print(format_table(rows, COLUMNS))
    out = output_dir(env.slug, out=args.out, record=args.record)
    tag = f"step_host_bound_w{args.world_size}" if args.host_bound else f"step_w{args.world_size}"
    tag += "_compile" if any(s.endswith(COMPILED) for s in args.systems) else ""
    tag += "_embedding_unit" if args.embedding_unit else ""
    write_csv(rows, out / f"{tag}.csv")
    write_markdown(rows, COLUMNS + environment_columns(), out / f"{tag}.md", title="Training step", env=env,
                   notes=_notes(args, backend, memory))
    _plot(out / f"{tag}.png", rows, spreads, title=f"Training step, W={args.world_size}, {env.device_name} "
          f"(bars: median over {args.rounds} rounds; error bars: min to max over the rounds)")
    if spans:
        _timeline(out / f"{tag}_timeline.png", spans)
    return rows


if __name__ == "__main__":
    main()
