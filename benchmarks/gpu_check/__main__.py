"""One command that turns every GPU claim of flashfsdp into a measured figure:

    python -m benchmarks.gpu_check [--steps NAME ...] [--quick] [--budget SECONDS] [--out DIR]

Steps, in order (``--steps`` picks some): ``environment`` (GPU, driver, CUDA, torch, Triton, CuPy,
the libnccl loaded; CUDA tensors must get the Triton kernels), ``pytest`` (``pytest -m gpu``),
``stress`` (W = 1 with a delay injected on every side stream: fp32 equal to unsharded to 1e-5,
bf16 equal to FSDP2), ``w2_gloo`` (two ranks on the one GPU over gloo, against FSDP2),
``expandable`` (``expandable_segments:True`` with ``empty_cache()`` after every phase equals the
plain run), ``kernels`` (``benchmarks.kernels``: % of copy bandwidth, 1000 small tensors against
the torch ops), ``host_bound`` (``benchmarks.step --host-bound`` in bf16 and
``benchmarks.small_units`` at W = 1: flashfsdp against FSDP2 where the host sets the pace) and
``step`` (``benchmarks.step`` at W = 1 for a ~1B bf16 Llama against FSDP2 and unsharded, with
torch's and flashfsdp's AdamW, peak memory against the ZeRO-3 formula plus activations). A step that fails is reported and the next
one runs; steps that would start with less than their share of ``--budget`` (default 540 s, the
9 minutes a GPU session allows) left are skipped as "skipped: out of time".

Writes ``gpu_check.json`` (environment, every step's status, detail, figures and seconds) and
``gpu_check.md`` into ``--out`` (default ``bench-results/<device>/``, ``--record``: ``benchmarks/results/<device>/``, the device name from
``torch.cuda.get_device_name`` slugged), next to the kernel and step benchmarks' own files. Without
CUDA every step but the environment reports "skipped: no CUDA" (the dry run CI checks). Exit
status 1 if a step failed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.environment import Environment, environment
from benchmarks.gpu_check.steps import STEPS, Context, Outcome
from benchmarks.outputs import add_output_arguments, output_dir
from benchmarks.tables import write_markdown

# Seconds each step is expected to need on an H100; a step starts only with that much budget left.
SHARE = {"environment": 5, "pytest": 150, "stress": 60, "w2_gloo": 40, "expandable": 30, "kernels": 60,
         "host_bound": 90, "step": 150}


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the module docstring). Raises SystemExit for an unknown step or a
    budget that is not positive."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", nargs="+", choices=list(STEPS), default=list(STEPS), help="default: all, in order")
    parser.add_argument("--quick", action="store_true", help="smaller cases (a smoke test of the command)")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run (default 540)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if not args.budget > 0:
        parser.error(f"--budget must be > 0 seconds, got {args.budget}")
    args.steps = [name for name in STEPS if name in args.steps]  # always in the documented order
    return args


def run_steps(names: list[str], ctx: Context, deadline: float, clock=time.monotonic) -> dict[str, dict]:
    """Run the steps ``names`` in order; a step that raises is "failed" with the exception's line,
    one without its :data:`SHARE` of time left before ``deadline`` is "skipped: out of time"."""
    results = {}
    for name in names:
        start = clock()
        if deadline - start < SHARE[name]:
            outcome = Outcome("skipped", f"skipped: out of time ({deadline - start:.0f} s left, needs {SHARE[name]})")
        else:
            try:
                outcome = STEPS[name](ctx)
            except Exception as exc:  # noqa: BLE001 - one step's failure must not stop the others
                outcome = failure(exc)
        results[name] = {"status": outcome.status, "detail": outcome.detail, "data": outcome.data,
                         "seconds": round(clock() - start, 2)}
        print(f"[gpu_check] {name}: {outcome.status} ({results[name]['seconds']} s) {outcome.detail}", flush=True)
    return results


def failure(exc: BaseException) -> Outcome:
    """The "failed" outcome of a step that raised ``exc``: its first line with the exception type
    as the detail, and, in ``data["error"]``, the whole message (a rank failure's tracebacks) and
    the step's own traceback, also printed, so that a one-off GPU run loses nothing."""
    text = str(exc).strip()
    first = text.splitlines()[0] if text else ""
    # A rank failure's first line only announces the rank ("--- rank 0 ---"): take its last line.
    last = text.splitlines()[-1] if text else ""
    detail = f"{type(exc).__name__}: {first}" + (f" ... {last}" if last and last != first else "")
    error = "".join(traceback.format_exception(exc))
    print(error, file=sys.stderr, flush=True)
    return Outcome("failed", detail, {"error": error})


def write(results: dict[str, dict], env: Environment, out: Path) -> None:
    """``gpu_check.json`` (everything) and ``gpu_check.md`` (environment and one row per step)."""
    out.mkdir(parents=True, exist_ok=True)
    document = {"device": env.device_name, "date": env.date, "torch": env.torch_version, "triton": env.triton_version,
                "environment": results.get("environment", {}).get("data", {}), "steps": results}
    (out / "gpu_check.json").write_text(json.dumps(document, indent=1, default=str) + "\n")
    rows = [{"step": name, "status": r["status"], "seconds": r["seconds"], "detail": r["detail"]}
            for name, r in results.items()]
    notes = [f"{key}: {value}" for key, value in document["environment"].items()]
    write_markdown(rows, ["step", "status", "seconds", "detail"], out / "gpu_check.md",
                   title="flashfsdp GPU check", env=env, notes=notes)


def main(argv=None) -> int:
    """Run the check (see the module docstring); returns the exit status (1 if a step failed)."""
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    env = environment(torch.device("cuda", 0) if cuda else torch.device("cpu"))
    out = output_dir(env.slug, out=args.out, record=args.record)
    deadline = time.monotonic() + args.budget
    ctx = Context(out=out, cuda=cuda, seconds_left=lambda: deadline - time.monotonic(), quick=args.quick)
    results = run_steps(args.steps, ctx, deadline)
    write(results, env, out)
    print(f"[gpu_check] wrote {out}/gpu_check.json and gpu_check.md")
    return 1 if any(r["status"] == "failed" for r in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
