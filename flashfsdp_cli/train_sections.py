"""The sections of a `flashfsdp-train` configuration: each a typed frozen dataclass whose fields
are its command-line options (`flashfsdp-train --help`, one group per section) and its keys in a
`--config` TOML file (`[model] seq_len = 256`). Standard library only (see `flashfsdp_cli`).

The values here are names and numbers: dtypes stay names ("bf16") until the job builds its
runtime objects (`flashfsdp.train.precision`), and the job resolves the defaults that depend on
other options or on the machine (`default_text`, e.g. --lr from the preset, --param-dtype from
the device) into `flashfsdp.train.config.TrainConfig`, which holds one instance of each section.
"""

from __future__ import annotations

import argparse
import dataclasses

from flashfsdp_cli.config_fields import Option, check_ranges, option, options_of
from flashfsdp_cli.errors import UsageError

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
DTYPE_NAMES = ("bf16", "fp16", "fp32")
# torch's dtype names accepted for the short ones.
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}
# --reduce-quantization's values: the width of qgZ's quantised gradients.
REDUCE_QUANTIZATIONS = ("int8", "int4")
_RESHARD_WORDS = {"true": True, "false": False, "default": None, "none": None}


def dtype_name(value: str) -> str:
    """A dtype option's value with torch's names (float16, ...) mapped to the short ones."""
    return DTYPE_ALIASES.get(value, value)


def reshard_value(value: str) -> bool | int | None:
    """--reshard-after-forward's value: "true", "false", "default" (None: fully_shard's default)
    or a number of ranks.

    Raises:
        argparse.ArgumentTypeError: any other word (argparse's one-line error names the option).
    """
    word = str(value).strip().lower()
    if word in _RESHARD_WORDS:
        return _RESHARD_WORDS[word]
    try:
        return int(word)
    except ValueError:
        raise argparse.ArgumentTypeError(f"give true, false, default or a number of ranks, got {value!r}") from None


@dataclasses.dataclass(frozen=True)
class ModelSection:
    """The model: a size preset and its overrides, or a transformers Llama to start from."""

    preset: str = option("tiny", choices=sorted(PRESET_TRAINING), help="model size", resume="keep")
    layers: int | None = option(help="override the preset's number of blocks", resume="keep")
    dim: int | None = option(help="override the preset's model width", resume="keep")
    heads: int | None = option(help="override the preset's attention heads", resume="keep")
    seq_len: int | None = option(help="training sequence length in tokens", default_text="the preset's",
                                 resume="keep")
    init_from: str | None = option(
        metavar="DIR", resume="keep",
        help="start from a transformers LlamaForCausalLM folder (config.json + safetensors, and its "
             "tokenizer.json): the model's shape, weights and tokenizer, loaded unit by unit (e.g. a "
             "flashfsdp-train export)")
    freeze: tuple[str, ...] = option(
        (), metavar="PATTERN", resume="keep",
        help="train only the parameters matching no PATTERN (a glob over names such as "
             "layers.0.attention.wq.weight or the transformers names, e.g. '*embed*', 'layers.[0-3].*')")

    def __post_init__(self) -> None:
        object.__setattr__(self, "freeze", tuple(self.freeze or ()))  # run.json holds a list

    @property
    def flags(self) -> str:
        """The model options as typed on the command line, e.g. "--preset tiny --layers 2"."""
        if self.init_from is not None:
            return f"--init-from {self.init_from}" + (f" --seq-len {self.seq_len}" if self.seq_len else "")
        overrides = (("layers", self.layers), ("dim", self.dim), ("heads", self.heads), ("seq-len", self.seq_len))
        return f"--preset {self.preset}" + "".join(f" --{k} {v}" for k, v in overrides if v is not None)


@dataclasses.dataclass(frozen=True)
class DataSection:
    """The training text and its tokenizer."""

    path: str | None = option(
        flag="--data", metavar="PATH", resume="keep",
        default_text="the Python standard library's .py sources",
        help="a text file or a directory of text files, or a folder saved by the datasets package's "
             "save_to_disk (its 'text' column)")
    tokenizer: str | None = option(
        metavar="PATH", resume="keep", default_text="raw UTF-8 bytes, vocabulary 256, or --init-from's tokenizer.json",
        help="a tokenizer.json of the tokenizers package; the model's vocabulary is the tokenizer's")


@dataclasses.dataclass(frozen=True)
class TrainingSection:
    """The steps, the batch and how each step computes."""

    steps: int | None = option(help="optimizer steps to reach", default_text="the preset's", check="positive",
                               resume="default")
    batch_size: int | None = option(help="global batch in sequences, over all ranks", default_text="the preset's",
                                    check="positive", resume="keep")
    grad_accum: int = option(1, help="micro-batches per step", check="positive")
    seed: int = option(0, help="model init and data order", resume="keep")
    activation_checkpointing: bool = option(
        False, help="recompute each block's activations in backward (torch's checkpoint_wrapper, "
                    "non-reentrant): less memory, about 1/3 more compute")
    compile: bool = option(False, help="torch.compile each block after sharding (default backend; the first "
                                       "steps compile); the sharding hooks run eagerly between the blocks")


