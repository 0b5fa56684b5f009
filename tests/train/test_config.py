"""`TrainConfig`: built once from the command line, one frozen section of each kind, defaults from
the training presets, --resume keeps the saved run's model and schedule (from a sectioned run.json
or an older flat one), bad values name the option."""

import dataclasses
import json

import pytest

from flashfsdp.train.config import PRESET_TRAINING, RUN_CONFIG, TrainConfig, UsageError, load_saved_config
from flashfsdp_cli.train_sections import SECTIONS


def test_defaults_come_from_the_training_preset(tmp_path):
    config = TrainConfig.from_argv(["--preset", "small", "--device", "cpu", "--out", str(tmp_path)])
    preset, training, optimizer = PRESET_TRAINING["small"], config.training, config.optimizer
    assert (training.steps, training.batch_size, optimizer.lr) == (preset["steps"], preset["batch_size"], preset["lr"])
    assert optimizer.warmup == preset["warmup"] and optimizer.min_lr == optimizer.lr / 10
    assert optimizer.decay_steps == training.steps and config.sharding.param_dtype == "fp32"
    assert config.run.device == "cpu" and config.llama.dim == 512 and config.run.out == str(tmp_path)
    assert config.sharding.reshard_after_forward is None and config.eval.prompt == "def "
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.training.steps = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.training = None


def test_run_json_holds_the_resolved_sections(tmp_path):
    config = TrainConfig.from_argv(["--steps", "40", "--freeze", "*embed*", "--reshard-after-forward", "false",
                                    "--out", str(tmp_path), "--device", "cpu"])
    config.save()
    saved = json.loads((tmp_path / RUN_CONFIG).read_text())
    assert list(saved) == [*SECTIONS, "resumptions"] and saved["resumptions"] == []
    assert saved["training"]["steps"] == 40 and saved["optimizer"]["decay_steps"] == 40
    assert saved["model"]["freeze"] == ["*embed*"] and saved["sharding"]["reshard_after_forward"] is False
    assert saved["data"] == {"path": None, "tokenizer": None} and saved["run"]["out"] == str(tmp_path)
    assert load_saved_config(str(tmp_path)) == config


def test_resume_keeps_the_saved_schedule_and_model(tmp_path, caplog):
    TrainConfig.from_argv(["--steps", "40", "--lr", "0.01", "--layers", "2", "--out", str(tmp_path)]).save()
    resumed = TrainConfig.from_argv(["--resume", "--out", str(tmp_path), "--steps", "60", "--lr", "0.5"])
    assert (resumed.training.steps, resumed.optimizer.lr, resumed.model.layers) == (60, 0.01, 2)
    assert resumed.optimizer.decay_steps == 40
    assert "--lr 0.5 ignored on --resume" in caplog.text  # a warning of the flashfsdp logger
    record = resumed.record_resumption(10, 2)
    assert record["changed"]["training.steps"] == [40, 60] and "optimizer.lr" not in record["changed"]


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be positive"),
    (["--lr", "1e-3", "--min-lr", "1e-2"], "--min-lr in [0, lr]"),
    (["--dim", "100", "--heads", "3"], "--layers/--dim/--heads/--seq-len"),
    (["--resume"], "--resume needs --out"),
    (["--reshard-after-forward", "0"], "--reshard-after-forward must be true, false or a positive integer, got 0"),
])
def test_bad_values_name_the_option(argv, message):
    with pytest.raises(UsageError) as err:
        TrainConfig.from_argv(argv)
    assert message in str(err.value)


# A run.json as the job wrote it before the configuration had sections (its options flat, by name).
FLAT_RUN = {
    "preset": "tiny", "layers": 2, "dim": None, "heads": None, "seq_len": 32, "data": None, "seed": 3,
    "steps": 40, "batch_size": 8, "grad_accum": 1, "lr": 0.01, "min_lr": 0.001, "warmup": 4, "decay_steps": 40,
    "weight_decay": 0.1, "max_grad_norm": 1.0, "param_dtype": "fp32", "reduce_dtype": "fp32", "out": "",
    "resume": False, "eval_every": 4, "eval_batches": 4, "save_every": 10, "keep_checkpoints": 2, "nproc": 2,
    "device": "cpu", "timeout": 600.0, "prompt": "def ", "sample_tokens": 200, "all_gather_dtype": None,
    "compile": False, "init_from": None, "freeze": ["*embed*"], "log_ranks": "0", "resumptions": [],
}


def test_a_flat_run_json_still_resumes_and_is_rewritten_sectioned(tmp_path):
    from flashfsdp.train.report import estimated_memory  # noqa: PLC0415

    (tmp_path / RUN_CONFIG).write_text(json.dumps({**FLAT_RUN, "out": str(tmp_path)}))
    assert estimated_memory(str(tmp_path), 2) > 0
    resumed = TrainConfig.from_argv(["--resume", "--out", str(tmp_path), "--steps", "60", "--device", "cpu"])
    assert (resumed.model.layers, resumed.model.seq_len, resumed.training.seed) == (2, 32, 3)
    assert (resumed.training.batch_size, resumed.optimizer.lr, resumed.model.freeze) == (8, 0.01, ("*embed*",))
    assert resumed.data.tokenizer is None and not resumed.training.activation_checkpointing  # not in the file
    record = resumed.record_resumption(10, 2)
    assert record["changed"]["training.steps"] == [40, 60]
    saved = json.loads((tmp_path / RUN_CONFIG).read_text())
    assert saved["model"]["layers"] == 2 and saved["resumptions"] == [record] and "layers" not in saved


def test_a_run_json_with_an_unknown_key_is_named(tmp_path):
    (tmp_path / RUN_CONFIG).write_text(json.dumps({**FLAT_RUN, "dims": 3}))
    with pytest.raises(UsageError, match=r"run.json: unknown key 'dims'"):
        TrainConfig.from_argv(["--resume", "--out", str(tmp_path)])
    (tmp_path / RUN_CONFIG).write_text(json.dumps({"model": {"preset": 3}}))
    with pytest.raises(UsageError, match=r"run.json: key 'model.preset' must be a string"):
        TrainConfig.from_argv(["--resume", "--out", str(tmp_path)])
