"""The command lines of `flashfsdp-train` and `flashfsdp-train export`: argparse parsers, the
training presets' defaults, and the checks of option values that need nothing but the values.

Standard library only (see `flashfsdp_cli`): `flashfsdp.train.config.TrainConfig` resolves what
these parsers return; the model presets themselves are `flashfsdp.models.PRESETS`.
"""

from __future__ import annotations

import argparse

from flashfsdp_cli.errors import UsageError

PROG = "flashfsdp-train"
EXPORT_PROG = f"{PROG} export"

# Training defaults per preset: steps, global batch (sequences), peak learning rate, warm-up
# (at most a tenth of --steps). The model architecture of each preset is `flashfsdp.models.PRESETS`.
PRESET_TRAINING = {
    "tiny": dict(steps=200, batch_size=32, lr=3e-3, warmup=20),
    "small": dict(steps=2000, batch_size=32, lr=1e-3, warmup=100),
    "1b": dict(steps=5000, batch_size=16, lr=3e-4, warmup=200),
}

# Seconds a collective may wait for the other ranks before it fails (--timeout): a hung or
# stopped rank then stops the job instead of holding every other rank forever.
DEFAULT_TIMEOUT_S = 600.0

# Options that must be positive integers.
POSITIVE = ("steps", "batch_size", "grad_accum", "eval_every", "eval_batches", "save_every")
DTYPE_NAMES = ("bf16", "fp16", "fp32")
# torch's dtype names accepted on the command line for the short ones.
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}

# Where metrics go besides <out>/metrics.jsonl (flashfsdp.train.loggers), off unless asked for.
_METRIC_SINKS = (
    ("--tensorboard", "also log the metrics to TensorBoard in <out>/tensorboard (needs the "
                      "tensorboard package: pip install 'flashfsdp[train]')"),
    ("--wandb", "also log the metrics to Weights & Biases (needs the wandb package; project "
                "from WANDB_PROJECT, default flashfsdp-train)"),
)

_COMMANDS = f"""commands:
  {PROG} [options]
      train (the options above)
  {EXPORT_PROG} --out RUN --to DIR [--step N]
      a run's checkpoint as a transformers LlamaForCausalLM folder (see {EXPORT_PROG} --help)
"""


def _dtype_name(value: str) -> str:
    """A --param-dtype/--reduce-dtype value with torch's names (float16, ...) mapped to the short ones."""
    return DTYPE_ALIASES.get(value, value)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (no usage block); exit code 2."""

    def error(self, message: str):
        """Exit with code 2 and `prog: error: message (see --help)` on stderr."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The `flashfsdp-train` argument parser (defaults of None are filled by `TrainConfig`)."""
    p = Parser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_COMMANDS,
        description="Train a byte-level Llama-style language model sharded with flashfsdp, or "
                    "fine-tune a transformers Llama (--init-from).",
    )
    p.add_argument("--config", metavar="FILE.toml",
                   help="a TOML file of option values, keys as the options' names (seq-len = 256 "
                        "or seq_len = 256); options given on the command line override it")
    _add_model_and_data_options(p)
    _add_optimisation_options(p.add_argument_group("optimisation"))
    _add_run_options(p.add_argument_group("run"))
    return p


def _add_model_and_data_options(p: argparse.ArgumentParser) -> None:
    """The "model" and "data" option groups of `build_parser`."""
    model = p.add_argument_group("model")
    model.add_argument("--preset", choices=sorted(PRESET_TRAINING), default=None,
                       help="model size (default: tiny)")
    model.add_argument("--layers", type=int, help="override the preset's number of blocks")
    model.add_argument("--dim", type=int, help="override the preset's model width")
    model.add_argument("--heads", type=int, help="override the preset's attention heads")
    model.add_argument("--seq-len", type=int, help="training sequence length in tokens")
    model.add_argument("--init-from", metavar="DIR",
                       help="start from a transformers LlamaForCausalLM folder (config.json + "
                            "safetensors, and its tokenizer.json): the model's shape, weights and "
                            "tokenizer, loaded unit by unit (e.g. a flashfsdp-train export)")
    model.add_argument("--freeze", metavar="PATTERN", action="append",
                       help="train only the parameters matching no PATTERN (a glob over names such as "
                            "layers.0.attention.wq.weight or the transformers names, e.g. '*embed*', "
                            "'layers.[0-3].*'); repeatable")

    data = p.add_argument_group("data")
    data.add_argument("--data", metavar="PATH",
                      help="a text file or a directory of text files (default: the Python "
                           "standard library's .py sources), or a folder saved by the datasets "
                           "package's save_to_disk (its 'text' column)")
    data.add_argument("--tokenizer", metavar="PATH",
                      help="a tokenizer.json of the tokenizers package (default: raw UTF-8 bytes, "
                           "vocabulary 256, or --init-from's tokenizer.json); the model's vocabulary "
                           "is the tokenizer's")
    data.add_argument("--seed", type=int, default=None, help="model init and data order (default 0)")


