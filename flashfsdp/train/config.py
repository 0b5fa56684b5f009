"""The configuration of a `flashfsdp-train` run: `TrainConfig`, one frozen section of each kind.

The sections (`flashfsdp_cli.train_sections`: model, data, training, optimizer, sharding,
checkpoint, eval, logging, run) are typed frozen dataclasses whose fields are at once the
command-line options and the keys of a `--config` TOML file. `TrainConfig.from_argv` parses the
command line once (the file's values under it), resolves every unset option and returns the
config; every other module of `flashfsdp.train` receives it (or the sections it needs), never
the argparse namespace. Options left unset are filled from `PRESET_TRAINING` and the fields'
defaults, and on `--resume` from the run's saved `run.json` (`flashfsdp.train.run_file`), so a
resumed run keeps its model, data order and learning-rate schedule whatever the number of ranks.
Dtypes stay names here; `TrainConfig.precision` parses them once (`flashfsdp.train.precision`).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time

import torch

from flashfsdp.log import get_logger
from flashfsdp.models import LlamaConfig, config_from_preset
from flashfsdp.models.tp_plan import check_tp_degree
from flashfsdp.train.config_file import file_values
from flashfsdp.train.errors import UsageError
from flashfsdp.train.hf_config import llama_config
from flashfsdp.train.loggers import check_installed
from flashfsdp.train.precision import Precision
from flashfsdp.train.pretrained import lm_head_differs, untied_warning
from flashfsdp.train.run_file import RESUMPTIONS, RUN_CONFIG, load_run_file, write_run_file  # noqa: F401
from flashfsdp.train.tokenizer import tokenizer_vocab_size
from flashfsdp_cli.config_fields import build_sections
from flashfsdp_cli.train_options import (  # noqa: F401 - the parser's names, also used from here
    DEFAULT_TIMEOUT_S, DTYPE_ALIASES, DTYPE_NAMES, PRESET_TRAINING, PROG, RUNS, Parser, build_parser, parse_options)
from flashfsdp_cli.train_sections import (
    OPTIONS, SECTIONS, CheckpointSection, DataSection, EvalSection, LoggingSection, ModelSection, OptimizerSection,
    RunSection, ShardingSection, TrainingSection, check_values)

_log = get_logger(__name__)

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
    """Every setting of one `flashfsdp-train` run, resolved (no option left unset but those whose
    None means something: the model overrides, --data, --tokenizer, ...), one section of each
    kind; its fields are documented by the options' help (`flashfsdp-train --help`). Built once
    by `from_argv`; saved as `<out>/run.json` by `save`. `run.device` is "cpu" or "cuda".

    Raises:
        UsageError: a non-positive size, a learning rate out of range, an unknown preset or
            dtype, a metrics sink that is not installed, model overrides with --init-from or that
            make an invalid model, a --tp that does not divide the model's heads, key/value heads
            or feed-forward width (the message names the option).
    """

    model: ModelSection
    data: DataSection
    training: TrainingSection
    optimizer: OptimizerSection
    sharding: ShardingSection
    checkpoint: CheckpointSection
    eval: EvalSection
    logging: LoggingSection
    run: RunSection

    def __post_init__(self) -> None:
        _check_preset(self.model.preset)
        if self.run.device not in ("cpu", "cuda"):
            raise UsageError(f"device must be 'cpu' or 'cuda', got {self.run.device!r}")
        check_values(self.values())
        check_installed(self.logging.tensorboard, self.logging.wandb)
        if self.model.init_from is not None:
            given = [f"--{name}" for name in _SHAPE_OPTIONS if getattr(self.model, name) is not None]
            if given:
                raise UsageError(f"{'/'.join(given)} with --init-from: the model's shape is the one in "
                                 f"{self.model.init_from}/config.json; leave {'/'.join(given)} out")
        try:  # the model (raises UsageError on invalid overrides) must split over the TP ranks
            check_tp_degree(self.llama, self.sharding.tp, "--tp")
        except ValueError as err:
            raise UsageError(str(err)) from None

    @classmethod
    def from_values(cls, values: dict) -> TrainConfig:
        """The config of resolved option values by dotted key ("training.steps"); a key left
        out takes its field's default."""
        return cls(**build_sections(SECTIONS, values))

    def values(self) -> dict:
        """The option values by dotted key ("model.seq_len": 256, ...)."""
        return {f"{name}.{field}": value for name in SECTIONS
                for field, value in dataclasses.asdict(getattr(self, name)).items()}

    def sections(self) -> dict[str, dict]:
        """{section: {key: value}}, as run.json and a --config file hold them."""
        return {name: dataclasses.asdict(getattr(self, name)) for name in SECTIONS}

    @functools.cached_property
    def llama(self) -> LlamaConfig:
        """The model's `LlamaConfig`: the preset with --layers/--dim/--heads/--seq-len applied and
        the tokenizer's vocabulary, or --init-from's config.json.

        Raises:
            UsageError: the overrides make an invalid model (the message names the fields).
        """
        m, tokenizer = self.model, self.data.tokenizer
        if m.init_from is not None:
            return _pretrained_model(m.init_from, m.seq_len, tokenizer)
        vocab = {} if tokenizer is None else {"vocab_size": tokenizer_vocab_size(tokenizer)}
        try:
            return config_from_preset(m.preset, n_layers=m.layers, dim=m.dim, n_heads=m.heads,
                                      max_seq_len=m.seq_len, **vocab)
        except ValueError as err:
            raise UsageError(f"--layers/--dim/--heads/--seq-len: {err}") from None

    @functools.cached_property
    def precision(self) -> Precision:
        """The `[sharding]` dtypes parsed into torch dtypes, with the run's `MixedPrecisionPolicy`
        (`Precision.policy`): the one place the job turns dtype names into dtypes."""
        s = self.sharding
        return Precision.from_names(s.param_dtype, s.reduce_dtype, s.all_gather_dtype, s.reduce_quantization,
                                    s.ranks_per_node)

    @property
    def model_flags(self) -> str:
        """The model options as typed on the command line, e.g. "--preset tiny --layers 2"."""
        return self.model.flags

    def with_out(self, out: str) -> TrainConfig:
        """This config with the run directory `out`."""
        return dataclasses.replace(self, run=dataclasses.replace(self.run, out=out))

    @classmethod
    def from_argv(cls, argv: list[str], *, warn: bool = True) -> TrainConfig:
        """Parse the `flashfsdp-train` command line and resolve every unset option.

        A --config file's values stand where the command line gives none; unset options come
        from the saved run config on --resume (see `option(resume=...)`), else from the preset's
        `PRESET_TRAINING` and the fields' defaults; paths become absolute.

        Args:
            argv: the arguments after the program name.
            warn: log a warning for each explicit option that --resume overrides, and the
                deprecation notice of a --config file's flat keys.

        Raises:
            SystemExit: (code 2) an unknown option or a malformed value, from argparse.
            UsageError: a bad --config file; --device cuda without CUDA; --resume without --out
                or without a saved run; any error of `TrainConfig` itself.
        """
        path, values = parse_options(argv)
        values = file_values(values, path, warn=warn)
        values["run.device"] = resolve_device(values["run.device"] or "auto")
        if values["checkpoint.resume"]:
            _take_saved(values, warn)
        _fill_defaults(values)
        config = cls.from_values(values)
        folder = config.model.init_from
        if warn and folder is not None and llama_config(folder).tie_embeddings and lm_head_differs(folder):
            _log.warning(untied_warning(folder))
        return config

    def save(self, resumptions: list[dict] | None = None) -> None:
        """Write the config to `<out>/run.json` (read back by `--resume`), atomically, with the
        list of the run's resumptions under "resumptions" (see `record_resumption`)."""
        write_run_file(self.run.out, self.sections(), list(resumptions or []))

    def record_resumption(self, step: int, world_size: int) -> dict:
        """Append this resumption to `<out>/run.json` and save this config there: the step it
        starts from, its ranks, the time, and each option whose value changed ({dotted key:
        [before, after]}, e.g. training.steps or run.nproc). Call on one rank.

        Returns:
            The record appended.
        """
        saved, resumptions = load_run_file(self.run.out)
        changed = {key: [_jsonable(saved.get(key)), _jsonable(value)] for key, value in self.values().items()
                   if key != "checkpoint.resume" and saved.get(key) != value}
        record = {"step": step, "world_size": world_size, "time": time.strftime("%Y-%m-%d %H:%M:%S %z"),
                  "changed": changed}
        self.save(resumptions + [record])
        return record


