"""Command line of `flashfsdp-train`: the parser, per-preset defaults, and the saved run config.

Options left unset on the command line are filled from `PRESET_TRAINING` (and, on `--resume`,
from the run's saved `run.json`, so a resumed run keeps its model, data order and
learning-rate schedule whatever the number of ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from flashfsdp.models import PRESETS, LlamaConfig, config_from_preset

RUN_CONFIG = "run.json"

# Training defaults per preset: steps, global batch (sequences), peak learning rate, warm-up
# (at most a tenth of --steps).
PRESET_TRAINING = {
    "tiny": dict(steps=200, batch_size=32, lr=3e-3, warmup=20),
    "small": dict(steps=2000, batch_size=32, lr=1e-3, warmup=100),
    "1b": dict(steps=5000, batch_size=16, lr=3e-4, warmup=200),
}

# Options that fix the model, the data order and the learning-rate schedule: on --resume they
# come from the run's saved config (an explicit different value is ignored with a warning).
RESUME_FIXED = ("preset", "layers", "dim", "heads", "seq_len", "data", "seed", "batch_size",
                "lr", "min_lr", "warmup", "decay_steps", "weight_decay", "max_grad_norm")


class UsageError(Exception):
    """Bad command-line input: the message names the option and the fix (exit code 2)."""


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block); exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The `flashfsdp-train` argument parser (defaults of None are resolved by `resolve`)."""
    p = _Parser(
        prog="flashfsdp-train",
        description="Train a byte-level Llama-style language model sharded with flashfsdp.",
    )
    model = p.add_argument_group("model")
    model.add_argument("--preset", choices=sorted(PRESETS), default=None,
                       help="model size (default: tiny)")
    model.add_argument("--layers", type=int, help="override the preset's number of blocks")
    model.add_argument("--dim", type=int, help="override the preset's model width")
    model.add_argument("--heads", type=int, help="override the preset's attention heads")
    model.add_argument("--seq-len", type=int, help="training sequence length in bytes")

    data = p.add_argument_group("data")
    data.add_argument("--data", metavar="PATH",
                      help="a text file or a directory of text files (default: the Python "
                           "standard library's .py sources)")
    data.add_argument("--seed", type=int, default=None, help="model init and data order (default 0)")

    opt = p.add_argument_group("optimisation")
    opt.add_argument("--steps", type=int, help="optimizer steps to reach (preset default)")
    opt.add_argument("--batch-size", type=int, help="global batch in sequences, over all ranks")
    opt.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (default 1)")
    opt.add_argument("--lr", type=float, help="peak learning rate (preset default)")
    opt.add_argument("--min-lr", type=float, help="final learning rate (default lr/10)")
    opt.add_argument("--warmup", type=int, help="linear warm-up steps (preset default)")
    opt.add_argument("--weight-decay", type=float, default=None, help="AdamW decay (default 0.1)")
    opt.add_argument("--max-grad-norm", type=float, default=None,
                     help="clip the global gradient norm (default 1.0; 0 disables)")
    opt.add_argument("--param-dtype", choices=("bf16", "fp32"),
                     help="compute dtype of unsharded parameters (default bf16 on CUDA, fp32 on CPU)")
    opt.add_argument("--reduce-dtype", choices=("bf16", "fp32"), default="fp32",
                     help="dtype of gradient reduce-scatter (default fp32)")

    run = p.add_argument_group("run")
    run.add_argument("--out", metavar="DIR", help="run directory (default runs/<preset>-<time>)")
    run.add_argument("--resume", action="store_true",
                     help="continue from the last checkpoint in --out (any number of ranks)")
    run.add_argument("--eval-every", type=int, help="validation every N steps (default steps/10)")
    run.add_argument("--eval-batches", type=int, default=4,
                     help="global batches per validation (default 4)")
    run.add_argument("--save-every", type=int,
                     help="checkpoint every N steps (default steps/4); one is always saved at the end")
    run.add_argument("--keep-checkpoints", type=int, default=2,
                     help="newest checkpoints kept in --out (default 2; 0 keeps all)")
    run.add_argument("--nproc", type=int,
                     help="local workers when started plainly (default 2 on CPU, every GPU on CUDA)")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    run.add_argument("--prompt", default="def ", help="prompt for the final samples")
    run.add_argument("--sample-tokens", type=int, default=200,
                     help="bytes sampled per continuation at the end (0: no samples)")
    return p


