"""End-to-end training step: flashfsdp vs torch FSDP2 vs DDP vs unsharded, in one run.

    python -m benchmarks.step [--world-size W] [--steps N] [--dim D --layers L --seq S --batch B]

Every system trains the same Llama-style model (``flashfsdp.models.llama``) from the same seed on
the same batches with AdamW, one block per unit plus the root for the sharded systems. Per system:
median step time over ``--steps`` timed steps after ``--warmup``, tokens/s (all ranks), peak memory
per rank (CUDA: ``max_memory_allocated``; CPU: growth of the peak resident set over the run), and for
flashfsdp the communication and exposed communication per step from ``flashfsdp.profile()``.
"unsharded" trains each rank's own replica without any communication: the compute floor.

Defaults: CPU, W = 2 ranks on gloo, a model whose step takes about a second; CUDA: W = every local
GPU on NCCL (flashfsdp through CuPy), a ~1B-parameter model in bf16. Writes CSV, Markdown and PNGs
(bars per system; a timeline of one flashfsdp step) to ``benchmarks/results/<device>/``.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.nn as nn

from benchmarks.common import environment, environment_columns, format_table, results_dir, write_csv, write_markdown
from benchmarks.distributed import run_ranks

SYSTEMS = ("flashfsdp", "fsdp2", "ddp", "unsharded")


def _model(args, device: torch.device) -> nn.Module:
    from flashfsdp.models.llama import Llama, LlamaConfig  # noqa: PLC0415

    config = LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, max_seq_len=args.seq)
    with torch.device(device):
        model = Llama(config)
    model.init_weights(0)
    return model


def _wrap(system: str, model: nn.Module, args, device: torch.device) -> nn.Module:
    dtype = {"bf16": torch.bfloat16, "fp32": None}[args.param_dtype]
    if system == "flashfsdp":
        import flashfsdp  # noqa: PLC0415

        policy = flashfsdp.MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        for block in model.layers:
            flashfsdp.fully_shard(block, mp_policy=policy)
        return flashfsdp.fully_shard(model, mp_policy=policy)
    if system == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        for block in model.layers:
            fully_shard(block, mp_policy=policy)
        return fully_shard(model, mp_policy=policy)
    if dtype is not None:
        model = model.to(dtype)
    if system == "ddp":
        from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return model


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _run_system(rank: int, world_size: int, system: str, args) -> dict:
    torch.set_num_threads(max(1, args.threads))
    device = torch.device("cuda", rank) if torch.cuda.is_available() and not args.cpu else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    base = _peak_bytes(device) if device.type == "cpu" else 0
    model = _wrap(system, _model(args, device), args, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1000 + rank)

    def step() -> None:
        tokens = torch.randint(0, 256, (args.batch, args.seq + 1), generator=gen).to(device)
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        _sync(device)
        t0 = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    out = {"step_ms": statistics.median(times), "peak_bytes": _peak_bytes(device) - base,
           "params": sum(p.numel() for p in _model(args, torch.device("meta")).parameters())}
    if system == "flashfsdp":
        import flashfsdp  # noqa: PLC0415

        with flashfsdp.profile() as prof:
            for _ in range(args.profile_steps):
                step()
        summary = prof.summary()
        out.update(comm_ms=summary["comm_ms"] / args.profile_steps, exposed_ms=summary["exposed_ms"] / args.profile_steps)
        if rank == 0:
            out["spans"] = [(s.kind, s.unit, s.stream, s.step, float(s.start), float(s.end)) for s in prof.spans
                            if s.step == prof.step]
    return out


def _timeline(path, spans) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

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
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cuda = torch.cuda.is_available()
    parser.add_argument("--world-size", type=int, default=torch.cuda.device_count() if cuda else 2)
    parser.add_argument("--cpu", action="store_true", help="run on CPU even when CUDA is available")
    parser.add_argument("--dim", type=int, default=2048 if cuda else 384)
    parser.add_argument("--layers", type=int, default=18 if cuda else 6)
    parser.add_argument("--heads", type=int, default=16 if cuda else 6)
    parser.add_argument("--seq", type=int, default=2048 if cuda else 128)
    parser.add_argument("--batch", type=int, default=4 if cuda else 4, help="sequences per rank per step")
    parser.add_argument("--param-dtype", choices=("bf16", "fp32"), default="bf16" if cuda else "fp32")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per rank (CPU)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every system, interleaved")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    args = parser.parse_args(argv)
    if args.world_size < 1:
        parser.error("--world-size must be >= 1")
    device = torch.device("cuda", 0) if cuda and not args.cpu else torch.device("cpu")
    env = environment(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    rows, spans = [], None
    # Systems run in turn, round after round (A B C D A B C D ...), so that a machine whose speed
    # drifts (shared CPU cores) slows every system alike; each figure is the median over rounds.
    rounds: dict[str, list[list[dict]]] = {system: [] for system in args.systems}
    for _ in range(args.rounds):
        for system in args.systems:
            rounds[system].append(run_ranks(_run_system, args.world_size, system, args, backend=backend))
    for system in args.systems:
        runs = rounds[system]
        results = runs[0]
        for key in ("step_ms", "peak_bytes", "comm_ms", "exposed_ms"):
            if key in results[0]:
                for rank, r in enumerate(results):
                    r[key] = statistics.median(run[rank][key] for run in runs)
        step_ms = max(r["step_ms"] for r in results)
        tokens = args.world_size * args.batch * args.seq
        row = {"system": system, "world_size": args.world_size, "params_M": results[0]["params"] / 1e6,
               "step_ms": step_ms, "tokens_per_s": tokens / (step_ms / 1e3),
               "peak_mem_MiB": max(r["peak_bytes"] for r in results) / 2**20,
               "comm_ms": results[0].get("comm_ms", float("nan")),
               "exposed_ms": results[0].get("exposed_ms", float("nan")), **env.stamp()}
        spans = results[0].get("spans", spans)
        rows.append(row)
    by = {r["system"]: r for r in rows}
    for r in rows:
        r["vs_fsdp2"] = r["step_ms"] / by["fsdp2"]["step_ms"] if "fsdp2" in by else float("nan")
        r["vs_unsharded"] = r["step_ms"] / by["unsharded"]["step_ms"] if "unsharded" in by else float("nan")
    columns = ["system", "world_size", "params_M", "step_ms", "tokens_per_s", "peak_mem_MiB", "comm_ms",
               "exposed_ms", "vs_fsdp2", "vs_unsharded"]
    print(f"{env.device_name}: W={args.world_size} {backend}, Llama dim {args.dim} x {args.layers} layers, "
          f"seq {args.seq}, {args.batch} seq/rank, {args.param_dtype}")
    print(format_table(rows, columns))
    out = results_dir(env.slug)
    tag = f"step_w{args.world_size}"
    write_csv(rows, out / f"{tag}.csv")
    notes = [f"Llama dim {args.dim}, {args.layers} layers, seq {args.seq}, {args.batch} sequences per rank, "
             f"{args.param_dtype}; W = {args.world_size} ({backend}); median of {args.steps} steps after "
             f"{args.warmup} warm-up, median over {args.rounds} interleaved rounds of every system; peak memory per rank ({'max_memory_allocated' if cuda else 'peak RSS growth'}).",
             "comm/exposed: flashfsdp's own trace (flashfsdp.profile), per step; other systems not traced."]
    write_markdown(rows, columns + environment_columns(), out / f"{tag}.md", title="Training step", env=env, notes=notes)
    from benchmarks.common import bar_chart  # noqa: PLC0415

    bar_chart(out / f"{tag}.png", {"step time (ms)": ([r["system"] for r in rows], {"step_ms": [r["step_ms"] for r in rows]}),
                                  "peak memory per rank (MiB)": ([r["system"] for r in rows], {"peak": [r["peak_mem_MiB"] for r in rows]})},
              ylabel="", title=f"Training step, W={args.world_size}, {env.device_name}")
    if spans:
        _timeline(out / f"{tag}_timeline.png", spans)
    return rows


if __name__ == "__main__":
    main()