@dataclasses.dataclass(frozen=True)
class OptimizerSection:
    """AdamW, its learning-rate schedule and the gradient clipping."""

    lr: float | None = option(help="peak learning rate", default_text="the preset's", resume="keep")
    min_lr: float | None = option(help="final learning rate", default_text="lr/10", resume="keep")
    warmup: int | None = option(help="linear warm-up steps", default_text="the preset's, at most steps/10",
                                check="non_negative", resume="keep")
    decay_steps: int | None = option(help="step at which the cosine decay reaches --min-lr", default_text="--steps",
                                     check="positive", resume="keep")
    weight_decay: float = option(0.1, help="AdamW decay of the matrices", resume="keep")
    max_grad_norm: float = option(1.0, help="clip the global gradient norm to this; 0 only measures it", resume="keep")


@dataclasses.dataclass(frozen=True)
class ShardingSection:
    """How each block and the root are sharded: tensor parallelism, then fully_shard's
    MixedPrecisionPolicy and resharding."""

    tp: int = option(
        1, check="positive",
        help="tensor-parallel degree: the ranks form a (W/tp, tp) mesh; each block is split over the tp ranks "
             "of its group (torchtitan's plan with sequence parallelism: flashfsdp.models.tp_plan), then "
             "fully_shard'ed over the W/tp data-parallel ranks, which take the batch's rows; tp must divide "
             "the world size, the heads, the key/value heads and the feed-forward width")

    param_dtype: str | None = option(
        choices=DTYPE_NAMES, parse=dtype_name, default_text="bf16 on CUDA, fp32 on CPU",
        help="compute dtype of unsharded parameters (fp16, also spelled float16, trains with dynamic loss scaling)")
    reduce_dtype: str = option("fp32", choices=DTYPE_NAMES, parse=dtype_name,
                               help="dtype of gradient reduce-scatter")
    all_gather_dtype: str | None = option(
        choices=("int8",), default_text="all-gather in --param-dtype",
        help="all-gather the weights block-wise quantised to int8, dequantised into --param-dtype (ZeRO++ qwZ)")
    reduce_quantization: str | None = option(
        choices=REDUCE_QUANTIZATIONS, default_text="reduce-scatter in --reduce-dtype",
        help="reduce the gradients block-quantised to int8 or int4 by a hierarchical all-to-all, inside "
             "each node of --ranks-per-node ranks, then across the nodes, into --reduce-dtype (ZeRO++ qgZ); "
             "needs --ranks-per-node")
    ranks_per_node: int | None = option(
        check="positive", metavar="N",
        help="the data-parallel ranks of one node for --reduce-quantization: consecutive groups of N ranks "
             "play the nodes (on one machine, N < --nproc emulates several); N divides the data-parallel "
             "ranks (the world size / --tp)")
    reshard_after_forward: bool | int | None = option(
        parse=reshard_value, metavar="{default,true,false,N}", check="bool_or_positive",
        default_text="fully_shard's, which is true for a block",
        help="each block's fully_shard(reshard_after_forward=...): after forward, free its unsharded "
             "parameters (true), keep them for backward (false), or keep a copy sharded over groups of "
             "N ranks (N divides the world size); the root keeps fully_shard's default")


@dataclasses.dataclass(frozen=True)
class CheckpointSection:
    """Saving and resuming the run."""

    resume: bool = option(False, help="continue from the last checkpoint in --out (any number of ranks)")
    save_every: int | None = option(help="checkpoint every N steps; one is always saved at the end",
                                    default_text="steps/4", check="positive")
    keep_checkpoints: int = option(2, help="newest checkpoints kept in --out; 0 keeps all")


@dataclasses.dataclass(frozen=True)
class EvalSection:
    """Validation during the run and the samples at its end."""

    eval_every: int | None = option(help="validation every N steps", default_text="steps/10", check="positive")
    eval_batches: int = option(4, help="global batches per validation", check="positive")
    prompt: str = option("def ", help="prompt for the final samples")
    sample_tokens: int = option(200, help="bytes sampled per continuation at the end; 0: no samples")


@dataclasses.dataclass(frozen=True)
class LoggingSection:
    """Messages and metrics: which ranks speak, where metrics go, the MFU peak."""

    log_ranks: str = option("0", metavar="0|all|R,R", help="ranks whose progress messages and notices are shown")
    tensorboard: bool = option(False, help="also log the metrics to TensorBoard in <out>/tensorboard (needs "
                                           "the tensorboard package: pip install 'flashfsdp[train]')")
    wandb: bool = option(False, help="also log the metrics to Weights & Biases (needs the wandb package; "
                                     "project from WANDB_PROJECT, default flashfsdp-train)")
    peak_tflops: float | None = option(
        metavar="TFLOPS", check="positive_number",
        default_text="the table for known GPUs; MFU is n/a on CPU without it",
        help="peak dense TFLOP/s of one device for MFU")


