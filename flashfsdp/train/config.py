"""The configuration of a `flashfsdp-train` run: the command line, training presets, `TrainConfig`.

`TrainConfig.from_argv` parses the command line (argparse) once and returns a typed, frozen
`TrainConfig`; every other module of `flashfsdp.train` receives that config (or the fields it
needs), never the argparse namespace. Options left unset on the command line are filled from
`PRESET_TRAINING` (and, on `--resume`, from the run's saved `run.json`, so a resumed run keeps
its model, data order and learning-rate schedule whatever the number of ranks).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch

from flashfsdp.log import get_logger
from flashfsdp.models import LlamaConfig, config_from_preset
from flashfsdp.train.config_file import file_defaults
from flashfsdp.train.errors import UsageError
from flashfsdp.train.hf_config import llama_config
from flashfsdp.train.loggers import check_installed
from flashfsdp.train.tokenizer import tokenizer_vocab_size
from flashfsdp_cli.train_options import (  # noqa: F401 - the parser's names, also used from here
    DEFAULT_TIMEOUT_S, DTYPE_ALIASES, DTYPE_NAMES, PRESET_TRAINING, PROG, Parser, build_parser, check_values)

_log = get_logger(__name__)
# The one-line-error parser under its earlier name.
_Parser = Parser

RUN_CONFIG = "run.json"
# The key of run.json that lists the run's resumptions (`TrainConfig.save`); not a config field.
RESUMPTIONS = "resumptions"

# Options that fix the model, the data order and the learning-rate schedule: on --resume they
# come from the run's saved config (an explicit different value is ignored with a warning).
RESUME_FIXED = ("preset", "layers", "dim", "heads", "seq_len", "data", "tokenizer", "seed", "batch_size",
                "lr", "min_lr", "warmup", "decay_steps", "weight_decay", "max_grad_norm", "init_from",
                "freeze")
# Model-shape overrides that --init-from's config.json decides instead.
_SHAPE_OPTIONS = ("layers", "dim", "heads")


def resolve_device(requested: str) -> str:
    """"cpu" or "cuda" for --device auto|cpu|cuda.

    Raises:
        UsageError: --device cuda on a machine without a usable CUDA device.
    """
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available; use --device cpu")
    return requested


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Every setting of one `flashfsdp-train` run, resolved (no option left unset but the model
    overrides). Built once by `from_argv`; saved as `<out>/run.json` by `save`.

    Attributes (command-line option in brackets):
        preset: model size, a key of `flashfsdp.models.PRESETS` [--preset].
        layers, dim, heads, seq_len: overrides of the preset's blocks, width, attention heads and
            sequence length in bytes, or None for the preset's [--layers --dim --heads --seq-len].
        data: absolute path of a text file or directory, or None for the standard library [--data].
        tokenizer: absolute path of a `tokenizers` tokenizer.json, or None for UTF-8 bytes; the
            model's vocabulary is its vocabulary size [--tokenizer].
        seed: model init and data order [--seed].
        steps: optimizer steps to reach [--steps].
        batch_size: global batch in sequences, over all ranks [--batch-size].
        grad_accum: micro-batches per step [--grad-accum].
        lr, min_lr: peak and final learning rate [--lr --min-lr].
        warmup: linear warm-up steps [--warmup].
        decay_steps: step at which the cosine decay reaches min_lr [--decay-steps] (default:
            the first run's --steps).
        weight_decay: AdamW decay of the matrices [--weight-decay].
        max_grad_norm: global gradient-norm clip; 0 only measures it [--max-grad-norm].
        param_dtype, reduce_dtype: "bf16", "fp16" or "fp32": compute dtype of unsharded
            parameters and dtype of the gradient reduce-scatter [--param-dtype --reduce-dtype];
            fp16 in either trains with dynamic loss scaling (`flashfsdp.ShardedGradScaler`).
        out: absolute path of the run directory [--out].
        resume: continue from the newest checkpoint in `out` [--resume].
        eval_every, eval_batches: validation period in steps, global batches per validation.
        save_every: checkpoint period in steps [--save-every].
        keep_checkpoints: newest checkpoints kept; 0 keeps all [--keep-checkpoints].
        nproc: local workers when started plainly, or None for the default [--nproc].
        device: "cpu" or "cuda" (resolved from --device auto|cpu|cuda).
        timeout: seconds a collective waits for the other ranks before it raises, the process
            group's timeout (`torch.distributed.init_process_group(timeout=...)`) [--timeout].
        prompt, sample_tokens: prompt and bytes per continuation of the final samples.
        activation_checkpointing: recompute each block's activations in backward
            [--activation-checkpointing].
        tensorboard, wandb: also log metrics to TensorBoard / Weights & Biases on rank 0.
        peak_tflops: peak dense TFLOP/s of one device for MFU, or None for the table of
            `flashfsdp.train.flops` [--peak-tflops].
        init_from: absolute path of a transformers LlamaForCausalLM folder whose shape, weights
            and tokenizer the run starts from, or None [--init-from].
        freeze: glob patterns of the parameters left out of training [--freeze].
        log_ranks: the ranks whose messages are shown: "0", "all" or "0,3" [--log-ranks].

    Raises:
        UsageError: a non-positive size, a learning rate out of range, an unknown preset or
            dtype, or model overrides that make an invalid model (the message names the option).
    """

    preset: str
    layers: int | None
    dim: int | None
    heads: int | None
    seq_len: int | None
    data: str | None
    seed: int
    steps: int
    batch_size: int
    grad_accum: int
    lr: float
    min_lr: float
    warmup: int
    decay_steps: int
    weight_decay: float
    max_grad_norm: float
    param_dtype: str
    reduce_dtype: str
    out: str
    resume: bool
    eval_every: int
    eval_batches: int
    save_every: int
    keep_checkpoints: int
    nproc: int | None
    device: str
    timeout: float
    prompt: str
    sample_tokens: int
    # Defaults from here on: a run.json saved before these options existed still loads.
    tokenizer: str | None = None
    activation_checkpointing: bool = False
    tensorboard: bool = False
    wandb: bool = False
    peak_tflops: float | None = None
    all_gather_dtype: str | None = None  # "int8": quantised all-gathers [--all-gather-dtype]
    compile: bool = False  # torch.compile each block after sharding [--compile]
    init_from: str | None = None
    freeze: tuple[str, ...] = ()
    log_ranks: str = "0"

    def __post_init__(self) -> None:
        object.__setattr__(self, "freeze", tuple(self.freeze or ()))  # run.json holds a list
        _check_preset(self.preset)
        for name in ("param_dtype", "reduce_dtype"):
            if getattr(self, name) not in DTYPE_NAMES:
                raise UsageError(f"--{name.replace('_', '-')} must be one of {DTYPE_NAMES}, "
                                 f"got {getattr(self, name)!r}")
        if self.device not in ("cpu", "cuda"):
            raise UsageError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        check_values(dataclasses.asdict(self))
        check_installed(self.tensorboard, self.wandb)
        if self.init_from is not None:
            given = [f"--{name}" for name in _SHAPE_OPTIONS if getattr(self, name) is not None]
            if given:
                raise UsageError(f"{'/'.join(given)} with --init-from: the model's shape is the one in "
                                 f"{self.init_from}/config.json; leave {'/'.join(given)} out")
        _ = self.model  # raises UsageError on invalid model overrides

    @property
    def model(self) -> LlamaConfig:
        """The `LlamaConfig`: the preset with --layers/--dim/--heads/--seq-len applied.

        Raises:
            UsageError: the overrides make an invalid model (the message names the fields).
        """
        if self.init_from is not None:
            return _pretrained_model(self.init_from, self.seq_len, self.tokenizer)
        vocab = {} if self.tokenizer is None else {"vocab_size": tokenizer_vocab_size(self.tokenizer)}
        try:
            return config_from_preset(self.preset, n_layers=self.layers, dim=self.dim,
                                      n_heads=self.heads, max_seq_len=self.seq_len, **vocab)
        except ValueError as err:
            raise UsageError(f"--layers/--dim/--heads/--seq-len: {err}") from None

    @property
    def model_flags(self) -> str:
        """The model options as typed on the command line, e.g. "--preset tiny --layers 2"."""
        if self.init_from is not None:
            return f"--init-from {self.init_from}" + (f" --seq-len {self.seq_len}" if self.seq_len else "")
        overrides = (("layers", self.layers), ("dim", self.dim), ("heads", self.heads),
                     ("seq-len", self.seq_len))
        return f"--preset {self.preset}" + "".join(f" --{k} {v}" for k, v in overrides if v is not None)

    @classmethod
    def from_argv(cls, argv: list[str], *, warn: bool = True) -> TrainConfig:
        """Parse the `flashfsdp-train` command line and resolve every unset option.

        Unset options come from the saved run config on --resume, else from the preset's
        `PRESET_TRAINING` and the documented defaults; --data and --out become absolute paths.

        Args:
            argv: the arguments after the program name.
            warn: print a warning on stderr for each explicit option that --resume overrides.

        Raises:
            SystemExit: (code 2) an unknown option or a malformed value, from argparse.
            UsageError: --device cuda without CUDA; --resume without --out or without a saved
                run; any error of `TrainConfig` itself.
        """
        values = vars(_parse(argv))
        values["device"] = resolve_device(values["device"])
        if values["resume"]:
            _take_saved(values, warn)
        _fill_defaults(values)
        return cls(**values)

    def save(self, resumptions: list[dict] | None = None) -> None:
        """Write the config to `<out>/run.json` (read back by `--resume`), atomically, with the
        list of the run's resumptions under "resumptions" (see `record_resumption`)."""
        os.makedirs(self.out, exist_ok=True)
        tmp = os.path.join(self.out, RUN_CONFIG + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump({**dataclasses.asdict(self), RESUMPTIONS: list(resumptions or [])}, fh,
                      indent=1, sort_keys=True)
        os.replace(tmp, os.path.join(self.out, RUN_CONFIG))

    def record_resumption(self, step: int, world_size: int) -> dict:
        """Append this resumption to `<out>/run.json` and save this config there: the step it
        starts from, its ranks, the time, and each option whose value changed ({option: [before,
        after]}, e.g. --steps or --nproc). Call on one rank.

        Returns:
            The record appended.
        """
        saved, resumptions = load_run_file(self.out)
        now = dataclasses.asdict(self)
        changed = {key: [saved.get(key), value] for key, value in now.items()
                   if key != "resume" and saved.get(key) != (list(value) if isinstance(value, tuple) else value)}
        record = {"step": step, "world_size": world_size, "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                  "changed": changed}
        self.save(resumptions + [record])
        return record


def _parse(argv: list[str]) -> argparse.Namespace:
    """Parse `argv`, the values of a --config file as defaults (see `config_file`)."""
    parser = build_parser()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config")
    path = pre.parse_known_args(argv)[0].config
    if path is not None:
        parser.set_defaults(**file_defaults(parser, path))
    args = parser.parse_args(argv)
    del args.config  # its values are in the others; run.json holds the resolved config
    return args


def _check_preset(name: str) -> None:
    if name not in PRESET_TRAINING:
        raise UsageError(f"--preset {name!r}: choose one of {', '.join(PRESET_TRAINING)}")


def load_run_file(out: str) -> tuple[dict, list[dict]]:
    """(the saved config's fields, the resumptions) of `<out>/run.json`.

    Raises:
        FileNotFoundError: there is no run.json in `out`.
        ValueError: it is not valid JSON.
    """
    with open(os.path.join(out, RUN_CONFIG), encoding="utf-8") as fh:
        saved = json.load(fh)
    resumptions = saved.pop(RESUMPTIONS, [])
    return saved, resumptions


def load_saved_config(out: str) -> TrainConfig:
    """The `TrainConfig` saved in `<out>/run.json` (see `load_run_file` for the errors)."""
    return TrainConfig(**load_run_file(out)[0])


def _pretrained_model(folder: str, seq_len: int | None, tokenizer: str | None) -> LlamaConfig:
    """The `LlamaConfig` of --init-from `folder`, checked against the tokenizer's vocabulary."""
    config = llama_config(folder, seq_len)
    vocab = tokenizer_vocab_size(tokenizer)
    if vocab > config.vocab_size:
        raise UsageError(f"--init-from {folder}: the tokenizer's {vocab} ids do not fit the model's "
                         f"vocab_size {config.vocab_size}; give the model's own tokenizer (--tokenizer)")
    return config


def _saved_config(out: str) -> dict:
    try:
        return load_run_file(out)[0]
    except FileNotFoundError:
        raise UsageError(
            f"--resume: {out} is not a {PROG} run directory (no {RUN_CONFIG}); "
            "point --out at an earlier run's directory or start without --resume"
        ) from None


def _take_saved(values: dict, warn: bool) -> None:
    """On --resume: the `RESUME_FIXED` options (and --steps, if unset) from the saved run."""
    if not values["out"]:
        raise UsageError("--resume needs --out DIR, the directory of the run to continue")
    saved = _saved_config(values["out"])
    for key in RESUME_FIXED:
        given = values.get(key)
        if warn and given is not None and given != saved.get(key):
            _log.warning("--%s %s ignored on --resume; the run's value %s is kept",
                         key.replace("_", "-"), given, saved.get(key))
        values[key] = saved.get(key)
    if values["steps"] is None:
        values["steps"] = saved["steps"]


def _fill_defaults(values: dict) -> None:
    """Fill the options still None from the preset and the documented defaults (in place)."""
    def default(name, value):
        """Set `values[name]` to `value` if it is None."""
        if values.get(name) is None:
            values[name] = value

    default("preset", "tiny")
    _check_preset(values["preset"])
    preset = PRESET_TRAINING[values["preset"]]
    default("steps", preset["steps"])
    default("batch_size", preset["batch_size"])
    default("lr", preset["lr"])
    default("warmup", min(preset["warmup"], max(1, values["steps"] // 10)))
    default("seed", 0)
    default("min_lr", values["lr"] / 10)
    default("decay_steps", values["steps"])
    default("weight_decay", 0.1)
    default("max_grad_norm", 1.0)
    default("param_dtype", "bf16" if values["device"] == "cuda" else "fp32")
    default("eval_every", max(1, values["steps"] // 10))
    default("save_every", max(1, values["steps"] // 4))
    values["freeze"] = tuple(values["freeze"] or ())
    for path in ("data", "tokenizer", "init_from"):
        if values[path] is not None:
            values[path] = os.path.abspath(values[path])
    if values["init_from"] is not None and values["tokenizer"] is None:
        beside = os.path.join(values["init_from"], "tokenizer.json")
        values["tokenizer"] = beside if os.path.isfile(beside) else None
    if values["out"] is None:
        values["out"] = os.path.join("runs", f"{values['preset']}-{time.strftime('%Y%m%d-%H%M%S')}")
    values["out"] = os.path.abspath(values["out"])
