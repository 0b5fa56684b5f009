"""--tensorboard and --wandb: the records of metrics.jsonl reach TensorBoard's event file; asking
for a sink whose package is missing is a one-line error."""

import sys

import pytest

from flashfsdp.train import report
from flashfsdp.train.cli import main
from flashfsdp.train.config import TrainConfig, UsageError
from flashfsdp.train.loggers import TENSORBOARD_DIR, check_installed, open_sinks, scalars


def test_scalars_tags():
    step = {"step": 3, "train_loss": 2.5, "lr": 1e-3, "mfu": None, "skipped": False, "world_size": 2}
    assert scalars(step) == {"train/loss": 2.5, "train/lr": 1e-3, "train/skipped": 0.0,
                             "train/world_size": 2.0}
    assert scalars({"step": 4, "val_loss": 2.0, "resumed": True}) == {"val/loss": 2.0, "val/resumed": 1.0}


def test_progress_writes_tensorboard_events(tmp_path):
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    sinks = open_sinks(str(tmp_path), tensorboard=True, wandb=False, config={})
    progress = report.Progress(str(tmp_path), 2, 0, enabled=True, sinks=sinks)
    for step, loss in ((1, 3.0), (2, 2.5)):
        progress.log({"step": step, "train_loss": loss, "lr": 0.1 * step})
    progress.validation(2, 2.75)
    progress.close()
    progress.close_sinks()
    events = event_accumulator.EventAccumulator(str(tmp_path / TENSORBOARD_DIR))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 3.0), (2, 2.5)]
    assert [(e.step, e.value) for e in events.Scalars("val/loss")] == [(2, 2.75)]
    assert len(report.read_metrics(str(tmp_path))[0]) == 2  # metrics.jsonl as before


def test_other_ranks_open_no_sink(tmp_path):
    progress = report.Progress(str(tmp_path), 1, 0, enabled=False, sinks=[object()])
    assert progress.sinks == []


def test_wandb_asked_for_and_not_installed_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: find_spec says None
    with pytest.raises(UsageError, match="--wandb: the wandb package is not installed; pip install wandb"):
        check_installed(tensorboard=False, wandb=True)
    assert main(["--wandb", "--out", str(tmp_path / "run"), "--device", "cpu"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "--wandb" in lines[0] and not (tmp_path / "run").exists()


def test_tensorboard_is_opt_in(tmp_path):
    config = TrainConfig.from_argv(["--out", str(tmp_path)])
    assert not config.logging.tensorboard and not config.logging.wandb
    assert TrainConfig.from_argv(["--out", str(tmp_path), "--tensorboard"]).logging.tensorboard


def test_wandb_offline_run_gets_the_records(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    (sink,) = open_sinks(str(tmp_path / "run"), tensorboard=False, wandb=True, config={"steps": 2})
    (tmp_path / "run").mkdir(exist_ok=True)
    progress = report.Progress(str(tmp_path / "run"), 2, 0, enabled=True, sinks=[sink])
    progress.log({"step": 1, "train_loss": 3.0, "lr": 0.1})
    progress.log({"step": 2, "train_loss": 2.5, "lr": 0.2})
    progress.validation(2, 2.75)  # the same step: W&B merges it into step 2's row
    progress.log({"step": 3, "train_loss": 2.0, "lr": 0.3})  # a later step commits step 2's row
    summary = dict(sink.run.summary)
    got = (summary["_step"], summary["train/loss"], summary["train/lr"], summary["val/loss"])
    assert got == (2, 2.5, 0.2, 2.75)
    assert sink.run.config["steps"] == 2 and sink.run.name == "run"
    progress.close_sinks()
    assert list((tmp_path / "run" / "wandb").glob("offline-run-*"))
