"""Kernel benchmark: flashfsdp's flatten, unflatten and accumulate_grad_shard against the torch ops
PyTorch FSDP2 uses for the same jobs, and against a plain copy of the same bytes.

Run ``python -m benchmarks.kernels`` (``--help`` for the options). Cases: the parameters of one
Llama-style transformer block at hidden size h (q, k, v, o: h x h; gate, up: f x h; down: h x f with
f = 8h/3 rounded up to a multiple of 256; two RMSNorm weights of h) and 1000 small tensors
(deterministic sizes, multiples of 8 in 64..4096 elements); dtype pairs (input -> output) fp32->bf16,
bf16->fp32, fp32->fp32. Per op:

- flatten (copy-in / gradient packing): flashfsdp (the op, and a ``FlattenPlan`` built once, as a
  caller that packs the same tensors every step holds it) vs ``torch._foreach_copy_`` into split views of
  the flat buffer, ``torch._chunk_cat`` (``num_chunks`` = world size 8) and a cast + ``torch.cat``;
- unflatten (copy-out): flashfsdp (the op, and the ``UnflattenPlan`` the runtime's copy-out holds)
  vs ``torch.split_with_sizes_copy`` (same dtype only, it cannot
  cast) and ``torch._foreach_copy_`` from split views;
- accumulate_grad_shard on the rank's shard (unit / 8 elements) with accumulate=True, scale=1/8:
  flashfsdp vs the unfused torch sequence (post-divide, cast-add into the gradient, a norm for
  clipping, an isfinite check for loss scaling), with ``mul`` + ``add_`` or ``add_(alpha=)``.

Every row: bytes moved (read + written by the op's job, the same for every implementation),
median time, GB/s, % of the copy ceiling and speedup over the fastest torch baseline. The copy
ceiling is measured the same way for every dtype pair: once per op and case, the best of the
repeats of ``dst.copy_(src)`` (bytes) moving what the case's fp32->fp32 job moves; %copy is a
row's GB/s over the ceiling's. Without CUDA the flashfsdp rows run the plain-torch reference
path and say so. Results go to ``kernels.{csv,md,png}`` in ``bench-results/<device>/``
(``--record``: ``benchmarks/results/<device>/``).

``--host-only`` times the host side of flatten / unflatten alone instead (validation and segment
table vs a launch plan's check, no launch: ``benchmarks/kernels_host.py``), which means the same on
any machine; ``kernels_host.{csv,md}`` in the same folders.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
from pathlib import Path
from typing import Callable

import torch

import flashfsdp.kernels as kernels
from benchmarks import kernels_host, plots
from benchmarks.environment import Environment, environment, environment_columns
from benchmarks.outputs import add_output_arguments, output_dir
from benchmarks.tables import format_table, write_csv, write_markdown
from benchmarks.timing import gigabytes_per_second, measure_ms
from flashfsdp.kernels import dispatch

WORLD_SIZE = 8
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_PAIRS = (("fp32", "bf16"), ("bf16", "fp32"), ("fp32", "fp32"))
PLAN = "flashfsdp (plan)"  # the op's launch plan, built once outside the timed calls
OURS = ("flashfsdp", PLAN)
COLUMNS = ["op", "case", "dtypes", "impl", "path", "MB", "time_ms", "GB/s", "%copy", "speedup"]


def llama_block_shapes(hidden: int) -> list[tuple[int, ...]]:
    """Parameter shapes of one Llama-style block (attention, SwiGLU MLP, two RMSNorms)."""
    ffn = 256 * -(-(8 * hidden // 3) // 256)
    return [(hidden, hidden)] * 4 + [(ffn, hidden), (ffn, hidden), (hidden, ffn), (hidden,), (hidden,)]


def small_tensor_shapes(count: int = 1000, seed: int = 0) -> list[tuple[int, ...]]:
    """``count`` 1-D shapes, multiples of 8 elements in [64, 4096], the same on every run."""
    rng = random.Random(seed)
    return [(8 * rng.randint(8, 512),) for _ in range(count)]


def cases(sizes: list[int], small: bool) -> dict[str, list[tuple[int, ...]]]:
    result = {f"llama-h{h}": llama_block_shapes(h) for h in sizes}
    if small:
        result["small-1000"] = small_tensor_shapes()
    return result


def _path_label(device: torch.device) -> str:
    """Which implementation of the ops this run times on ``device``, and why."""
    if dispatch.select_backend(device) == "triton":
        return "triton (interpreter)" if device.type == "cpu" else "triton"
    if device.type == "cpu":
        return "reference path (CPU tensors; the Triton kernels need CUDA or TRITON_INTERPRET=1)"
    return f"reference path (Triton unavailable on {device.type})"


class Bench:
    """Times implementations of one job and turns them into rows (with copy ceiling and speedup)."""

    def __init__(self, device: torch.device, env: Environment, repeats: int):
        self.device = device
        self.env = env
        self.repeats = repeats
        self.flashfsdp_path = _path_label(device)
        self._copy_ms: dict[int, float] = {}

    def time(self, fn: Callable[[], object]) -> float:
        return measure_ms(fn, self.device, repeats=self.repeats)

    def copy_ms(self, n_bytes: int) -> float:
        """The copy ceiling's time: the best of the repeats of ``dst.copy_(src)`` reading n_bytes/2
        and writing n_bytes/2 (measured once per byte count)."""
        if n_bytes not in self._copy_ms:
            src = torch.empty(n_bytes // 2, dtype=torch.uint8, device=self.device)
            dst = torch.empty_like(src)
            self._copy_ms[n_bytes] = measure_ms(lambda: dst.copy_(src), self.device, repeats=self.repeats,
                                                best=True)
            del src, dst
        return self._copy_ms[n_bytes]

    def rows(self, op: str, case: str, dtypes: str, n_bytes: int, ceiling_bytes: int,
             flashfsdp: Callable[[], object], baselines: dict[str, Callable[[], object]],
             plan: Callable[[], object] | None = None) -> list[dict]:
        """Time ``flashfsdp``, ``plan`` (its launch plan's run, if given) and ``baselines`` (each
        moving ``n_bytes``) into rows, and the copy ceiling of ``ceiling_bytes`` (the case's
        fp32->fp32 job, whatever this row's dtypes)."""
        times = {"flashfsdp": self.time(flashfsdp)}
        if plan is not None:
            times[PLAN] = self.time(plan)
        times.update({name: self.time(fn) for name, fn in baselines.items()})
        best_torch = min(times[name] for name in baselines)
        ceiling = gigabytes_per_second(ceiling_bytes, self.copy_ms(ceiling_bytes))
        rows = [self._row(op, case, dtypes, impl, n_bytes, ms, ceiling, best_torch / ms) for impl, ms in times.items()]
        rows.append(self._row(op, case, dtypes, "copy ceiling", ceiling_bytes, self.copy_ms(ceiling_bytes), ceiling,
                              float("nan")))
        return rows

    def _row(self, op, case, dtypes, impl, n_bytes, ms, ceiling_gbps, speedup) -> dict:
        gbps = gigabytes_per_second(n_bytes, ms)
        return {"op": op, "case": case, "dtypes": dtypes, "impl": impl,
                "path": self.flashfsdp_path if impl in OURS else "torch",
                "bytes": n_bytes, "MB": n_bytes / 1e6, "time_ms": ms, "GB/s": gbps, "%copy": 100.0 * gbps / ceiling_gbps,
                "speedup": speedup, **self.env.stamp()}


def make_tensors(shapes, dtype, device, seed=0):
    generator = torch.Generator(device=device).manual_seed(seed)
    return [torch.randn(shape, generator=generator, device=device, dtype=torch.float32).to(dtype) for shape in shapes]


def add_if_supported(baselines: dict, name: str, fn: Callable[[], object]) -> None:
    """Add a torch baseline if one trial call works (private ops vary across torch versions/devices)."""
    try:
        fn()
    except (RuntimeError, TypeError, NotImplementedError) as error:
        print(f"skipping baseline {name}: {type(error).__name__}: {str(error).splitlines()[0]}")
        return
    baselines[name] = fn


def layout(shapes) -> tuple[list[int], list[int], int]:
    """Back-to-back offsets (every size is a multiple of 8, so every range is 16-byte aligned)."""
    numels = [torch.Size(shape).numel() for shape in shapes]
    offsets, position = [], 0
    for numel in numels:
        offsets.append(position)
        position += numel
    return offsets, numels, position


def bench_flatten(bench: Bench, case, shapes, in_name, out_name) -> list[dict]:
    in_dtype, out_dtype = DTYPES[in_name], DTYPES[out_name]
    tensors = make_tensors(shapes, in_dtype, bench.device)
    offsets, numels, total = layout(shapes)
    flat = torch.empty(total, dtype=out_dtype, device=bench.device)
    views = list(torch.split(flat, numels))
    sources_1d = [t.view(-1) for t in tensors]
    baselines = {
        "torch._foreach_copy_": lambda: torch._foreach_copy_(views, sources_1d),
        "cast + torch.cat": lambda: torch.cat([t.to(out_dtype) for t in sources_1d], out=flat),
    }
    if hasattr(torch, "_chunk_cat"):
        chunk_shape = torch._chunk_cat(tensors, 0, WORLD_SIZE).shape  # (world size, padded total / world size)
        chunk_out = torch.empty(chunk_shape, dtype=out_dtype, device=bench.device)
        add_if_supported(baselines, "torch._chunk_cat", lambda: torch._chunk_cat(tensors, 0, WORLD_SIZE, out=chunk_out))
    n_bytes = total * (in_dtype.itemsize + out_dtype.itemsize)
    plan = kernels.FlattenPlan(tensors, offsets)
    return bench.rows("flatten", case, f"{in_name}->{out_name}", n_bytes, total * 8,
                      lambda: kernels.flatten(tensors, offsets, flat), baselines, lambda: plan.run(flat))


def bench_unflatten(bench: Bench, case, shapes, in_name, out_name) -> list[dict]:
    in_dtype, out_dtype = DTYPES[in_name], DTYPES[out_name]
    offsets, numels, total = layout(shapes)
    flat = make_tensors([(total,)], in_dtype, bench.device)[0]
    outs = [torch.empty(shape, dtype=out_dtype, device=bench.device) for shape in shapes]
    outs_1d = [o.view(-1) for o in outs]
    views = list(torch.split(flat, numels))
    baselines = {"torch._foreach_copy_": lambda: torch._foreach_copy_(outs_1d, views)}
    if in_dtype == out_dtype:  # it cannot cast
        add_if_supported(baselines, "torch.split_with_sizes_copy",
                         lambda: torch.split_with_sizes_copy(flat, numels, 0, out=outs_1d))
    n_bytes = total * (in_dtype.itemsize + out_dtype.itemsize)
    plan = kernels.UnflattenPlan(offsets, outs)
    return bench.rows("unflatten", case, f"{in_name}->{out_name}", n_bytes, total * 8,
                      lambda: kernels.unflatten(flat, offsets, outs), baselines, lambda: plan.run(flat))


def bench_accumulate(bench: Bench, case, shapes, in_name, out_name) -> list[dict]:
    src_dtype, dst_dtype = DTYPES[in_name], DTYPES[out_name]
    shard = layout(shapes)[2] // WORLD_SIZE
    src = make_tensors([(shard,)], src_dtype, bench.device, seed=1)[0]
    dst = make_tensors([(shard,)], dst_dtype, bench.device, seed=2)[0]
    scale = 1.0 / WORLD_SIZE

    def unfused(update):
        def run():
            update()
            norm_sq = torch.linalg.vector_norm(dst, dtype=torch.float32).square()
            return norm_sq, ~torch.isfinite(dst).all()
        return run

    baselines = {
        "mul + add_ + norm + isfinite": unfused(lambda: dst.add_(src * scale)),
        "add_(alpha) + norm + isfinite": unfused(lambda: dst.add_(src, alpha=scale)),
    }
    n_bytes = shard * (src_dtype.itemsize + 2 * dst_dtype.itemsize)
    return bench.rows("accumulate_grad_shard", case, f"{in_name}->{out_name}", n_bytes, shard * 12,
                      lambda: kernels.accumulate_grad_shard(src, dst, scale=scale), baselines)


BENCHMARKS = {"flatten": bench_flatten, "unflatten": bench_unflatten, "accumulate_grad_shard": bench_accumulate}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m benchmarks.kernels")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sizes", type=int, nargs="+", default=None,
                        help="hidden sizes of the Llama-block cases (default: 1024 4096 8192 on CUDA, 1024 on CPU)")
    parser.add_argument("--no-small", action="store_true", help="skip the 1000-small-tensors case")
    parser.add_argument("--ops", nargs="+", choices=list(BENCHMARKS), default=list(BENCHMARKS))
    parser.add_argument("--quick", action="store_true", help="hidden size 1024 only, fewer repeats (smoke test)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats per measurement on CPU")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (default 1: steadier timings on a shared machine)")
    parser.add_argument("--host-only", action="store_true",
                        help="time only the host side of flatten / unflatten per call (op vs plan, no launch; "
                             "kernels_host.{csv,md})")
    parser.add_argument("--calls", type=int, default=50, help="--host-only: calls per timed sample")
    parser.add_argument("--no-save", action="store_true", help="print only; write no result files")
    add_output_arguments(parser)
    return parser.parse_args(argv)


