"""The steps of ``benchmarks.gpu_check``. Each takes the :class:`Context` and returns a
:class:`Outcome` (``ok``, ``failed`` or ``skipped`` with a one-line detail and figures); without
CUDA every step but the environment report is skipped ("skipped: no CUDA")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from benchmarks.gpu_check import environment
from benchmarks.gpu_check.formula import zero3_peak_bytes

REPO = Path(__file__).resolve().parents[2]
NO_CUDA = "skipped: no CUDA"


@dataclass
class Context:
    """What every step gets: where results go, the time left, and whether CUDA is here."""

    out: Path
    cuda: bool
    seconds_left: Callable[[], float]
    quick: bool = False


@dataclass
class Outcome:
    """A step's result: status ("ok", "failed", "skipped"), a one-line detail and its figures."""

    status: str
    detail: str
    data: dict = field(default_factory=dict)


def needs_cuda(step):
    """Decorator: the step reports ``skipped: no CUDA`` without CUDA instead of running."""

    def run(ctx: Context) -> Outcome:
        if not ctx.cuda:
            return Outcome("skipped", NO_CUDA)
        return step(ctx)

    run.__name__, run.__doc__ = step.__name__, step.__doc__
    return run


def env_step(ctx: Context) -> Outcome:
    """GPU, driver, CUDA, torch, Triton, CuPy, the libnccl loaded; CUDA tensors must get Triton."""
    env = environment.report()
    found = environment.problems(env)
    if env["gpu"] == "none":
        return Outcome("ok", "no CUDA device: every GPU step is skipped", env)
    return Outcome("failed" if found else "ok", "; ".join(found) or f"{env['gpu']}, backend {env['backend']}", env)


@needs_cuda
def pytest_step(ctx: Context) -> Outcome:
    """``pytest -m gpu`` with the compiled Triton kernels."""
    budget = max(30, int(ctx.seconds_left() * 0.5))
    command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *gpu_test_files()]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=budget)
    except subprocess.TimeoutExpired:
        return Outcome("failed", f"pytest -m gpu still running after {budget} s")
    (ctx.out / "gpu_check_pytest.txt").write_text(done.stdout + done.stderr)
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    return Outcome("ok" if done.returncode == 0 else "failed", summary, {"returncode": done.returncode})


def gpu_test_files(root: Path = REPO / "tests") -> list[str]:
    """The test files (relative to the repository) that hold a ``gpu``-marked test: collecting
    only them saves the import of every other test module (half a minute on an H100 machine)."""
    return sorted(str(path.relative_to(root.parent)) for path in root.rglob("test_*.py")
                  if GPU_MARK.search(path.read_text()))


# A test marked ``gpu``: the decorator, or a module's ``pytestmark``, at the start of a line.
GPU_MARK = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*\bpytest\.mark\.gpu\b)", re.MULTILINE)


def _spawn(world_size: int, backend: str, *args, env: dict | None = None, **kwargs) -> list:
    """``training.train_losses(rank, W, *args, **kwargs)`` on ``world_size`` fresh ranks, with
    ``env`` set in their environment (the spawned ranks read it at start: the allocator's)."""
    from flashfsdp_dev.ranks import spawn_ranks  # noqa: PLC0415

    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    try:
        return spawn_ranks(_train, world_size, (args, kwargs), backend=backend, timeout=240)
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _train(rank: int, world_size: int, args: tuple, kwargs: dict) -> dict:
    from benchmarks.gpu_check.training import train_losses  # noqa: PLC0415

    return train_losses(rank, world_size, *args, **kwargs)


def _compare(name: str, ours: dict, theirs: dict, tolerance: float) -> tuple[bool, str, dict]:
    from benchmarks.gpu_check.training import max_abs_difference, triton_ran  # noqa: PLC0415

    diff = max_abs_difference(ours["losses"], theirs["losses"])
    ok = diff <= tolerance and triton_ran(ours["counts"])
    detail = f"{name}: max |loss difference| {diff:.3g} (<= {tolerance:g}), Triton ran: {triton_ran(ours['counts'])}"
    return ok, detail, {"name": name, "max_abs_diff": diff, "tolerance": tolerance, "ours": ours["losses"],
                        "theirs": theirs["losses"], "delays": ours.get("delays", 0)}


def _outcome(results: list[tuple[bool, str, dict]]) -> Outcome:
    return Outcome("ok" if all(r[0] for r in results) else "failed", "; ".join(r[1] for r in results),
                   {"comparisons": [r[2] for r in results]})


