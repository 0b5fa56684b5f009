"""The `[sharding]` section at work: the dtype names parsed once into the whole
`MixedPrecisionPolicy`, and --reshard-after-forward from the command line to each block's
`fully_shard`, checked against the world size before any worker starts."""

from __future__ import annotations

import pytest
import torch

from flashfsdp.models import Llama, LlamaConfig
from flashfsdp.train import sharding
from flashfsdp.train.checks import check_reshard_after_forward
from flashfsdp.train.config import TrainConfig, UsageError
from flashfsdp.train.precision import Precision
from tests.harness import run_distributed
from tests.train.trainers import corpus_text, make_trainer


def test_the_policy_holds_every_dtype_of_the_section(tmp_path):
    config = TrainConfig.from_argv(["--param-dtype", "bfloat16", "--reduce-dtype", "float32", "--all-gather-dtype",
                                    "int8", "--out", str(tmp_path), "--device", "cpu"])
    assert config.precision == Precision(torch.bfloat16, torch.float32, torch.int8)
    assert config.precision is config.precision  # parsed once
    policy = config.precision.policy
    assert (policy.param_dtype, policy.reduce_dtype, policy.all_gather_dtype) == (torch.bfloat16, torch.float32,
                                                                                  torch.int8)
    assert policy.output_dtype is None and policy.cast_forward_inputs
    assert not config.precision.loss_scaling and config.precision.compute_bytes == 2
    fp16 = Precision.from_names("fp32", "fp16")
    assert fp16.loss_scaling and fp16.compute_bytes == 4 and fp16.policy.all_gather_dtype is None


@pytest.mark.parametrize("given, value", [("true", True), ("false", False), ("default", None), ("2", 2)])
def test_the_flag_takes_fully_shard_s_values(tmp_path, given, value):
    got = TrainConfig.from_argv(["--reshard-after-forward", given, "--out", str(tmp_path)])
    assert got.sharding.reshard_after_forward == value and type(got.sharding.reshard_after_forward) is type(value)


def test_a_malformed_value_is_argparse_s_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        TrainConfig.from_argv(["--reshard-after-forward", "sometimes", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--reshard-after-forward: give true, false, default" in capsys.readouterr().err


def test_a_group_size_must_divide_the_world_size():
    for value in (None, True, False, 1, 2, 4):
        check_reshard_after_forward(value, 4)
    with pytest.raises(UsageError, match=r"--reshard-after-forward 3 does not divide the 4 rank\(s\); give one of "
                                         r"1, 2, 4, or true, false or default"):
        check_reshard_after_forward(3, 4)


def test_each_block_gets_the_setting_and_the_root_fully_shard_s_default(monkeypatch):
    calls = []
    monkeypatch.setattr(sharding, "fully_shard", lambda module, **kwargs: calls.append((module, kwargs)))
    with torch.device("meta"):
        model = Llama(LlamaConfig(dim=32, n_layers=2, n_heads=2, max_seq_len=16))
    policy = Precision.from_names("fp32", "fp32").policy
    sharding.shard_model(model, policy, reshard_after_forward=2)
    assert [module for module, _ in calls] == [*model.layers, model]
    assert [kwargs for _, kwargs in calls] == [{"mp_policy": policy, "reshard_after_forward": 2}] * 2 + [
        {"mp_policy": policy}]


def _losses(rank: int, world_size: int, tmp: str, corpus_file: str) -> dict:
    losses = {}
    for name, flag in (("default", []), ("false", ["--reshard-after-forward", "false"]),
                       ("ranks", ["--reshard-after-forward", str(world_size)])):
        trainer = make_trainer(["--steps", "2", "--data", corpus_file, "--out", f"{tmp}/{name}", *flag])
        losses[name] = [trainer.train_step()[0]["train_loss"] for _ in range(2)]
    return losses


def test_keeping_the_parameters_after_forward_trains_the_same(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(corpus_text())
    for got in run_distributed(_losses, 2, str(tmp_path), str(corpus), timeout=240):
        assert got["false"] == got["default"] == got["ranks"]