def main(argv=None) -> list[dict]:
    """Run the benchmark (see the module docstring and ``--help``); return the rows."""
    args = parse_args(argv)
    device = torch.device(args.device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    try:
        if args.host_only:
            return run_host(args, device)
        rows, env, path = run(args, device)
    finally:
        torch.set_num_threads(threads)
    print(format_table(rows, COLUMNS))
    if not args.no_save:
        save(rows, env, path, output_dir(env.slug, out=args.out, record=args.record))
    return rows


def run_host(args, device: torch.device) -> list[dict]:
    """``--host-only``: :mod:`benchmarks.kernels_host`'s rows for flatten and unflatten, fp32
    tensors and a bf16 buffer, per case; printed and saved as the other rows are."""
    env = environment(device)
    rows = []
    for case, shapes in cases(args.sizes or [1024], not args.no_small).items():
        tensors = make_tensors(shapes, DTYPES["fp32"], device)
        offsets, _, total = layout(shapes)
        flat = torch.empty(total, dtype=DTYPES["bf16"], device=device)
        for op in ("flatten", "unflatten"):
            rows += kernels_host.host_rows(op, case, tensors, offsets, flat, env, calls=args.calls,
                                      repeats=args.repeats or 7)
    print(format_table(rows, kernels_host.COLUMNS))
    if not args.no_save:
        kernels_host.save(rows, env, output_dir(env.slug, out=args.out, record=args.record), args.calls,
                          args.repeats or 7)
    return rows


def run(args, device: torch.device) -> tuple[list[dict], Environment, str]:
    sizes = args.sizes or ([1024] if args.quick or device.type == "cpu" else [1024, 4096, 8192])
    repeats = args.repeats or (3 if args.quick else 7)
    env = environment(device)
    bench = Bench(device, env, repeats)
    print(f"{env.device_name} · torch {env.torch_version} · triton {env.triton_version} · "
          f"flashfsdp path: {bench.flashfsdp_path}")
    rows = []
    for case, shapes in cases(sizes, not args.no_small).items():
        for in_name, out_name in DTYPE_PAIRS:
            for op in args.ops:
                rows += BENCHMARKS[op](bench, case, shapes, in_name, out_name)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows, env, bench.flashfsdp_path


def save(rows: list[dict], env: Environment, flashfsdp_path: str, directory: Path) -> None:
    """Write kernels.csv, kernels.md and kernels.png into ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    write_csv(rows, directory / "kernels.csv")
    notes = [
        f"flashfsdp path: {flashfsdp_path}.",
        f"{PLAN}: the op's FlattenPlan / UnflattenPlan, built once before the timed calls (the runtime's "
        "copy-out holds one per group): its run checks the buffer and the tensors' addresses, then launches.",
        "MB: bytes read + written by the job (10^6); GB/s: 10^9 bytes/s; %copy: this row's GB/s over the copy "
        "ceiling's; speedup: the fastest torch baseline's time over this row's.",
        "copy ceiling: measured the same way for every dtype pair, once per op and case: the best of the repeats "
        "of dst.copy_(src) on bytes, moving what the case's fp32->fp32 job moves (its MB column).",
        f"accumulate_grad_shard works on one rank's shard (unit / {WORLD_SIZE}), accumulate=True, "
        f"scale=1/{WORLD_SIZE}; torch._chunk_cat uses num_chunks={WORLD_SIZE}.",
    ]
    write_markdown(rows, COLUMNS + environment_columns(), directory / "kernels.md",
                   title="flashfsdp kernel benchmark", env=env, notes=notes)
    plot(rows, directory / "kernels.png", title=f"flashfsdp kernels ({flashfsdp_path}) · {env.device_name}")
    print(f"wrote {directory}/kernels.csv, kernels.md, kernels.png")


def plot(rows: list[dict], path: Path, *, title: str):
    """kernels.png: per op, GB/s of flashfsdp (and its plan, where timed) and the best torch baseline
    per case and dtype pair on a log axis, under each case's copy ceiling (a line over the group);
    returns the figure."""
    panels, ceilings = {}, {}
    for op in dict.fromkeys(row["op"] for row in rows):
        op_rows = [row for row in rows if row["op"] == op]
        groups = list(dict.fromkeys(f"{row['case']} {row['dtypes']}" for row in op_rows))
        ours = [impl for impl in OURS if any(row["impl"] == impl for row in op_rows)]
        series = {impl: [] for impl in (*ours, "best torch")}
        ceilings[op] = []
        for group in groups:
            group_rows = [row for row in op_rows if f"{row['case']} {row['dtypes']}" == group]
            torch_rows = [row for row in group_rows if row["impl"] not in (*OURS, "copy ceiling")]
            for impl in ours:
                series[impl].append(next((row["GB/s"] for row in group_rows if row["impl"] == impl), math.nan))
            series["best torch"].append(max(row["GB/s"] for row in torch_rows))
            ceilings[op].append(next(row["GB/s"] for row in group_rows if row["impl"] == "copy ceiling"))
        panels[op] = (groups, series)
    return plots.bar_chart(path, panels, ylabel="GB/s (log scale)", xlabel="case and dtypes (input -> output)",
                           title=title, log=True, ceilings=ceilings,
                           ceiling_label="copy ceiling (dst.copy_(src), fp32->fp32 job's bytes)")


if __name__ == "__main__":
    main()