def _saved_config(out: str) -> dict:
    path = os.path.join(out, RUN_CONFIG)
    try:
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    except FileNotFoundError:
        raise UsageError(
            f"--resume: {out} is not a flashfsdp-train run directory (no {RUN_CONFIG}); "
            "point --out at an earlier run's directory or start without --resume"
        ) from None


def resolve(args: argparse.Namespace, device_type: str, warn: bool = True) -> argparse.Namespace:
    """Fill unset options: from the saved run config on --resume, else from the preset.

    Args:
        args: the parsed namespace (modified in place and returned).
        device_type: "cpu" or "cuda", the resolved device (decides the param dtype default).
        warn: print a warning for each explicit option that --resume overrides.

    Raises:
        UsageError: --resume without --out or without a saved run; a non-positive size.
    """
    if args.resume:
        if not args.out:
            raise UsageError("--resume needs --out DIR, the directory of the run to continue")
        saved = _saved_config(args.out)
        for key in RESUME_FIXED:
            given = getattr(args, key, None)
            if warn and given is not None and given != saved.get(key):
                print(f"flashfsdp-train: warning: --{key.replace('_', '-')} {given} ignored on "
                      f"--resume; the run's value {saved.get(key)} is kept", file=sys.stderr)
            setattr(args, key, saved.get(key))
        if args.steps is None:
            args.steps = saved["steps"]
    def default(name, value):
        if getattr(args, name, None) is None:
            setattr(args, name, value)

    default("preset", "tiny")
    preset = PRESET_TRAINING[args.preset]
    default("steps", preset["steps"])
    default("batch_size", preset["batch_size"])
    default("lr", preset["lr"])
    default("warmup", min(preset["warmup"], max(1, args.steps // 10)))
    default("seed", 0)
    default("min_lr", args.lr / 10)
    default("decay_steps", args.steps)
    default("weight_decay", 0.1)
    default("max_grad_norm", 1.0)
    default("param_dtype", "bf16" if device_type == "cuda" else "fp32")
    default("eval_every", max(1, args.steps // 10))
    default("save_every", max(1, args.steps // 4))
    if args.data is not None:
        args.data = os.path.abspath(args.data)
    for name in ("steps", "batch_size", "grad_accum", "eval_every", "eval_batches", "save_every"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.lr <= 0 or not 0 <= args.min_lr <= args.lr:
        raise UsageError(f"--lr must be positive and --min-lr in [0, lr]; got {args.lr}, {args.min_lr}")
    if args.out is None:
        args.out = os.path.join("runs", f"{args.preset}-{time.strftime('%Y%m%d-%H%M%S')}")
    args.out = os.path.abspath(args.out)
    return args


def model_config(args: argparse.Namespace) -> LlamaConfig:
    """The `LlamaConfig` of a resolved namespace (preset plus --layers/--dim/--heads/--seq-len).

    Raises:
        UsageError: the overrides make an invalid model (the message names the fields).
    """
    try:
        return config_from_preset(args.preset, n_layers=args.layers, dim=args.dim,
                                  n_heads=args.heads, max_seq_len=args.seq_len)
    except ValueError as err:
        raise UsageError(f"--layers/--dim/--heads/--seq-len: {err}") from None


def save_run_config(args: argparse.Namespace) -> None:
    """Write the resolved options to `<out>/run.json` (read back by `--resume`)."""
    os.makedirs(args.out, exist_ok=True)
    tmp = os.path.join(args.out, RUN_CONFIG + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(vars(args), fh, indent=1, sort_keys=True)
    os.replace(tmp, os.path.join(args.out, RUN_CONFIG))
