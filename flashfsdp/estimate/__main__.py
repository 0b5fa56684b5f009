"""``python -m flashfsdp.estimate --preset 8b --world-size 64 [--param-dtype bf16] [--hsdp 8]``:
memory per rank, communication per step, and a table over world sizes beside DeepSpeed's ZeRO-3."""

from __future__ import annotations

import argparse
import sys

import torch

from flashfsdp.bindings.mixed_precision import MixedPrecisionPolicy
from flashfsdp.models import PRESETS, Llama

from .deepspeed import model_params
from .estimate import OPTIMIZER_STATES, estimate
from .report import comm_table, memory_table, world_size_table

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TABLE_WORLD_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)


def _reshard(text: str) -> bool | int | None:
    """--reshard-after-forward: true, false, default or a group size."""
    choices = {"true": True, "false": False, "default": None}
    if text.lower() in choices:
        return choices[text.lower()]
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected true, false, default or an integer, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog="python -m flashfsdp.estimate", description=__doc__.split("\n", 1)[0])
    p.add_argument("--preset", required=True, help=f"model: one of {', '.join(PRESETS)}")
    p.add_argument("--world-size", type=int, required=True, help="ranks in all (W)")
    p.add_argument("--param-dtype", choices=sorted(DTYPES), default="fp32", help="unsharded parameters' dtype")
    p.add_argument("--reduce-dtype", choices=sorted(DTYPES), help="reduce-scatter dtype (default: --param-dtype)")
    p.add_argument("--all-gather-dtype", choices=("int8",),
                   help="int8: the bytes of quantised all-gathers (ZeRO++ qwZ, a scale per 256 values)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adamw")
    p.add_argument("--reshard-after-forward", type=_reshard, default=None, metavar="true|false|default|K")
    p.add_argument("--max-inflight", type=int, default=2, help="prefetched units ahead of compute")
    p.add_argument("--sharding", choices=("full", "grad_op"), help="(hybrid: use --hsdp)")
    p.add_argument("--hsdp", type=int, metavar="S", help="hybrid sharding: shard groups of S ranks, W/S replicas")
    p.add_argument("--table", type=int, nargs="*", default=list(TABLE_WORLD_SIZES), metavar="W",
                   help="world sizes of the table (none: no table)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Print the estimate; exit status 2 with a one-line message on bad input."""
    args = build_parser().parse_args(argv)
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[args.param_dtype],
                                  reduce_dtype=DTYPES[args.reduce_dtype] if args.reduce_dtype else None,
                                  all_gather_dtype=torch.int8 if args.all_gather_dtype else None)
    sharding = "hybrid" if args.hsdp is not None else args.sharding
    options = dict(mp_policy=policy, optimizer=args.optimizer, reshard_after_forward=args.reshard_after_forward,
                   max_inflight=args.max_inflight, sharding=sharding, shard_group_size=args.hsdp)
    try:
        est = estimate(args.preset, args.world_size, **options)
    except ValueError as err:
        print(f"python -m flashfsdp.estimate: error: {err}", file=sys.stderr)
        return 2
    hsdp = f", hybrid: {est.replicas} replicas of {est.shard_group_size} ranks" if est.replicas > 1 else ""
    print(f"Llama {args.preset}: {est.num_params:,} parameters, {len(est.units)} units, W = {est.world_size}"
          f"{hsdp}, param_dtype {args.param_dtype}, reduce_dtype {args.reduce_dtype or args.param_dtype}, "
          f"{'int8 all-gathers, ' if args.all_gather_dtype else ''}{args.optimizer}\n")
    print(memory_table(est) + "\n")
    print(comm_table(est))
    if args.table:
        with torch.device("meta"):
            counts = model_params(Llama(PRESETS[args.preset]))
        at = dict(options, sharding=args.sharding, shard_group_size=None)
        print("\nOver world sizes, full sharding (per rank; DeepSpeed: estimate_zero3_model_states_mem_needs, "
              "no offload):")
        print(world_size_table(lambda w: estimate(args.preset, w, **at), args.table, counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
