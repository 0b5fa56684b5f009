"""`flashfsdp-train --config run.toml`: one table per section, keys as the options' field names, the
command line overrides the file, the resolved config is run.json; the older flat keys still load
with one deprecation line naming each key's section; bad keys and values are one line naming the
key, exit 2."""

import json
import logging

import pytest

from flashfsdp.train.cli import main
from flashfsdp.train.config import RUN_CONFIG, TrainConfig, UsageError

SECTIONED = """
[model]
preset = "tiny"
seq-len = 64
freeze = ["*embed*", "layers.0.*"]
[training]
batch_size = 8
steps = 30
activation_checkpointing = true
[optimizer]
lr = 1
[sharding]
param_dtype = "float16"
reshard_after_forward = false
[data]
path = "corpus.txt"
"""


def _toml(tmp_path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_section_values_are_used_and_the_command_line_overrides_them(tmp_path, caplog):
    argv = ["--config", _toml(tmp_path, SECTIONED), "--steps", "12", "--out", str(tmp_path / "run")]
    with caplog.at_level(logging.WARNING, logger="flashfsdp"):
        config = TrainConfig.from_argv(argv + ["--freeze", "output.*"])
    assert not caplog.records  # no deprecation notice for a sectioned file
    assert (config.model.seq_len, config.training.batch_size, config.sharding.param_dtype) == (64, 8, "fp16")
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)
    assert config.training.activation_checkpointing and config.sharding.reshard_after_forward is False
    assert config.training.steps == 12 and config.optimizer.decay_steps == 12  # the flag wins over the file
    assert config.model.freeze == ("output.*",)  # a repeatable flag replaces the file's list
    assert config.data.path.endswith("corpus.txt")
    assert TrainConfig.from_argv(argv).model.freeze == ("*embed*", "layers.0.*")
    config.save()
    saved = json.loads((tmp_path / "run" / RUN_CONFIG).read_text())
    assert saved["model"]["seq_len"] == 64 and saved["training"]["steps"] == 12 and "config" not in saved


def test_flat_keys_still_load_with_one_deprecation_line(tmp_path, caplog):
    path = _toml(tmp_path, 'preset = "tiny"\nseq-len = 64\nbatch_size = 8\nlr = 1\ndata = "corpus.txt"\n'
                           'param-dtype = "float16"\nactivation-checkpointing = true\nsteps = 30\n')
    with caplog.at_level(logging.WARNING, logger="flashfsdp"):
        config = TrainConfig.from_argv(["--config", path, "--steps", "12", "--out", str(tmp_path / "run")])
    assert (config.model.seq_len, config.training.batch_size, config.sharding.param_dtype) == (64, 8, "fp16")
    assert config.training.activation_checkpointing and config.training.steps == 12
    assert config.data.path.endswith("corpus.txt")
    (notice,) = [r.getMessage() for r in caplog.records]
    assert notice.startswith(f"--config {path}: top-level keys are deprecated;") and "\n" not in notice
    for moved in ("seq-len -> model.seq_len", "data -> data.path", "steps -> training.steps"):
        assert moved in notice
    with caplog.at_level(logging.WARNING, logger="flashfsdp"):
        caplog.clear()
        TrainConfig.from_argv(["--config", path, "--out", str(tmp_path / "run")], warn=False)
    assert not caplog.records  # the launcher's own workers do not repeat it