def _jsonable(value):
    """A tuple as a list (run.json's form of --freeze); other values as they are."""
    return list(value) if isinstance(value, tuple) else value


def _check_preset(name: str) -> None:
    if name not in PRESET_TRAINING:
        raise UsageError(f"--preset {name!r}: choose one of {', '.join(PRESET_TRAINING)}")


def load_saved_config(out: str) -> TrainConfig:
    """The `TrainConfig` saved in `<out>/run.json`, sectioned or flat (see `load_run_file` for
    the errors)."""
    return TrainConfig.from_values(load_run_file(out)[0])


def _pretrained_model(folder: str, seq_len: int | None, tokenizer: str | None) -> LlamaConfig:
    """The `LlamaConfig` of --init-from `folder`, checked against the tokenizer's vocabulary; a
    tied config.json whose weights hold a different lm_head is untied, as transformers does
    (`flashfsdp.train.pretrained.lm_head_differs`; `from_argv` warns)."""
    config = llama_config(folder, seq_len)
    if config.tie_embeddings and lm_head_differs(folder):
        config = dataclasses.replace(config, tie_embeddings=False)
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
    """On --resume: the options of `option(resume="keep")` from the saved run (an explicit
    different value is ignored, with a warning), those of `resume="default"` when unset."""
    if not values["run.out"]:
        raise UsageError("--resume needs --out DIR, the directory of the run to continue")
    saved = _saved_config(values["run.out"])
    for opt in OPTIONS:
        given = values.get(opt.key)
        if opt.resume == "keep":
            kept = saved.get(opt.key)
            if warn and given is not None and _jsonable(given) != _jsonable(kept):
                _log.warning("%s %s ignored on --resume; the run's value %s is kept", opt.flag, given, kept)
            values[opt.key] = kept
        elif opt.resume == "default" and given is None:
            values[opt.key] = saved.get(opt.key)


