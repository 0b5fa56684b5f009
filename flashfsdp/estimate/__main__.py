"""``python -m flashfsdp.estimate --preset 8b --world-size 64 [--param-dtype bf16] [--hsdp 8]``:
memory per rank, communication per step, and a table over world sizes beside DeepSpeed's ZeRO-3.

``--hf-config config.json`` instead of ``--preset`` estimates any transformers decoder (built on the
meta device, one unit per decoder layer). The dtypes default to FSDP's mixed precision: fp32
master weights, gradients and optimizer state (``--master-dtype``), whatever dtype the config was
saved in, and ``param_dtype`` from ``--param-dtype``, else the config's ``torch_dtype`` (or
``dtype``), else the master dtype. The first line names every dtype assumed and where it came from.
Bad input (an option, a config field of the wrong type or sign) is one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

import torch
from torch import nn

from flashfsdp import MixedPrecisionPolicy  # the public name (the CLI is an application of the library)
from flashfsdp.models import PRESETS, Llama, config_from_preset
from flashfsdp.runtime.step import DEFAULT_BUCKET_BYTES

from .deepspeed import model_params
from .estimate import OPTIMIZER_STATES, estimate
from .report import comm_table, memory_table, world_size_table
from .pipeline import SCHEDULES
from .pipeline_cli import print_pipeline
from .units import unit_members

PROG = "python -m flashfsdp.estimate"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TABLE_WORLD_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)
# config.json's dtype names (transformers writes torch's) -> the options' names; "auto" or null: none given
HF_DTYPES = {"float32": "fp32", "float": "fp32", "bfloat16": "bf16", "float16": "fp16", "half": "fp16"}
# config.json fields that size the model: a positive integer where present (null: transformers' default)
HF_SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings", "n_embd", "n_layer", "n_head",
                  "n_positions", "d_model", "ffn_dim")
# other count- or size-like fields (num_experts, moe_intermediate_size, ...): an integer >= 0 where a number
_COUNT_LIKE = re.compile(r"^(num|n)_|_(size|dim)$")


class UsageError(Exception):
    """Bad command-line input; the message names the option (printed as one line, exit code 2)."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block): :func:`main` prints
    ``python -m flashfsdp.estimate: error: <message> (see --help)`` and returns 2."""

    def error(self, message: str):
        """Raise :class:`UsageError` with argparse's message."""
        raise UsageError(f"{message} (see --help)")