@needs_cuda
def stress_step(ctx: Context) -> Outcome:
    """W = 1 with a delay on every side stream: fp32 equal to unsharded to 1e-5, bf16 to FSDP2."""
    cycles = 10**6 if ctx.quick else 5 * 10**7  # ~0.5 ms / ~25 ms per side-stream use
    flash32 = _spawn(1, "nccl", "flashfsdp", dtype="fp32", delay_cycles=cycles)[0]
    plain32 = _spawn(1, "nccl", "unsharded", dtype="fp32")[0]
    flash16 = _spawn(1, "nccl", "flashfsdp", dtype="bf16", delay_cycles=cycles)[0]
    fsdp16 = _spawn(1, "nccl", "fsdp2", dtype="bf16")[0]
    return _outcome([_compare("fp32 vs unsharded", flash32, plain32, 1e-5),
                     _compare("bf16 vs FSDP2", flash16, fsdp16, 1e-3)])


@needs_cuda
def w2_gloo_step(ctx: Context) -> Outcome:
    """W = 2 ranks on the one GPU over gloo (CUDA tensors), flashfsdp against FSDP2."""
    flash = _spawn(2, "gloo", "flashfsdp", dtype="fp32", communicator="process_group")
    fsdp2 = _spawn(2, "gloo", "fsdp2", dtype="fp32")
    return _outcome([_compare(f"rank {r} fp32 vs FSDP2", flash[r], fsdp2[r], 1e-5) for r in range(2)])


@needs_cuda
def expandable_step(ctx: Context) -> Outcome:
    """Training under ``expandable_segments:True`` with the cache released after every phase
    equals training without (to 1e-3 in bf16: attention's backward need not be deterministic)."""
    env = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    released = _spawn(1, "nccl", "flashfsdp", dtype="bf16", empty_cache=True, env=env)[0]
    plain = _spawn(1, "nccl", "flashfsdp", dtype="bf16")[0]
    return _outcome([_compare("expandable segments + empty_cache vs plain", released, plain, 1e-3)])


@needs_cuda
def kernels_step(ctx: Context) -> Outcome:
    """``benchmarks.kernels``: % of copy bandwidth on a 4096-hidden block, speedup on 1000 tensors."""
    from benchmarks import kernels  # noqa: PLC0415

    argv = ["--device", "cuda", "--out", str(ctx.out)] + (["--quick"] if ctx.quick else ["--sizes", "4096"])
    table = kernels.main(argv)
    rows = [r for r in table if r["impl"] == "flashfsdp"]
    block = [r["%copy"] for r in rows if r["case"] == "llama-h4096"]
    small = [r["speedup"] for r in rows if r["case"] == "small-1000"]
    # flatten / unflatten through a launch plan (built once, as the runtime's copy-out holds it)
    planned = [r["speedup"] for r in table if r["impl"] == "flashfsdp (plan)" and r["case"] == "small-1000"]
    nan = float("nan")
    data = {"min_pct_copy_h4096": min(block, default=nan), "min_speedup_small": min(small, default=nan),
            "min_speedup_small_plan": min(planned, default=nan)}
    ok = (not block or data["min_pct_copy_h4096"] >= 90) and (not planned or data["min_speedup_small_plan"] >= 1.5)
    detail = (f"h4096: >= {data['min_pct_copy_h4096']:.1f}% of copy (target 90); 1000 tensors: >= "
              f"{data['min_speedup_small_plan']:.2f}x torch through a launch plan (target 1.5), >= "
              f"{data['min_speedup_small']:.2f}x through the op (validated per call)")
    return Outcome("ok" if ok else "failed", detail, data)


