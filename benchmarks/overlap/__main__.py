"""``python -m benchmarks.overlap``: the command line of the overlap benchmark (see the package
docstring)."""

from __future__ import annotations

import argparse
import math

import torch

from benchmarks.environment import environment
from benchmarks.outputs import add_output_arguments, output_dir
from benchmarks.overlap import __doc__ as _PACKAGE_DOC
from benchmarks.tables import format_table
from flashfsdp import sim

from .measure import CONFIGS, QUICK_CONFIGS
from .report import EXPOSED_COLUMNS, NONCOMPUTE_COLUMNS, STEP_COLUMNS, SWEEP_LINKS, write_sweep, write_validation
from .validate import VERDICT_COLUMNS, validate


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (see the package docstring); exits with the reason on bad values."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overlap", description=_PACKAGE_DOC.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="toy models, 2 timed rounds, small calibration sizes, 4 world sizes (a smoke test)")
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS),
                        help="validation configurations (default: all)")
    add_output_arguments(parser)
    parser.add_argument("--skip-validation", action="store_true", help="predictions only (no processes)")
    parser.add_argument("--skip-sweep", action="store_true", help="validation only")
    parser.add_argument("--steps", type=int, default=None, help="timed rounds per configuration (default 12; quick 2)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; quick 1)")
    parser.add_argument("--flops", type=float, default=400e12, help="assumed achieved FLOP/s per GPU (8B/70B)")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank per step (8B/70B)")
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (2 if args.quick else 12)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    for name in ("steps", "warmup", "tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not (args.flops > 0 and math.isfinite(args.flops)):
        parser.error(f"--flops must be a positive FLOP/s, got {args.flops}")
    return args


def sweep(args) -> list[dict]:
    """Every model × link × W × setting (``flashfsdp.sim.sweep`` over Llama-style 8B and 70B)."""
    models = [sim.llama3_8b(tokens_per_rank=args.tokens, flops_per_s=args.flops),
              sim.llama3_70b(tokens_per_rank=args.tokens, flops_per_s=args.flops)]
    worlds = [2**k for k in range(3, 13)] if not args.quick else [8, 64, 512, 4096]
    return sim.sweep(models, SWEEP_LINKS, worlds)


def main(argv=None) -> dict:
    """Run the validation and the sweep as the command line asks; returns their rows."""
    args = parse_args(argv)
    env = environment(torch.device("cpu"))
    out = output_dir(env.slug, out=args.out, record=args.record)
    result = {}
    if not args.skip_validation:
        configs = [(QUICK_CONFIGS if args.quick else CONFIGS)[name] for name in args.configs]
        rows, extra = validate(args, env, configs)
        print(f"\nValidation: {env.device_name}, W=2 gloo; {extra['link'].describe()}")
        print(format_table(rows, STEP_COLUMNS))
        print(format_table(rows, NONCOMPUTE_COLUMNS))
        print(format_table(rows, EXPOSED_COLUMNS))
        write_validation(rows, extra, args, configs, env, out)
        print(format_table(extra["verdicts"], VERDICT_COLUMNS))
        result["validation"] = rows
    if not args.skip_sweep:
        rows = sweep(args)
        for r in rows:
            r.update(env.stamp())
        write_sweep(rows, args, env, out)
        result["sweep"] = rows
    return result


if __name__ == "__main__":
    main()
