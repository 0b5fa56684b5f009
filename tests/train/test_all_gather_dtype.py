"""flashfsdp-train --all-gather-dtype int8: every unit all-gathers int8 (ZeRO++ qwZ) and a few
steps train like the bf16 run (the 500-step comparison is a measurement: benchmarks/results/cpu/)."""

from __future__ import annotations

import pytest
import torch

from flashfsdp.train.config import TrainConfig
from tests.harness import run_distributed

TINY = ["--layers", "1", "--dim", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--eval-batches", "1", "--sample-tokens", "0", "--param-dtype", "bf16", "--steps", "3"]


def test_flag_parses(tmp_path):
    plain = TrainConfig.from_argv([*TINY, "--out", str(tmp_path)])
    int8 = TrainConfig.from_argv([*TINY, "--all-gather-dtype", "int8", "--out", str(tmp_path)])
    assert plain.sharding.all_gather_dtype is None and plain.precision.policy.all_gather_dtype is None
    assert int8.sharding.all_gather_dtype == "int8" and int8.precision.policy.all_gather_dtype == torch.int8


def test_other_values_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        TrainConfig.from_argv([*TINY, "--all-gather-dtype", "fp8", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--all-gather-dtype" in capsys.readouterr().err


def _losses(rank: int, world_size: int, out: str, corpus_file: str, flag: list[str]) -> dict:
    from flashfsdp.train.data import load_corpus  # noqa: PLC0415
    from flashfsdp.train.trainer import Trainer  # noqa: PLC0415

    config = TrainConfig.from_argv([*TINY, *flag, "--out", out, "--data", corpus_file], warn=False)
    trainer = Trainer(config, load_corpus(corpus_file), rank, world_size, torch.device("cpu"))
    dtypes = {m._flashfsdp_state.unit.all_gather_dtype for m in trainer.model.modules()
              if m.__dict__.get("_flashfsdp_state") is not None}
    return {"dtypes": dtypes, "losses": [trainer.train_step()[0]["train_loss"] for _ in range(3)]}


def _both(rank: int, world_size: int, tmp: str, corpus_file: str) -> dict:
    return {"int8": _losses(rank, world_size, f"{tmp}/int8", corpus_file, ["--all-gather-dtype", "int8"]),
            "bf16": _losses(rank, world_size, f"{tmp}/bf16", corpus_file, [])}


def test_int8_all_gathers_train_like_bf16(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(200)))
    for got in run_distributed(_both, 2, str(tmp_path), str(corpus), timeout=240):
        assert got["int8"]["dtypes"] == {torch.int8} and got["bf16"]["dtypes"] == {None}
        torch.testing.assert_close(got["int8"]["losses"], got["bf16"]["losses"], rtol=1e-2, atol=0)
