"""`TrainConfig`: built once from the command line, frozen, defaults from the training presets,
--resume keeps the saved run's model and schedule, bad values name the option."""

import dataclasses
import json

import pytest

from flashfsdp.train.config import PRESET_TRAINING, RUN_CONFIG, TrainConfig, UsageError


def test_defaults_come_from_the_training_preset(tmp_path):
    config = TrainConfig.from_argv(["--preset", "small", "--device", "cpu", "--out", str(tmp_path)])
    preset = PRESET_TRAINING["small"]
    assert (config.steps, config.batch_size, config.lr) == (preset["steps"], preset["batch_size"], preset["lr"])
    assert config.warmup == preset["warmup"] and config.min_lr == config.lr / 10
    assert config.decay_steps == config.steps and config.param_dtype == "fp32" and config.device == "cpu"
    assert config.model.dim == 512 and config.out == str(tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.steps = 1


def test_resume_keeps_the_saved_schedule_and_model(tmp_path, caplog):
    TrainConfig.from_argv(["--steps", "40", "--lr", "0.01", "--layers", "2", "--out", str(tmp_path)]).save()
    assert json.loads((tmp_path / RUN_CONFIG).read_text())["decay_steps"] == 40
    resumed = TrainConfig.from_argv(["--resume", "--out", str(tmp_path), "--steps", "60", "--lr", "0.5"])
    assert (resumed.steps, resumed.lr, resumed.layers, resumed.decay_steps) == (60, 0.01, 2, 40)
    assert "--lr 0.5 ignored on --resume" in caplog.text  # a warning of the flashfsdp logger


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be positive"),
    (["--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr in [0, lr]"),
    (["--dim", "100", "--heads", "3"], "--layers/--dim/--heads/--seq-len"),
    (["--resume"], "--resume needs --out"),
])
def test_bad_values_name_the_option(argv, message):
    with pytest.raises(UsageError) as err:
        TrainConfig.from_argv(argv)
    assert message in str(err.value)


def test_a_run_config_saved_before_the_newer_options_still_loads(tmp_path):
    from flashfsdp.train.report import estimated_memory  # noqa: PLC0415

    TrainConfig.from_argv(["--out", str(tmp_path), "--device", "cpu"]).save()
    saved = json.loads((tmp_path / RUN_CONFIG).read_text())
    for newer in ("tokenizer", "activation_checkpointing", "tensorboard", "wandb", "peak_tflops"):
        del saved[newer]
    (tmp_path / RUN_CONFIG).write_text(json.dumps(saved))
    assert estimated_memory(str(tmp_path), 2) > 0
    resumed = TrainConfig.from_argv(["--resume", "--out", str(tmp_path), "--device", "cpu"])
    assert resumed.tokenizer is None and not resumed.activation_checkpointing
