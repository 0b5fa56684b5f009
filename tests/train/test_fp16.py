"""flashfsdp-train in float16: the command line takes it, the trainer scales the loss, skips and
counts the steps whose gradients overflow (on every rank alike), and checkpoints the scaler."""

from __future__ import annotations

import pytest
import torch

from flashfsdp.train.config import TrainConfig
from tests.harness import run_distributed

TINY = ["--layers", "1", "--dim", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--eval-batches", "1", "--sample-tokens", "0"]


@pytest.mark.parametrize("given, param_dtype", [("float16", "fp16"), ("fp16", "fp16"), ("bfloat16", "bf16")])
def test_torch_dtype_names_are_accepted(tmp_path, given, param_dtype):
    config = TrainConfig.from_argv(["--param-dtype", given, "--reduce-dtype", "half", "--out", str(tmp_path)])
    assert config.sharding.param_dtype == param_dtype and config.sharding.reduce_dtype == "fp16"
    assert config.precision.loss_scaling


def test_unknown_dtype_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        TrainConfig.from_argv(["--param-dtype", "fp8", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--param-dtype" in capsys.readouterr().err


def _trainer(out: str, corpus_file: str, resume_from: str | None = None):
    from flashfsdp.train.data import load_corpus  # noqa: PLC0415
    from flashfsdp.train.trainer import Trainer  # noqa: PLC0415

    args = [*TINY, "--param-dtype", "fp16", "--steps", "6", "--out", out, "--data", corpus_file]
    config = TrainConfig.from_argv(args + (["--resume"] if resume_from else []), warn=False)
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    return Trainer(config, load_corpus(corpus_file), rank, world_size, torch.device("cpu"), resume_from=resume_from)


def _overflow_then_resume(rank: int, world_size: int, out: str, corpus_file: str) -> dict:
    from flashfsdp import ShardedGradScaler  # noqa: PLC0415
    from flashfsdp.runtime.init_window import close_init_windows  # noqa: PLC0415
    from flashfsdp.train.checkpoints import latest_checkpoint  # noqa: PLC0415

    trainer = _trainer(out, corpus_file)
    assert trainer.scaler.is_enabled() and trainer.scaler.get_scale() == 2.0**16
    trainer.scaler = ShardedGradScaler("cpu", init_scale=2.0**40)  # float16 gradients overflow at once
    close_init_windows()  # read the shards themselves, not the full-shape initialisation stand-ins
    before = [p.detach().clone() for p in trainer.model.parameters()]
    records = [trainer.train_step()[0] for _ in range(2)]
    unchanged = all(torch.equal(a, p) for a, p in zip(before, trainer.model.parameters()))
    trainer.save()
    resumed = _trainer(out, corpus_file, resume_from=latest_checkpoint(out))
    return {"records": records, "unchanged": unchanged, "overflow_steps": trainer.overflow_steps,
            "resumed_scale": resumed.scaler.get_scale(), "resumed_overflow_steps": resumed.overflow_steps,
            "resumed_step": resumed.step}


def test_overflowing_steps_are_skipped_counted_and_checkpointed(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    for got in run_distributed(_overflow_then_resume, 2, str(tmp_path / "run"), str(corpus), timeout=240):
        assert [r["skipped"] for r in got["records"]] == [True, True]
        assert [r["loss_scale"] for r in got["records"]] == [2.0**39, 2.0**38]
        assert got["unchanged"] and got["overflow_steps"] == 2
        assert got["resumed_step"] == 2 and got["resumed_overflow_steps"] == 2
        assert got["resumed_scale"] == 2.0**38