def _add_optimisation_options(opt) -> None:
    """The "optimisation" option group of `build_parser`."""
    opt.add_argument("--steps", type=int, help="optimizer steps to reach (preset default)")
    opt.add_argument("--batch-size", type=int, help="global batch in sequences, over all ranks")
    opt.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (default 1)")
    opt.add_argument("--lr", type=float, help="peak learning rate (preset default)")
    opt.add_argument("--min-lr", type=float, help="final learning rate (default lr/10)")
    opt.add_argument("--warmup", type=int, help="linear warm-up steps (preset default)")
    opt.add_argument("--decay-steps", type=int,
                     help="step at which the cosine decay reaches --min-lr (default --steps)")
    opt.add_argument("--weight-decay", type=float, default=None, help="AdamW decay (default 0.1)")
    opt.add_argument("--max-grad-norm", type=float, default=None,
                     help="clip the global gradient norm (default 1.0; 0 disables)")
    opt.add_argument("--param-dtype", choices=DTYPE_NAMES, type=_dtype_name,
                     help="compute dtype of unsharded parameters (default bf16 on CUDA, fp32 on CPU; "
                          "fp16, also spelled float16, trains with dynamic loss scaling)")
    opt.add_argument("--reduce-dtype", choices=DTYPE_NAMES, type=_dtype_name, default="fp32",
                     help="dtype of gradient reduce-scatter (default fp32)")
    opt.add_argument("--all-gather-dtype", choices=("int8",), default=None,
                     help="all-gather the weights block-wise quantised to int8, dequantised into "
                          "--param-dtype (ZeRO++ qwZ; default: all-gather in --param-dtype)")

    opt.add_argument("--activation-checkpointing", action="store_true",
                     help="recompute each block's activations in backward (torch's "
                          "checkpoint_wrapper, non-reentrant): less memory, about 1/3 more compute")
    opt.add_argument("--compile", action="store_true",
                     help="torch.compile each block after sharding (default backend; the first "
                          "steps compile); the sharding hooks run eagerly between the blocks")


def _add_run_options(run) -> None:
    """The "run" option group of `build_parser`."""
    run.add_argument("--out", metavar="DIR",
                     help="run directory (default runs/<preset>-<time>); one run at a time uses it")
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
    run.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                     help="seconds a collective waits for the other ranks before the job stops "
                          f"with an error (a hung rank); default {DEFAULT_TIMEOUT_S:.0f}")
    run.add_argument("--log-ranks", default="0", metavar="0|all|R,R",
                     help="ranks whose progress messages and notices are shown (default 0)")
    for flag, text in _METRIC_SINKS:
        run.add_argument(flag, action="store_true", help=text)
    run.add_argument("--peak-tflops", type=float, metavar="TFLOPS",
                     help="peak dense TFLOP/s of one device for MFU (default: the table for known "
                          "GPUs; MFU is n/a on CPU without it)")
    run.add_argument("--prompt", default="def ", help="prompt for the final samples")
    run.add_argument("--sample-tokens", type=int, default=200,
                     help="bytes sampled per continuation at the end (0: no samples)")


def build_export_parser() -> argparse.ArgumentParser:
    """The `flashfsdp-train export` argument parser."""
    parser = Parser(prog=EXPORT_PROG, description="Convert a run's newest checkpoint into a Hugging Face "
                                                  "LlamaForCausalLM folder (config.json + model.safetensors, "
                                                  "and the run's tokenizer).")
    parser.add_argument("--out", metavar="RUN", required=True, help="the run directory (flashfsdp-train --out)")
    parser.add_argument("--to", metavar="DIR", required=True, help="the folder to write (created)")
    parser.add_argument("--step", type=int, metavar="N", help="the checkpoint after N steps (default: the newest)")
    return parser


def check_values(values: dict) -> None:
    """Check the option values that need nothing but themselves; None (unset) passes.

    Args:
        values: option values by destination name (argparse's namespace as a dict, or a resolved
            config's fields).

    Raises:
        UsageError: a non-positive size or period, a learning rate out of range, a non-positive
            or infinite timeout, a negative warm-up, a non-positive --decay-steps or
            --peak-tflops, or an invalid --log-ranks (the message names the option).
    """
    def given(name):
        return values.get(name) is not None

    for name in POSITIVE:
        if given(name) and values[name] <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {values[name]}")
    lr, min_lr = values.get("lr"), values.get("min_lr")
    if (lr is not None and lr <= 0) or (min_lr is not None and (min_lr < 0 or (lr is not None and min_lr > lr))):
        raise UsageError(f"--lr must be positive and --min-lr in [0, lr]; got {lr}, {min_lr}")
    if given("timeout") and (not values["timeout"] > 0 or values["timeout"] == float("inf")):
        raise UsageError(f"--timeout must be a positive number of seconds, got {values['timeout']}")
    if given("warmup") and values["warmup"] < 0:
        raise UsageError(f"--warmup must be non-negative, got {values['warmup']}")
    if given("decay_steps") and values["decay_steps"] <= 0:
        raise UsageError(f"--decay-steps must be positive, got {values['decay_steps']}")
    if given("peak_tflops") and not 0 < values["peak_tflops"] < float("inf"):
        raise UsageError(f"--peak-tflops must be a positive number, got {values['peak_tflops']}")
    if given("log_ranks"):
        check_log_ranks(values["log_ranks"])


def check_log_ranks(spec: str) -> None:
    """--log-ranks must be "all" or comma-separated non-negative ranks.

    Raises:
        UsageError: otherwise (names the option and the accepted forms).
    """
    parts = [p.strip() for p in str(spec).split(",")]
    if str(spec).strip().lower() == "all" or (parts and all(p.isdigit() for p in parts)):
        return
    raise UsageError(f"--log-ranks {spec!r}: give 0, all, or ranks such as 0,3")