@dataclasses.dataclass(frozen=True)
class RunSection:
    """The run directory and the processes: workers, device, collective timeout."""

    out: str | None = option(metavar="DIR", default_text="runs/<preset>-<time>",
                             help="run directory; one run at a time uses it")
    nproc: int | None = option(help="local workers when started plainly",
                               default_text="2 on CPU, every GPU on CUDA")
    device: str = option("auto", choices=("auto", "cpu", "cuda"), help="where the workers compute")
    timeout: float = option(DEFAULT_TIMEOUT_S, metavar="SECONDS", check="positive_number",
                            check_text="a positive number of seconds",
                            help="seconds a collective waits for the other ranks before the job stops "
                                 "with an error (a hung rank)")


# The sections by name, in --help's and run.json's order: the name is the TOML table and the
# attribute of `TrainConfig` that holds the section.
SECTIONS: dict[str, type] = {
    "model": ModelSection, "data": DataSection, "training": TrainingSection, "optimizer": OptimizerSection,
    "sharding": ShardingSection, "checkpoint": CheckpointSection, "eval": EvalSection,
    "logging": LoggingSection, "run": RunSection,
}
OPTIONS: tuple[Option, ...] = tuple(opt for name, cls in SECTIONS.items() for opt in options_of(name, cls))
BY_KEY: dict[str, Option] = {opt.key: opt for opt in OPTIONS}
BY_FLAG: dict[str, Option] = {opt.flag: opt for opt in OPTIONS}


def option_named(name: str) -> Option | None:
    """The option whose flag is `--name` (written with '-' or '_': "seq_len", "seq-len"), as the
    flat keys of an older --config file or run.json name it; None if there is none."""
    return BY_FLAG.get("--" + name.replace("_", "-"))


def check_values(values: dict) -> None:
    """Check the option values that need nothing but themselves; None (unset) passes.

    Args:
        values: option values by dotted key ("training.steps"): a parsed command line, or a
            resolved config's fields.

    Raises:
        UsageError: a value out of its option's range (`option(check=...)`: a non-positive size
            or period, a negative warm-up, a non-positive or infinite timeout or --peak-tflops),
            a learning rate out of range, an invalid --log-ranks, or --reduce-quantization without
            --ranks-per-node (or the reverse, or an N not dividing --nproc / --tp; see
            `check_reduce_quantization`) (the message names the option).
    """
    check_ranges(OPTIONS, values)
    lr, min_lr = values.get("optimizer.lr"), values.get("optimizer.min_lr")
    if (lr is not None and lr <= 0) or (min_lr is not None and (min_lr < 0 or (lr is not None and min_lr > lr))):
        raise UsageError(f"--lr must be positive and --min-lr in [0, lr]; got {lr}, {min_lr}")
    if values.get("logging.log_ranks") is not None:
        check_log_ranks(values["logging.log_ranks"])
    nproc, tp = values.get("run.nproc"), values.get("sharding.tp") or 1
    check_reduce_quantization(values.get("sharding.reduce_quantization"), values.get("sharding.ranks_per_node"),
                              None if nproc is None or nproc % tp else nproc // tp)


def check_reduce_quantization(quantization: str | None, ranks_per_node: int | None, dp: int | None) -> None:
    """--reduce-quantization and --ranks-per-node come together, and N divides the `dp`
    data-parallel ranks (None: not known yet; the job checks its world size / --tp).

    Raises:
        UsageError: one given without the other, or an N that does not divide `dp` (names the
            divisors).
    """
    if quantization is None and ranks_per_node is not None:
        raise UsageError(f"--ranks-per-node {ranks_per_node} sets the nodes of --reduce-quantization; "
                         "give --reduce-quantization int8 or int4 too, or drop it")
    if quantization is not None and ranks_per_node is None:
        raise UsageError(f"--reduce-quantization {quantization} needs --ranks-per-node N, the data-parallel "
                         "ranks of one node (N = the world size: one node)")
    if quantization is not None and dp is not None and ranks_per_node > 0 and dp % ranks_per_node:
        divisors = ", ".join(str(d) for d in range(1, dp + 1) if dp % d == 0)
        raise UsageError(f"--ranks-per-node {ranks_per_node} does not divide the {dp} data-parallel rank(s) "
                         f"of --reduce-quantization; give one of {divisors}")


def check_log_ranks(spec: str) -> None:
    """--log-ranks must be "all" or comma-separated non-negative ranks.

    Raises:
        UsageError: otherwise (names the option and the accepted forms).
    """
    parts = [p.strip() for p in str(spec).split(",")]
    if str(spec).strip().lower() == "all" or (parts and all(p.isdigit() for p in parts)):
        return
    raise UsageError(f"--log-ranks {spec!r}: give 0, all, or ranks such as 0,3")
