"""Overlap simulator: validation against a measured step, then Llama-style 8B/70B predictions.

    python -m benchmarks.overlap [--quick] [--skip-validation] [--skip-sweep] [--flops 400e12] ...

1. **Validation (CPU, W = 2, gloo).** (a) Calibrate the link: time gloo all-gathers and
   reduce-scatters of 64 KB..16 MB and fit the ring model's α and β by least squares.
   (b) Measure real flashfsdp training steps of a small Llama (one unit per block plus the root,
   fp32, AdamW) with the default prefetch policy and with prefetch off: the median step time
   without tracing, and per-unit compute (each unit's own time, host-side waits and copy-ins
   taken out, pack and accumulate added to its backward) from ``flashfsdp.profile()``.
   (c) Simulate those units with the fitted link, one shared communication FIFO (gloo runs every
   collective on one worker queue) and CPU-host semantics (waits block the thread, copy-in on it).
   (d) Print measured vs predicted step time and the relative error.
2. **Predictions.** Llama-3-style 8B and 70B, bf16 parameters, fp32 gradient reduction, compute
   from FLOPs at an assumed achieved rate, for W = 8..4096 over NVLink, 400 Gb/s InfiniBand and
   100 Gb/s Ethernet, under every prefetch setting of ``flashfsdp.sim.SETTINGS``.

Writes ``overlap_validation.{csv,md,png}`` and ``overlap.{csv,md,png}`` to
``benchmarks/results/<device>/``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn as nn

from benchmarks.common import environment, environment_columns, format_table, results_dir, write_csv, write_markdown
from benchmarks.distributed import run_ranks
from flashfsdp import sim

HOST_KINDS = ("wait_all_gather", "wait_reduce_scatter", "copy_in", "pack", "accumulate")


# ------------------------------------------------------------------------------ calibration


class _Calibration:
    """Times gloo all-gathers and reduce-scatters of fp32 buffers (unsharded sizes in bytes).

    One :meth:`round` runs every size and both collectives once; the rounds are interleaved with the
    measured training steps, so that the link is fitted under the same load from other jobs on the
    shared cores as the steps it is compared with.
    """

    KINDS = ("all_gather", "reduce_scatter")

    def __init__(self, sizes: list[int], world_size: int):
        from flashfsdp.runtime.process_group import ProcessGroupCommunicator  # noqa: PLC0415

        self.comm = ProcessGroupCommunicator()
        self.world_size = world_size
        self.totals = [nbytes // 4 // world_size * world_size for nbytes in sizes]
        self.tensors = [(torch.ones(total), torch.ones(total // world_size)) for total in self.totals]
        self.samples = {(kind, i): [] for kind in self.KINDS for i in range(len(sizes))}

    def round(self, record: bool = True) -> None:
        import torch.distributed as dist  # noqa: PLC0415

        for (kind, i), times in self.samples.items():
            full, shard = self.tensors[i]
            dist.barrier()
            t0 = time.perf_counter()
            if kind == "all_gather":
                self.comm.all_gather_into_tensor(full, shard).wait()
            else:
                self.comm.reduce_scatter_tensor(shard, full, op="sum").wait()
            if record:
                times.append(time.perf_counter() - t0)

    def results(self) -> dict:
        """``{kind: [(nbytes, W, median seconds), ...]}``, the input of ``sim.fit_link``."""
        return {kind: [(total * 4, self.world_size, statistics.median(self.samples[kind, i]))
                       for i, total in enumerate(self.totals)] for kind in self.KINDS}


# ------------------------------------------------------------------------------ measured step


def _inside(span, outer) -> bool:
    return outer.start <= span.start and span.end <= outer.end


def _own_ms(span, children, host) -> float:
    """``span`` minus its child units' spans and the host-side spans between them (ms)."""
    inner = [c for c in children if _inside(c, span)]
    gaps = [h for h in host if _inside(h, span) and not any(_inside(h, c) for c in inner)]
    return (span.duration_us() - sum(c.duration_us() for c in inner) - sum(h.duration_us() for h in gaps)) / 1e3


def _between_ms(start: float, end: float, host) -> float:
    """Microsecond interval [start, end] minus the host-side spans inside it, in ms."""
    return max(0.0, (end - start) - sum(h.duration_us() for h in host if start <= h.start and h.end <= end)) / 1e3


