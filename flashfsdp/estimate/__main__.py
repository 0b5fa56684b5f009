"""``python -m flashfsdp.estimate --preset 8b --world-size 64 [--param-dtype bf16] [--hsdp 8]``:
memory per rank, communication per step, and a table over world sizes beside DeepSpeed's ZeRO-3.

``--hf-config config.json`` instead of ``--preset`` estimates any transformers decoder (built on the
meta device, one unit per decoder layer). The first line names every dtype assumed.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn

from flashfsdp import MixedPrecisionPolicy  # the public name (the CLI is an application of the library)
from flashfsdp.models import PRESETS, Llama
from flashfsdp.runtime.step import DEFAULT_BUCKET_BYTES

from .deepspeed import model_params
from .estimate import OPTIMIZER_STATES, estimate
from .report import comm_table, memory_table, world_size_table

PROG = "python -m flashfsdp.estimate"
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
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n", 1)[0])
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", help=f"model: one of {', '.join(PRESETS)}")
    model.add_argument("--hf-config", metavar="config.json",
                       help="model: a transformers decoder's config.json (or its folder), built on the meta "
                            "device (needs transformers); one unit per decoder layer")
    p.add_argument("--world-size", type=int, required=True, help="ranks in all (W)")
    p.add_argument("--param-dtype", choices=sorted(DTYPES),
                   help="unsharded parameters' dtype (default: fp32, no mixed precision)")
    p.add_argument("--reduce-dtype", choices=sorted(DTYPES), help="reduce-scatter dtype (default: --param-dtype)")
    p.add_argument("--all-gather-dtype", choices=("int8",),
                   help="int8: the bytes of quantised all-gathers (ZeRO++ qwZ, a scale per 256 values)")
    p.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adamw")
    p.add_argument("--reshard-after-forward", type=_reshard, default=None, metavar="true|false|default|K")
    p.add_argument("--max-inflight", type=int, default=2, help="prefetched units ahead of compute")
    p.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES, metavar="N",
                   help="the most bytes units that share one all-gather or reduce-scatter move "
                        f"(set_bucket_bytes; default: the runtime's, {DEFAULT_BUCKET_BYTES}); 0: none")
    p.add_argument("--sharding", choices=("full", "grad_op"), help="(hybrid: use --hsdp)")
    p.add_argument("--hsdp", type=int, metavar="S", help="hybrid sharding: shard groups of S ranks, W/S replicas")
    p.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism (--preset only): a (W/N, N) mesh, the Llama TP plan with sequence "
                        "parallelism over N ranks, fully_shard over the W/N others")
    p.add_argument("--tokens", type=int, metavar="T",
                   help="tokens of one TP group's step, for the TP communication (default: one sequence)")
    p.add_argument("--table", type=int, nargs="*", default=list(TABLE_WORLD_SIZES), metavar="W",
                   help="world sizes of the table (none: no table)")
    return p


def hf_model(path: str) -> tuple[str, nn.Module, list[nn.Module]]:
    """(name, the model on the meta device, its decoder layers) of a transformers config.

    Args:
        path: a config.json, or the folder holding it.

    Raises:
        ValueError: transformers is not installed, the file cannot be read as a config, or the
            model has no list of layers (the message names --hf-config).
    """
    try:
        import transformers  # noqa: PLC0415 - optional: the hf extra
    except ImportError:
        raise ValueError("--hf-config needs transformers: pip install 'flashfsdp[hf]'") from None
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"--hf-config {path}: not a transformers config ({str(err).splitlines()[0]})") from None
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"--hf-config {path}: the {type(model).__name__} has no list of layers to shard")
    return f"{type(model).__name__} ({config.model_type})", model, list(max(lists, key=len))


def _model(args) -> tuple[str, nn.Module | str, list | None]:
    """(name, what `estimate` takes, the units or None) of --preset or --hf-config."""
    if args.hf_config:
        return hf_model(args.hf_config)
    return f"Llama {args.preset}", args.preset, None


def _assumed(args, est, master_dtype: torch.dtype) -> str:
    """The first line: the model, W, and every dtype the estimate assumed, defaults said as such."""
    param = args.param_dtype or "fp32"
    reduce = args.reduce_dtype or param
    master = str(master_dtype).replace("torch.", "")
    hsdp = f", hybrid: {est.replicas} replicas of {est.shard_group_size} ranks" if est.replicas > 1 else ""
    hsdp += f", (dp, tp) = ({est.world_size // est.tp}, {est.tp})" if est.tp > 1 else ""
    return (f"{est.num_params:,} parameters, {len(est.units)} units, W = {est.world_size}{hsdp}; dtypes assumed: "
            f"{master} master weights, gradients and {args.optimizer} state, param_dtype {param}"
            f"{'' if args.param_dtype else ' (default)'}, reduce_dtype {reduce}"
            f"{'' if args.reduce_dtype else ' (= param_dtype)'}"
            f"{', int8 all-gathers' if args.all_gather_dtype else ''}")


def _print_estimate(args) -> int:
    """Compute and print the estimate of `args`; 2 and a one-line message on bad input."""
    param = DTYPES[args.param_dtype or "fp32"]
    policy = MixedPrecisionPolicy(param_dtype=param,
                                  reduce_dtype=DTYPES[args.reduce_dtype] if args.reduce_dtype else None,
                                  all_gather_dtype=torch.int8 if args.all_gather_dtype else None)
    sharding = "hybrid" if args.hsdp is not None else args.sharding
    options = dict(mp_policy=policy, optimizer=args.optimizer, reshard_after_forward=args.reshard_after_forward,
                   max_inflight=args.max_inflight, sharding=sharding, shard_group_size=args.hsdp,
                   bucket_bytes=args.bucket_bytes)
    tp = dict(tp=args.tp, tokens=args.tokens)
    try:
        name, model, units = _model(args)
        est = estimate(model, args.world_size, units=units, **options, **tp)
    except ValueError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    if not isinstance(model, nn.Module):
        with torch.device("meta"):
            model = Llama(PRESETS[args.preset])
    print(f"{name}: {_assumed(args, est, next(model.parameters()).dtype)}\n")
    print(memory_table(est) + "\n")
    print(comm_table(est))
    if args.table:
        at = dict(options, sharding=args.sharding, shard_group_size=None, units=units)
        print("\nOver world sizes, full sharding (per rank; DeepSpeed: estimate_zero3_model_states_mem_needs, "
              "no offload):")
        print(world_size_table(lambda w: estimate(model, w, **at), args.table, model_params(model)))
        if args.tp > 1:
            print("(the table is without tensor parallelism)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Print the estimate; exit status 2 with a one-line message on bad input. Output cut short
    by its reader (``| head``) ends quietly with status 0."""
    args = build_parser().parse_args(argv)
    try:
        code = _print_estimate(args)
        sys.stdout.flush()
    except BrokenPipeError:
        # The reader is gone: point stdout at /dev/null so the interpreter's final flush is quiet.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return code


if __name__ == "__main__":
    sys.exit(main())