@pytest.mark.parametrize("text, message", [
    ("stpes = 3\n", "unknown key 'stpes'; write each option in the table of its --help group"),
    ("config = 'other.toml'\n", "unknown key 'config'"),
    ("[modle]\nlayers = 2\n", "unknown section [modle]; the sections are model, data, training"),
    ("[model]\nlayerz = 2\n", "unknown key 'model.layerz'; the keys of [model] are preset, layers, dim"),
    ("[training]\nlr = 1.0\n", "unknown key 'training.lr'; the keys of [training] are steps"),
    ("model = 3\n", "key 'model' must be a table: write its options under [model]"),
    ("steps = 3\n[training]\nsteps = 4\n", "training.steps is set twice (key 'training.steps')"),
    ("steps = 'ten'\n", "key 'steps' must be an integer, got 'ten' (str)"),
    ("[training]\nsteps = 'ten'\n", "key 'training.steps' must be an integer, got 'ten' (str)"),
    ("[training]\nsteps = 2.5\n", "key 'training.steps' must be an integer"),
    ("steps = true\n", "key 'steps' must be an integer"),
    ("[optimizer]\nlr = '1e-3'\n", "key 'optimizer.lr' must be a number"),
    ("[checkpoint]\nresume = 1\n", "key 'checkpoint.resume' must be true or false"),
    ("[model]\npreset = 'huge'\n", "key 'model.preset' must be one of 1b, small, tiny"),
    ("[model]\nfreeze = [1]\n", "key 'model.freeze' must be a string or an array of strings"),
    ("[sharding]\nparam_dtype = 'fp8'\n", "key 'sharding.param_dtype' must be one of bf16, fp16, fp32"),
    ("[sharding]\nreshard_after_forward = 1.5\n", "key 'sharding.reshard_after_forward' must be true, false or an"),
    ("[sharding]\nreshard_after_forward = 'some'\n", "key 'sharding.reshard_after_forward': give true, false"),
    ("steps = \n", "not valid TOML"),
])
def test_bad_file_input_names_the_key(tmp_path, text, message):
    with pytest.raises(UsageError) as err:
        TrainConfig.from_argv(["--config", _toml(tmp_path, text), "--out", str(tmp_path / "run")])
    assert message in str(err.value) and str(tmp_path / "run.toml") in str(err.value)


@pytest.mark.parametrize("text, message", [
    ("[training]\nsteps = 0\n", "--steps must be positive, got 0"),
    ("[sharding]\nreshard_after_forward = 0\n", "--reshard-after-forward must be true, false or a positive integer"),
    ("[logging]\nlog_ranks = 'some'\n", "--log-ranks 'some': give 0, all"),
])
def test_file_values_out_of_range_name_the_option(tmp_path, text, message):
    with pytest.raises(UsageError, match="^" + message.replace("[", r"\[").replace("(", r"\(")):
        TrainConfig.from_argv(["--config", _toml(tmp_path, text), "--out", str(tmp_path / "run")])


@pytest.mark.parametrize("text, value", [("true", True), ("false", False), ("2", 2), ("'default'", None),
                                         ("'false'", False)])
def test_reshard_after_forward_in_a_file(tmp_path, text, value):
    path = _toml(tmp_path, f"[sharding]\nreshard_after_forward = {text}\n")
    got = TrainConfig.from_argv(["--config", path, "--out", str(tmp_path / "run")]).sharding.reshard_after_forward
    assert got == value and type(got) is type(value)


def test_a_bad_file_is_one_line_and_exit_code_2(tmp_path, capsys):
    path = _toml(tmp_path, "[model]\ndims = 64\n")
    assert main(["--config", path, "--out", str(tmp_path / "run"), "--device", "cpu"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"flashfsdp-train: error: --config {path}: unknown key 'model.dims'; the keys of [model] are "
                     "preset, layers, dim, heads, seq_len, init_from, freeze"]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("text, message", [
    ("[model]\ndims = 64\n", "unknown key 'model.dims'"),
    ("[training]\nsteps = 'many'\n", "training.steps"),
    ("[training]\nsteps = 0\n", "--steps must be positive, got 0"),
    ("[model\n", "not valid TOML"),
])
def test_a_bad_file_is_refused_before_torch_is_imported(tmp_path, text, message):
    """`flashfsdp-train --config FILE` reads and checks the file in its torch-free front: one line,
    exit 2, torch never imported (the time this saves is `python -m benchmarks.cli_timing`'s)."""
    from tests.test_cli import _entry  # noqa: PLC0415

    done = _entry("--config", _toml(tmp_path, text), "--out", str(tmp_path / "run"))
    assert done.stdout.strip() == "torch imported: False code: 2", done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flashfsdp-train: error: ") and message in lines[0], lines


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(UsageError, match=r"--config .*nope.toml: cannot read it"):
        TrainConfig.from_argv(["--config", str(tmp_path / "nope.toml")])


def test_decay_steps_is_an_option(tmp_path):
    config = TrainConfig.from_argv(["--steps", "10", "--decay-steps", "40", "--out", str(tmp_path)])
    assert config.optimizer.decay_steps == 40
    with pytest.raises(UsageError, match="--decay-steps must be positive"):
        TrainConfig.from_argv(["--decay-steps", "0", "--out", str(tmp_path)])