def _positive(text: str) -> int:
    """A world size of --table: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a world size (an integer >= 1), got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"a world size is an integer >= 1, got {value}")
    return value


def _count(text: str) -> int:
    """A count of the pipeline options (--pp, --microbatches, ...): an integer >= 1."""
    try:
        return _positive(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None


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
    p = Parser(prog=PROG, description="Memory per rank and communication per step of a model sharded by "
                                      "fully_shard, before running it, and a table over world sizes beside "
                                      "DeepSpeed's ZeRO-3 formula. The dtypes default to FSDP's mixed precision "
                                      "(fp32 master weights, gradients and optimizer state); the first line of "
                                      "the output names every dtype assumed.")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", help=f"model: one of {', '.join(PRESETS)}")
    model.add_argument("--hf-config", metavar="config.json",
                       help="model: a transformers decoder's config.json (or its folder), built on the meta "
                            "device (needs transformers); one unit per decoder layer")
    p.add_argument("--world-size", type=int, required=True, help="ranks in all (W)")
    p.add_argument("--master-dtype", choices=sorted(DTYPES),
                   help="the sharded master weights', gradients' and optimizer state's dtype (default: fp32, "
                        "FSDP's mixed precision, whatever dtype --hf-config's model was saved in)")
    p.add_argument("--param-dtype", choices=sorted(DTYPES),
                   help="unsharded parameters' dtype (default: --hf-config's torch_dtype, else the master dtype)")
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
    pipe = p.add_argument_group("pipeline parallelism (--preset only): W = pp x dp x tp")
    pipe.add_argument("--pp", type=_count, metavar="N", help="pipeline ranks: the blocks split into stages, each "
                      "stage's blocks fully_shard'ed over its dp ranks; a row per pipeline rank")
    pipe.add_argument("--microbatches", type=_count, metavar="M", help="micro-batches per step (with --pp)")
    pipe.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="torch's schedule (default 1f1b)")
    pipe.add_argument("--virtual-stages", type=_count, metavar="V",
                      help="stages per pipeline rank (interleaved1f1b; default 2 there)")
    pipe.add_argument("--microbatch-size", type=_count, default=1, metavar="B", help="sequences per micro-batch")
    pipe.add_argument("--seq-len", type=_count, metavar="S", help="tokens per sequence (default: the preset's)")
    p.add_argument("--table", type=_positive, nargs="*", default=list(TABLE_WORLD_SIZES), metavar="W",
                   help="world sizes of the table, each >= 1 (none: no table)")
    return p


def read_hf_config(path: str) -> dict:
    """The fields of the config.json at ``path`` (a file, or the folder holding it), checked: the
    fields that size the model (``HF_SIZE_FIELDS``) are positive integers where given, other
    count- or size-like numbers (``num_*``, ``*_size``, ...) integers >= 0. ``{}`` where ``path``
    is neither (transformers then says what it is not).

    Raises:
        ValueError: the file is not a JSON object, or a field has the wrong type or sign (the
            message names --hf-config, the field and its value).
    """
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        return {}
    try:
        with open(file, encoding="utf-8") as f:
            fields = json.load(f)
    except (OSError, ValueError) as err:
        raise ValueError(f"--hf-config {path}: cannot read it as JSON ({err})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"--hf-config {path}: expected a JSON object of config fields, got a {type(fields).__name__}")
    _check_fields(fields, path, "")
    return fields


def _check_fields(fields: dict, path: str, prefix: str) -> None:
    """The checks of :func:`read_hf_config` on ``fields`` and on nested ``*_config`` objects."""
    for key, value in fields.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and key.endswith("_config"):
            _check_fields(value, path, f"{name}.")
            continue
        if value is None:
            continue
        core = key in HF_SIZE_FIELDS
        if not core and not (_COUNT_LIKE.search(key) and isinstance(value, (int, float, str))):
            continue
        minimum = 1 if core else 0
        if isinstance(value, bool) or not isinstance(value, int):
            quoted = " (a string: write the number without quotes)" if isinstance(value, str) else ""
            raise ValueError(f"--hf-config {path}: {name} must be an integer >= {minimum}, got {value!r}{quoted}")
        if value < minimum:
            raise ValueError(f"--hf-config {path}: {name} must be an integer >= {minimum}, got {value}")


def config_param_dtype(fields: dict, path: str) -> tuple[str | None, str]:
    """(the option name, "bf16", ..., of the config's ``dtype`` or older ``torch_dtype`` field,
    that field's name); the name None where the field is absent, null or "auto".

    Raises:
        ValueError: a dtype the estimate does not know (the message says to pass --param-dtype).
    """
    key = "dtype" if fields.get("dtype") is not None else "torch_dtype"
    value = fields.get(key)
    if value is None or value == "auto":
        return None, key
    if not isinstance(value, str) or value.removeprefix("torch.") not in HF_DTYPES:
        raise ValueError(f"--hf-config {path}: {key} {value!r} is none of {', '.join(HF_DTYPES)}; pass --param-dtype")
    return HF_DTYPES[value.removeprefix("torch.")], key


def _one_line(err: BaseException) -> str:
    """An exception's message on one line (transformers' validation errors span several)."""
    return " ".join(str(err).split()) or type(err).__name__


def hf_model(path: str, master_dtype: torch.dtype = torch.float32) -> tuple[str, nn.Module, list[nn.Module]]:
    """(name, the model on the meta device, its decoder layers) of a transformers config.

    Args:
        path: a config.json, or the folder holding it.
        master_dtype: the parameters' dtype (the sharded master weights'), whatever the config's
            ``torch_dtype``.

    Raises:
        ValueError: transformers is not installed, the file cannot be read as a config (a field
            of the wrong type or sign: see :func:`read_hf_config`), transformers cannot build the
            model, or the model has no list of layers (the message names --hf-config).
    """
    try:
        import transformers  # noqa: PLC0415 - optional: the hf extra
    except ImportError:
        raise ValueError("--hf-config needs transformers: pip install 'flashfsdp[hf]'") from None
    read_hf_config(path)
    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except Exception as err:  # noqa: BLE001 - any failure to read the file is bad input, said in one line
        raise ValueError(f"--hf-config {path}: not a transformers config ({_one_line(err)})") from None
    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config).to(master_dtype)
    except Exception as err:  # noqa: BLE001 - the config's values are what transformers refused
        raise ValueError(f"--hf-config {path}: transformers cannot build the model ({_one_line(err)})") from None
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    if not lists:
        raise ValueError(f"--hf-config {path}: the {type(model).__name__} has no list of layers to shard")
    return f"{type(model).__name__} ({config.model_type})", model, list(max(lists, key=len))


def _model(args, master_dtype: torch.dtype) -> tuple[str, nn.Module, list | None]:
    """(name, the model on the meta device in ``master_dtype``, the units or None) of --preset or
    --hf-config."""
    if args.hf_config:
        return hf_model(args.hf_config, master_dtype)
    config = config_from_preset(args.preset)  # an unknown preset's error names the presets
    with torch.device("meta"):
        return f"Llama {args.preset}", Llama(config).to(master_dtype), None


def _dtypes(args) -> tuple[str, str, str, str]:
    """(master, where from, param_dtype, where from) as option names ("fp32", ...)."""
    master = args.master_dtype or "fp32"
    master_from = "" if args.master_dtype else " (default)"
    if args.param_dtype:
        return master, master_from, args.param_dtype, ""
    if args.hf_config:
        from_config, key = config_param_dtype(read_hf_config(args.hf_config), args.hf_config)
        if from_config:
            return master, master_from, from_config, f" (config.json {key})"
    return master, master_from, master, " (default)"


def _assumed(args, est, master: str, master_from: str, param: str, param_from: str) -> str:
    """The first line: the model, W, and every dtype the estimate assumed, where each came from."""
    reduce = args.reduce_dtype or param
    master_name = str(DTYPES[master]).replace("torch.", "")
    hsdp = f", hybrid: {est.replicas} replicas of {est.shard_group_size} ranks" if est.replicas > 1 else ""
    hsdp += f", (dp, tp) = ({est.world_size // est.tp}, {est.tp})" if est.tp > 1 else ""
    return (f"{est.num_params:,} parameters, {len(est.units)} units, W = {est.world_size}{hsdp}; dtypes assumed: "
            f"{master_name} master weights, gradients and {args.optimizer} state{master_from}, param_dtype {param}"
            f"{param_from}, reduce_dtype {reduce}{'' if args.reduce_dtype else ' (= param_dtype)'}"
            f"{', int8 all-gathers' if args.all_gather_dtype else ''}")


def _print_estimate(args) -> int:
    """Compute and print the estimate of `args`; 2 and a one-line message on bad input."""
    if args.pp is not None or args.microbatches is not None:
        return print_pipeline(args, PROG, DTYPES)
    try:
        master, master_from, param, param_from = _dtypes(args)
        name, model, units = _model(args, DTYPES[master])
        policy = MixedPrecisionPolicy(param_dtype=DTYPES[param],
                                      reduce_dtype=DTYPES[args.reduce_dtype] if args.reduce_dtype else None,
                                      all_gather_dtype=torch.int8 if args.all_gather_dtype else None)
        sharding = "hybrid" if args.hsdp is not None else args.sharding
        options = dict(mp_policy=policy, optimizer=args.optimizer, reshard_after_forward=args.reshard_after_forward,
                       max_inflight=args.max_inflight, sharding=sharding, shard_group_size=args.hsdp,
                       bucket_bytes=args.bucket_bytes)
        est = estimate(model, args.world_size, units=units, **options, tp=args.tp, tokens=args.tokens)
        table = None
        if args.table:
            at = dict(options, sharding=args.sharding, shard_group_size=None, units=units)
            table = world_size_table(lambda w: _at(model, w, at), args.table, model_params(model))
    except ValueError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(f"{name}: {_assumed(args, est, master, master_from, param, param_from)}\n")
    print(memory_table(est, unit_members(model, units)) + "\n")
    print(comm_table(est))
    if table is not None:
        print("\nOver world sizes, full sharding (per rank, activations excluded):")
        print(table)
        if args.tp > 1:
            print("(the table is without tensor parallelism)")
    return 0


def _at(model: nn.Module, world_size: int, options: dict):
    """The estimate of a row of --table (its errors name the row's world size)."""
    try:
        return estimate(model, world_size, **options)
    except ValueError as err:
        raise ValueError(f"--table {world_size}: {err}") from None


def main(argv: list[str] | None = None) -> int:
    """Print the estimate; returns the exit status: 0, or 2 with a one-line message on bad input
    (``--help``: 0 after the help). Output cut short by its reader (``| head``) ends quietly with
    status 0."""
    try:
        args = build_parser().parse_args(argv)
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as exit:  # --help
        return exit.code if isinstance(exit.code, int) else 0
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
