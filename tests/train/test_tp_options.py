"""`flashfsdp-train --tp`: the option and TOML key, and the checks that name it: the world size,
the model's heads and sequence length (the key/value heads and feed-forward width: tests/train/test_tp_plan.py), the
batch over the data-parallel ranks."""

from __future__ import annotations

import pytest

from flashfsdp.train.checks import check_tp, validate
from flashfsdp.train.config import TrainConfig, UsageError


def test_tp_is_a_sharding_option_and_defaults_to_1(tmp_path):
    config = TrainConfig.from_argv(["--out", str(tmp_path), "--device", "cpu"])
    assert config.sharding.tp == 1
    toml = tmp_path / "run.toml"
    toml.write_text("[sharding]\ntp = 2\n")
    assert TrainConfig.from_argv(["--config", str(toml), "--out", str(tmp_path), "--device", "cpu"]).sharding.tp == 2


@pytest.mark.parametrize("argv, message", [
    (["--tp", "3"], "--tp 3 does not divide the model's n_heads (4)"),
    (["--tp", "2", "--seq-len", "17"], "--tp 2 does not divide the model's max_seq_len (17)"),
    (["--tp", "2", "--heads", "2", "--dim", "64"], None),
])
def test_tp_must_divide_the_heads_and_the_sequence(tmp_path, argv, message):
    args = [*argv, "--out", str(tmp_path), "--device", "cpu"]
    if message is None:
        assert TrainConfig.from_argv(args).sharding.tp == 2
        return
    with pytest.raises(UsageError) as err:
        TrainConfig.from_argv(args)
    assert message in str(err.value)


def test_tp_must_divide_the_world_size():
    assert check_tp(2, 4) == 2 and check_tp(1, 3) == 3
    with pytest.raises(UsageError, match=r"--tp 2 does not divide the 3 rank\(s\); give one of 1, 3"):
        check_tp(2, 3)


def test_the_batch_splits_over_the_data_parallel_ranks(tmp_path):
    # 4 ranks as (dp, tp) = (2, 2): a batch of 2 sequences gives each data-parallel rank one
    config = TrainConfig.from_argv(["--tp", "2", "--batch-size", "2", "--out", str(tmp_path / "a"),
                                    "--device", "cpu", "--steps", "2"])
    assert validate(config, 4, 4).resume_from is None
    config = TrainConfig.from_argv(["--batch-size", "2", "--out", str(tmp_path / "b"), "--device", "cpu"])
    with pytest.raises(UsageError, match=r"--batch-size 2 does not split over 4 rank\(s\)"):
        validate(config, 4, 4)