def _inputs_from_profile(prof, shard_bytes: dict[str, int], root: str = "<root>") -> dict:
    """The simulator's compute inputs, per traced step: ``{step: {"units": {name: {"forward_ms",
    "backward_ms"}}, "root_forward_before", "root_backward_after", "loss_ms", "copy_in_ms", ...}}``.

    CPU: everything but the collectives runs on the one Python thread, so each unit's own compute is
    its span minus nested units and minus the host-side spans (waits, copy-ins, packs,
    accumulates) inside it; the pack and accumulate of a unit are then added to its backward.
    """
    prof.resolve()
    per_step: dict[int, dict] = {}
    steps = sorted({s.step for s in prof.spans})
    for step in steps:
        spans = [s for s in prof.spans if s.step == step]
        host = [s for s in spans if s.kind in HOST_KINDS]
        fwd = {s.unit: s for s in spans if s.kind == "forward"}
        bwd = {s.unit: s for s in spans if s.kind == "backward"}
        if root not in fwd or root not in bwd:
            continue
        blocks = [u for u in fwd if u != root]
        out = {}
        for u in fwd:
            children = [fwd[b] for b in blocks] if u == root else []
            bchildren = [bwd[b] for b in blocks] if u == root else []
            extra = sum(h.duration_us() for h in host if h.unit == u and h.kind in ("pack", "accumulate")) / 1e3
            out[u] = {"forward_ms": _own_ms(fwd[u], children, host),
                      "backward_ms": _own_ms(bwd[u], bchildren, host) + extra}
        first = min((fwd[b] for b in blocks), key=lambda s: s.start, default=None)
        last = max((bwd[b] for b in blocks), key=lambda s: s.end, default=None)
        r = out[root]
        before = _between_ms(fwd[root].start, first.start, host) if first else 0.0
        after = _between_ms(last.end, bwd[root].end, host) if last else 0.0
        copy = [h for h in host if h.kind == "copy_in"]
        per_step[step] = {
            "units": out,
            "root_forward_before": min(1.0, before / r["forward_ms"]) if r["forward_ms"] > 0 else 0.0,
            "root_backward_after": min(1.0, after / (r["backward_ms"] or 1.0)),
            "loss_ms": _between_ms(fwd[root].end, bwd[root].start, host),
            "copy_in_ms": sum(h.duration_us() for h in copy) / 1e3,
            "copy_in_bytes": sum(shard_bytes.get(h.unit, 0) for h in copy),
            "exposed_ms": sum(s.duration_us() for s in spans if s.kind.startswith("wait_")) / 1e3,
        }
    return per_step


def _median_inputs(steps: list[dict]) -> dict:
    med = statistics.median
    units = {u: {k: med([s["units"][u][k] for s in steps]) for k in ("forward_ms", "backward_ms")}
             for u in steps[0]["units"]}
    scalars = {k: med([s[k] for s in steps]) for k in steps[0] if k != "units"}
    return {"units": units, **scalars}