def _fill_defaults(values: dict) -> None:
    """Fill the options still None (in place): first the fields' own defaults, then those that
    depend on the preset, the other options or the device; paths made absolute."""
    for opt in OPTIONS:
        if values.get(opt.key) is None:
            values[opt.key] = opt.default
    _check_preset(values["model.preset"])
    preset = PRESET_TRAINING[values["model.preset"]]

    def default(key, value):
        """Set `values[key]` to `value` if it is None."""
        if values.get(key) is None:
            values[key] = value

    default("training.steps", preset["steps"])
    steps = values["training.steps"]
    default("training.batch_size", preset["batch_size"])
    default("optimizer.lr", preset["lr"])
    default("optimizer.warmup", min(preset["warmup"], max(1, steps // 10)))
    default("optimizer.min_lr", values["optimizer.lr"] / 10)
    default("optimizer.decay_steps", steps)
    default("sharding.param_dtype", "bf16" if values["run.device"] == "cuda" else "fp32")
    default("eval.eval_every", max(1, steps // 10))
    default("checkpoint.save_every", max(1, steps // 4))
    values["model.freeze"] = tuple(values["model.freeze"] or ())
    for key in ("data.path", "data.tokenizer", "model.init_from"):
        if values[key] is not None:
            values[key] = os.path.abspath(values[key])
    if values["model.init_from"] is not None and values["data.tokenizer"] is None:
        beside = os.path.join(values["model.init_from"], "tokenizer.json")
        values["data.tokenizer"] = beside if os.path.isfile(beside) else None
    default("run.out", os.path.join(RUNS, f"{values['model.preset']}-{time.strftime('%Y%m%d-%H%M%S')}"))
    values["run.out"] = os.path.abspath(values["run.out"])
