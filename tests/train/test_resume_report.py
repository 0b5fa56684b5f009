"""What a resumed run says: the options it changed as flags and typed values, the checkpoint's
losses as rounded figures, and a summary of the whole run with the last segment beside it."""

from __future__ import annotations

import json

import pytest

from flashfsdp.train import report


def test_changed_options_read_as_typed():
    from flashfsdp.train.run_file import describe_changes  # noqa: PLC0415

    changed = {"run.nproc": [None, 1], "training.steps": [100, 200], "optimizer.lr": [0.001, 0.0005],
               "training.activation_checkpointing": [False, True], "model.freeze": [["*embed*"], []]}
    assert describe_changes(changed) == ("--freeze *embed* -> none, --lr 0.001 -> 0.0005, --nproc unset -> 1, "
                                         "--activation-checkpointing false -> true, --steps 100 -> 200")


def test_the_checkpoints_losses_are_rounded_and_a_missing_one_said():
    assert report.saved_losses({"train_loss": 2.520338535308838, "val_loss": None}) == (
        "train loss 2.5203, val loss not measured at that step")
    assert report.saved_losses({"train_loss": 2.5, "val_loss": 2.61234}) == "train loss 2.5000, val loss 2.6123"


def _segment(fh, steps, ms, tokens_per_s, resumed_at=None):
    """metrics.jsonl records of one segment, as `report.Progress` writes them (2 ranks)."""
    start = steps[0] - 1
    fh.write(json.dumps({"step": start, "val_loss": 3.0, "resumed": resumed_at is not None}) + "\n")
    for step in steps:
        fh.write(json.dumps({"step": step, "train_loss": 2.0, "step_ms": ms, "tokens_per_s": tokens_per_s,
                             "tokens_per_s_per_rank": tokens_per_s / 2, "tflops_per_rank": tokens_per_s / 1e6,
                             "mfu": None, "world_size": 2}) + "\n")


def _summary(out, start_step, tokens_per_s):
    return {"params": 1e6, "world_size": 2, "device": "cpu", "start_step": start_step, "step": 6, "train_loss": 2.0,
            "val_loss": 2.1, "unigram_baseline": 3.2, "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_rank": tokens_per_s / 2, "tflops_per_rank": tokens_per_s / 1e6, "mfu": None,
            "unit": "byte", "wall_s": 9.5, "peak_memory_bytes": 2**20, "overflow_steps": None, "interrupted": None,
            **report.whole_run(str(out), start_step)}


def test_a_resumed_runs_summary_covers_the_whole_run(tmp_path):
    """Steps 1-3 at 1000 tokens/s (100 ms each), resumed at 3, steps 4-6 at 2000 (300 ms): each
    segment's first step is warm-up, so the run's figure is (2 x 100 + 2 x 600) tokens / 0.8 s."""
    with open(tmp_path / report.METRICS, "w", encoding="utf-8") as fh:
        _segment(fh, [1, 2, 3], 100.0, 1000.0)
        _segment(fh, [4, 5, 6], 300.0, 2000.0, resumed_at=3)
    summary = _summary(tmp_path, 3, 2000.0)
    assert summary["run"] == pytest.approx({"start_step": 0, "steps_timed": 4, "step_s": 0.8, "tokens_per_s": 1750.0,
                                            "tokens_per_s_per_rank": 875.0, "tflops_per_rank": 1750.0 / 1e6,
                                            "mfu": None})
    rows = dict(line.split(" | ", 1) for line in report.write_summary(str(tmp_path), summary).splitlines()[1:-1])
    rows = {key.strip(): value for key, value in rows.items()}
    assert rows["steps"] == "0 -> 6 (this segment: 3 -> 6)"
    assert rows["tokens/s"] == "1750 (875 per rank) over the run; this segment 2000 (1000 per rank)"
    assert rows["wall time"] == "9.5 s this segment; 0.8 s in the run's timed steps"
    assert json.loads((tmp_path / report.SUMMARY).read_text())["run"]["tokens_per_s"] == pytest.approx(1750.0)


def test_a_first_segments_summary_is_unchanged(tmp_path):
    with open(tmp_path / report.METRICS, "w", encoding="utf-8") as fh:
        _segment(fh, [1, 2, 3, 4, 5, 6], 100.0, 1000.0)
    summary = _summary(tmp_path, 0, 1000.0)
    assert "run" not in summary
    text = report.write_summary(str(tmp_path), summary)
    assert "| 0 -> 6\n" in text and "| 1000 (500 per rank)\n" in text and "| 9.5 s\n" in text