def _measure_step(rank: int, world_size: int, args, schedules: list[str], sizes: list[int]) -> dict:
    """Train a small Llama with flashfsdp; per schedule: step times untraced and traced inputs;
    and the collectives of ``sizes`` bytes timed alone, round by round with the steps."""
    import flashfsdp  # noqa: PLC0415
    from flashfsdp.models.llama import Llama, LlamaConfig  # noqa: PLC0415
    torch.set_num_threads(1)
    config = LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, max_seq_len=args.seq)
    model = Llama(config)
    model.init_weights(0)
    for block in model.layers:
        flashfsdp.fully_shard(block)
    flashfsdp.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1000 + rank)
    outside = []  # seconds per step outside the units: batch, optimizer step, zero_grad

    def step() -> None:
        t0 = time.perf_counter()
        tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=gen)
        t1 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        outside.append((t1 - t0) + (time.perf_counter() - t2))

    for _ in range(args.warmup):  # the first forward makes the root context (and names the units)
        step()
    ctx = model._flashfsdp_state.ctx
    meta = {}
    for unit in (m._flashfsdp_state.unit for m in model.modules() if hasattr(m, "_flashfsdp_state")):
        meta[unit.name] = {
            "numel": sum(g.layout.total for g in unit.groups),
            "param_bytes": max((g.param_dtype.itemsize for g in unit.groups), default=4),
            "reduce_bytes": (unit.reduce_dtype or unit.groups[0].param_dtype).itemsize if unit.groups else 4,
        }
    # copy-in bytes per unit: this rank's shard cast into param_dtype
    shard_bytes = {name: m["numel"] // world_size * m["param_bytes"] for name, m in meta.items()}
    # Rounds interleave the link calibration, the schedules and the untraced/traced steps, so that
    # all see the same machine load (the cores are shared with other jobs): per round, every
    # calibration collective once, then per schedule one step to settle, one untraced timed step,
    # one traced step.
    calibration = _Calibration(sizes, world_size)
    calibration.round(record=False)
    timed = {s: [] for s in schedules}
    traced = {s: [] for s in schedules}
    inputs = {s: [] for s in schedules}
    outside_traced = {s: [] for s in schedules}
    last_spans = {}  # the last traced step's spans (seconds), for the timeline plot
    for _ in range(args.steps):
        calibration.round()
        for schedule in schedules:
            ctx.policy = SCHEDULES[schedule].policy()
            step()
            t0 = time.perf_counter()
            step()
            timed[schedule].append((time.perf_counter() - t0) * 1e3)
            with flashfsdp.profile("cpu") as prof:
                t0 = time.perf_counter()
                step()
                traced[schedule].append((time.perf_counter() - t0) * 1e3)
            outside_traced[schedule].append(outside[-1] * 1e3)
            inputs[schedule].extend(_inputs_from_profile(prof, shard_bytes).values())
            last_spans[schedule] = [sim.Span("compute" if s.kind not in ("all_gather", "reduce_scatter") else "comm",
                                             s.kind, s.unit, float(s.start) / 1e6, float(s.end) / 1e6)
                                    for s in prof.spans]
    results = {s: {"step_ms": statistics.median(timed[s]), "traced_step_ms": statistics.median(traced[s]),
                   "outside_ms": statistics.median(outside_traced[s]), "inputs": _median_inputs(inputs[s]),
                   "spans": last_spans[s]}
               for s in schedules}
    return {"schedules": results, "calibration": calibration.results(), "units": meta, "params": sum(v["numel"] for v in meta.values())}


def _sim_model(unit_meta: dict, inputs: dict, outside_ms: float) -> sim.Model:
    """The simulator's model of the measured Llama: bytes from the runtime's units, compute traced."""
    ordered = ["<root>"] + sorted((u for u in inputs["units"] if u != "<root>"), key=lambda n: int(n.split(".")[-1]))
    units = {}
    for name in ordered:
        meta = unit_meta[name]
        units[name] = {"numel": meta["numel"], "param_bytes": meta["param_bytes"], "reduce_bytes": meta["reduce_bytes"],
                       **inputs["units"][name]}
    return sim.model_from_measurements(
        units, root_forward_before=inputs["root_forward_before"], root_backward_after=inputs["root_backward_after"],
        loss_s=inputs["loss_ms"] / 1e3, optimizer_s=outside_ms / 1e3, name="validation Llama")


SCHEDULES = {"fwd+bwd (default)": sim.Setting("fwd+bwd (default)"),
             "no prefetch": sim.Setting("no prefetch", forward=False, backward=False)}


def validate(args, env) -> tuple[list[dict], dict]:
    """Calibrate, measure and simulate at W = 2 on CPU; returns rows and the default's timeline."""
    sizes = [2**k for k in range(16, 25, 2)]  # 64 KiB .. 16 MiB
    load_before = os.getloadavg()[0]
    measured = run_ranks(_measure_step, 2, args, list(SCHEDULES), sizes, backend="gloo")
    rank0 = measured[0]
    cal = rank0["calibration"]
    link = sim.fit_link("gloo W=2 (fitted)", cal["all_gather"], cal["reduce_scatter"])
    print(f"calibration: {link.describe()}")
    for kind in ("all_gather", "reduce_scatter"):
        fit = link.all_gather_s if kind == "all_gather" else link.reduce_scatter_s
        print("  " + kind + ": " + ", ".join(f"{n / 2**20:.2g} MiB {t * 1e3:.2f} ms (fit {fit(n, w) * 1e3:.2f})"
                                             for n, w, t in cal[kind]))
    rows, timelines = [], {}
    # each schedule predicted from its own trace; then "no prefetch" from the default's trace (does
    # the simulator predict what changing the policy does?)
    for schedule, source in [(s, s) for s in SCHEDULES] + [("no prefetch", "fwd+bwd (default)")]:
        traced = rank0["schedules"][source]
        inputs = traced["inputs"]
        copy_bandwidth = inputs["copy_in_bytes"] / (inputs["copy_in_ms"] / 1e3) if inputs["copy_in_ms"] > 0 else None
        model = _sim_model(rank0["units"], inputs, traced["outside_ms"])
        pred = sim.simulate(model, 2, link, shared_comm_stream=True, host_blocking=True,
                            copy_bandwidth=copy_bandwidth, record_timeline=True, steps=3,
                            **SCHEDULES[schedule].simulate_kwargs(model))
        if source == schedule:
            spans = traced["spans"]
            t0 = min(x.start for x in spans)
            timelines[f"measured (rank 0, traced), {schedule}"] = [
                sim.Span(x.stream, x.kind, x.unit, x.start - t0, x.end - t0) for x in spans]
            timelines[f"predicted, {schedule}"] = pred.timeline
        per_rank = [m["schedules"][schedule] for m in measured]
        step_ms = statistics.median([r["step_ms"] for r in per_rank])
        rows.append({
            "schedule": schedule, "inputs_traced_under": source, "world_size": 2, "params_M": rank0["params"] / 1e6,
            "measured_step_ms": step_ms, "measured_traced_step_ms": per_rank[0]["traced_step_ms"],
            "predicted_step_ms": pred.step_s * 1e3, "error_pct": (pred.step_s * 1e3 / step_ms - 1) * 100,
            "compute_ms": pred.compute_s * 1e3,
            "measured_exposed_ms": per_rank[0]["inputs"]["exposed_ms"], "predicted_exposed_ms": pred.exposed_s * 1e3,
            "predicted_comm_ms": pred.comm_s * 1e3, "copy_in_ms": pred.host_copy_s * 1e3,
            "copy_GBps": (copy_bandwidth or float("nan")) / 1e9,
            "alpha_us": link.alpha_s * 1e6, "beta_GBps": link.bandwidth / 1e9,
            "rs_alpha_us": link.rs_alpha_s * 1e6, "rs_beta_GBps": link.rs_bandwidth / 1e9,
            "rank_step_ms": " / ".join(f"{r['step_ms']:.1f}" for r in per_rank), **env.stamp(),
        })
    load = (load_before, os.getloadavg()[0])
    for row in rows:
        row["load_avg"] = f"{load[0]:.1f} -> {load[1]:.1f}"
    return rows, {"timelines": timelines, "link": link, "calibration": cal, "load": load}


# ------------------------------------------------------------------------------ predictions


def sweep(args) -> list[dict]:
    """Every model × link × W × setting."""
    models = [sim.llama3_8b(tokens_per_rank=args.tokens, flops_per_s=args.flops),
              sim.llama3_70b(tokens_per_rank=args.tokens, flops_per_s=args.flops)]
    worlds = [2**k for k in range(3, 13)] if not args.quick else [8, 64, 512, 4096]
    rows = []
    for model in models:
        for key in ("nvlink", "ib400", "eth100"):
            link = sim.get_link(key)
            for world_size in worlds:
                for pred in sim.compare_settings(model, world_size, link):
                    rows.append({"model": model.name, **pred.row(),
                                 "alpha_us": link.alpha_s * 1e6, "beta_GBps": link.bandwidth / 1e9,
                                 "ag_per_block_ms": link.all_gather_s(model.blocks[0].unsharded_bytes(world_size), world_size) * 1e3,
                                 "rs_per_block_ms": link.reduce_scatter_s(model.blocks[0].reduce_bytes_total(world_size), world_size) * 1e3,
                                 "block_fwd_ms": model.blocks[0].forward_s * 1e3,
                                 "block_bwd_ms": model.blocks[0].backward_s * 1e3})
    return rows


# ------------------------------------------------------------------------------ plots


def _plot_sweep(rows: list[dict], path, title: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    models = list(dict.fromkeys(r["model"] for r in rows))
    links = list(dict.fromkeys(r["link"] for r in rows))
    styles = {"fwd+bwd (default)": "-", "no prefetch": ":"}
    fig, axes = plt.subplots(len(models), 2, figsize=(12, 4 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        for j, metric in enumerate(("step_ms", "efficiency")):
            ax = axes[i, j]
            for k, link in enumerate(links):
                for setting, style in styles.items():
                    pts = [(r["world_size"], r[metric]) for r in rows
                           if r["model"] == model and r["link"] == link and r["setting"] == setting]
                    if pts:
                        ax.plot(*zip(*pts), style, marker="o", ms=3, color=f"C{k}",
                                label=f"{link}, {setting}")
            if metric == "step_ms":
                compute = next(r["compute_ms"] for r in rows if r["model"] == model)
                ax.axhline(compute, color="black", lw=0.8, ls="--", label="pure compute")
                ax.set_yscale("log")
                ax.set_ylabel("predicted step time (ms)")
            else:
                ax.set_ylim(0, 1.05)
                ax.set_ylabel("efficiency (compute / step)")
            ax.set_xscale("log", base=2)
            ax.set_xlabel("world size W (ranks)")
            ax.set_title(model)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _plot_timelines(timelines: dict, path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    colors = {"forward": "tab:blue", "backward": "tab:orange", "all_gather": "tab:green", "reduce_scatter": "tab:red",
              "copy_in": "tab:gray", "pack": "tab:gray", "accumulate": "tab:gray", "loss": "tab:cyan",
              "optimizer": "tab:purple"}
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.9 * len(timelines)), squeeze=False, sharex=True)
    for ax, (name, spans) in zip(axes[:, 0], timelines.items()):
        for s in sorted(spans, key=lambda x: x.start - x.end):  # longest first: nested spans stay visible
            lane = 1 if s.stream == "compute" else 0
            color = "black" if s.kind.startswith("wait_") else colors.get(s.kind, "tab:olive")
            ax.broken_barh([(s.start * 1e3, max((s.end - s.start) * 1e3, 0.01))], (lane - 0.3, 0.6), color=color,
                           alpha=0.6 if lane == 0 else 1.0)
        ax.set_yticks([0, 1], ["collectives", "compute thread"])
        if name.startswith("measured"):
            ax.set_yticks([0, 1], ["collectives\n(issue→done seen)", "compute thread"])
        ax.set_title(f"{name} — W=2 gloo; blue forward, orange backward, green all-gather, red reduce-scatter, "
                     "gray copy-in/pack/accumulate, black exposed waits", fontsize=8)
    axes[-1, 0].set_xlabel("ms")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------ main


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps, sizes and world sizes")
    parser.add_argument("--skip-validation", action="store_true", help="predictions only (no processes)")
    parser.add_argument("--skip-sweep", action="store_true", help="validation only")
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per schedule (default 12; quick 4)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; quick 1)")
    parser.add_argument("--flops", type=float, default=400e12, help="assumed achieved FLOP/s per GPU (8B/70B)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank per step (8B/70B)")
    args = parser.parse_args(argv)
    args.steps = args.steps or (4 if args.quick else 12)
    args.warmup = args.warmup or (1 if args.quick else 3)
    if args.steps < 1 or args.flops <= 0 or args.tokens < 1:
        parser.error("--steps, --flops and --tokens must be positive")
    env = environment(torch.device("cpu"))
    out = results_dir(env.slug)
    result = {}
    if not args.skip_validation:
        rows, extra = validate(args, env)
        columns = ["schedule", "inputs_traced_under", "measured_step_ms", "predicted_step_ms", "error_pct",
                   "compute_ms", "measured_exposed_ms", "predicted_exposed_ms", "predicted_comm_ms", "copy_in_ms",
                   "rank_step_ms"]
        print(f"\nValidation: {env.device_name}, W=2 gloo, Llama dim {args.dim} x {args.layers} layers, seq {args.seq}, "
              f"{args.batch} seq/rank, fp32; {extra['link'].describe()}")
        print(format_table(rows, columns))
        notes = [
            f"Llama dim {args.dim}, {args.layers} layers, {args.heads} heads, seq {args.seq}, {args.batch} sequences "
            f"per rank, fp32, AdamW; one unit per block + root; W = 2 ranks on gloo, 1 intra-op thread each; "
            f"measured: median of {args.steps} untraced steps after {args.warmup} warm-up (the median over ranks).",
            f"Link fitted to gloo collectives of {len(extra['calibration']['all_gather'])} sizes (64 KiB..16 MiB): "
            f"{extra['link'].describe()}. Copy-in bandwidth (copy_GBps in the CSV): the shard bytes over the "
            "traced copy-in time.",
            "Prediction: per-unit compute (median over traced steps; waits and copy-ins taken out, pack and "
            "accumulate added to the unit's backward) from steps traced under the schedule named in "
            "inputs_traced_under; one shared gloo FIFO; CPU-host semantics (waits block the thread, copy-in on it). "
            "Untraced and traced steps of both schedules are interleaved round by round (same machine load).",
            "Caveat: 2 ranks on 2 cores shared with other jobs (1-minute load average before -> after: "
            f"{extra['load'][0]:.1f} -> {extra['load'][1]:.1f}): each rank's compute thread and gloo's threads compete "
            "for cores, so the traced compute already includes the slow-down that overlapping communication causes, "
            "and a rank descheduled by another job makes its peer wait inside collectives (measured exposed time that "
            "the one-rank model does not have).",
        ]
        write_csv(rows, out / "overlap_validation.csv")
        write_markdown(rows, columns + environment_columns(), out / "overlap_validation.md",
                       title="Overlap simulator: validation (measured vs predicted step)", env=env, notes=notes)
        _plot_timelines(extra["timelines"], out / "overlap_validation.png")
        result["validation"] = rows
    if not args.skip_sweep:
        rows = sweep(args)
        for r in rows:
            r.update(env.stamp())
        assumptions = [
            f"Compute: 6 x (matmul params) x {args.tokens} tokens per rank per step, 1:2 forward:backward, at an "
            f"assumed achieved {args.flops / 1e12:.0f} TFLOP/s per GPU (H100-class, ~40% of dense bf16 peak); "
            "attention-score FLOPs left out.",
            "Units: one per block + the root (embedding, final norm, untied output head); bf16 parameters (all-gather), "
            "fp32 gradient reduction (reduce-scatter), 16 bytes/param of sharded state (fp32 master, grad, Adam m, v).",
            "Links (assumptions, per GPU, one direction): " + "; ".join(
                sim.get_link(k).describe() for k in ("nvlink", "ib400", "eth100"))
            + ". Ring all-gather/reduce-scatter cost (W-1)/W*bytes/beta + (W-1)*alpha (Thakur et al. 2005; "
              "Patarasuk & Yuan 2009) at every W, even where NCCL would switch to trees: large-W latency is an upper bound.",
            "Streams: compute, all-gather and reduce-scatter, each collective at full link bandwidth (AG and RS do not "
            "share it); GPU semantics (waits only order streams). Peak memory per rank: sharded state + unsharded "
            "parameters, gradients and reduce-scatter buffers alive (activations not included).",
            "efficiency = pure compute / predicted step time.",
        ]
        columns = ["model", "link", "world_size", "setting", "step_ms", "compute_ms", "exposed_ms", "comm_ms",
                   "efficiency", "peak_GiB"]
        headline = [r for r in rows if r["setting"] == "fwd+bwd (default)"]
        print("\nPredictions (default schedule):")
        for a in assumptions:
            print(" - " + a)
        print(format_table(headline, columns))
        write_csv(rows, out / "overlap.csv")
        settings_w = [w for w in (8, 64, 512, 4096) if any(r["world_size"] == w for r in rows)]
        table = headline + [r for r in rows if r["setting"] != "fwd+bwd (default)" and r["world_size"] in settings_w
                            and r["link"].startswith("InfiniBand")]
        write_markdown(table, columns, out / "overlap.md", env=env, notes=assumptions + [
            "First the default schedule for every model, link and W; then every other prefetch setting on "
            f"InfiniBand at W = {', '.join(map(str, settings_w))} (all settings and links: overlap.csv)."],
            title="Overlap simulator: Llama-style 8B and 70B predictions")
        _plot_sweep(rows, out / "overlap.png",
                    f"Predicted step time and efficiency vs W ({args.tokens} tokens/rank, {args.flops / 1e12:.0f} "
                    "TFLOP/s achieved, ring alpha-beta links; solid: fwd+bwd prefetch, dotted: none)")
        result["sweep"] = rows
    return result


if __name__ == "__main__":
    main()