@needs_cuda
def step_step(ctx: Context) -> Outcome:
    """``benchmarks.step`` at W = 1 (~1B bf16 Llama): flashfsdp with torch's AdamW and with
    ``flashfsdp.optim.AdamW`` vs FSDP2 vs unsharded, and the peaks against the ZeRO-3 formula plus
    the activations measured (the unsharded run's peak above its own parameters, gradients and
    AdamW states)."""
    from benchmarks import step  # noqa: PLC0415

    argv = ["--world-size", "1", "--systems", "unsharded", "flashfsdp", "flashfsdp-flat-adamw", "fsdp2",
            "--rounds", "1", "--steps", "5", "--warmup", "2", "--profile-steps", "1", "--out", str(ctx.out)]
    if ctx.quick:
        argv += ["--layers", "4"]
    rows = {r["system"]: r for r in step.main(argv)}
    args = step.parse_args(argv)
    params, unit = _llama_params(args)
    formula_mib = zero3_peak_bytes(params, unit, 1) / 2**20
    plain = rows["unsharded"]
    # unsharded bf16 training: bf16 parameters and gradients, fp32 AdamW moments (2 + 2 + 8 B/param)
    activations_mib = max(0.0, plain["peak_mem_MiB"] - 12 * params / 2**20)
    data = {"formula_MiB": formula_mib, "activations_MiB": activations_mib,
            **{f"{s}_{k}": rows[s][k] for s in rows for k in ("step_ms", "peak_mem_MiB")}}
    flash, flat, fsdp2 = rows["flashfsdp"], rows["flashfsdp-flat-adamw"], rows["fsdp2"]
    data.update(vs_fsdp2=flash["step_ms"] / fsdp2["step_ms"], flat_vs_fsdp2=flat["step_ms"] / fsdp2["step_ms"],
                vs_unsharded=flash["step_ms"] / plain["step_ms"],
                peak_vs_formula=flash["peak_mem_MiB"] / (formula_mib + activations_mib))
    ok = data["vs_fsdp2"] <= 1.0 and data["flat_vs_fsdp2"] <= 1.0 and data["peak_vs_formula"] <= 1.05
    detail = (f"step {flash['step_ms']:.1f} ms: {data['vs_fsdp2']:.3f}x FSDP2 with torch AdamW, "
              f"{data['flat_vs_fsdp2']:.3f}x with flashfsdp.optim.AdamW (target 1.0), {data['vs_unsharded']:.3f}x "
              f"unsharded; peak {flash['peak_mem_MiB']:.0f} MiB (FSDP2 {fsdp2['peak_mem_MiB']:.0f}) vs formula "
              f"{formula_mib:.0f} + activations {activations_mib:.0f} MiB: {data['peak_vs_formula']:.3f}x (target 1.05)")
    return Outcome("ok" if ok else "failed", detail, data)


@needs_cuda
def host_bound_step(ctx: Context) -> Outcome:
    """Where flashfsdp should win on one GPU, the host-bound regime: ``benchmarks.step
    --host-bound`` (48 tiny Llama blocks, bf16, AdamW) and ``benchmarks.small_units`` (both
    shapes at W = 1): flashfsdp's step against FSDP2's, target <= 0.5x."""
    from benchmarks import small_units, step  # noqa: PLC0415

    rounds = ["--rounds", "1"]
    ratios = {}
    rows = step.main(["--host-bound", "--world-size", "1", "--param-dtype", "bf16", *rounds, "--out", str(ctx.out)])
    ratios["step --host-bound bf16"] = _ratio(rows)
    for shape in ("host-bound", "gated"):
        rows = small_units.main(["--shape", shape, "--world-size", "1", "--systems", "flashfsdp", "fsdp2",
                                 "unsharded", *rounds, "--out", str(ctx.out)])
        ratios[f"small_units {shape} W=1"] = _ratio(rows)
    ok = all(r <= 0.5 for r in ratios.values())
    detail = "; ".join(f"{name}: {r:.3f}x FSDP2" for name, r in ratios.items()) + " (target 0.5)"
    return Outcome("ok" if ok else "failed", detail, {"vs_fsdp2": ratios})


def _ratio(rows: list[dict]) -> float:
    """flashfsdp's step time over FSDP2's in one benchmark table."""
    by = {r["system"]: r["step_ms"] for r in rows}
    return by["flashfsdp"] / by["fsdp2"]


def _llama_params(args) -> tuple[int, int]:
    """(all parameters, the largest unit's) of the benchmark's Llama, built on the meta device."""
    from flashfsdp.models.llama import Llama, LlamaConfig  # noqa: PLC0415

    with torch.device("meta"):
        model = Llama(LlamaConfig(dim=args.dim, n_layers=args.layers, n_heads=args.heads, max_seq_len=args.seq))
    total = sum(p.numel() for p in model.parameters())
    blocks = sum(p.numel() for p in model.layers.parameters())
    return total, max(total - blocks, max(sum(p.numel() for p in b.parameters()) for b in model.layers))


STEPS = {"environment": env_step, "pytest": pytest_step, "stress": stress_step, "w2_gloo": w2_gloo_step,
         "expandable": expandable_step, "kernels": kernels_step,
         "host_bound": host_bound_step, "step": step_step}
