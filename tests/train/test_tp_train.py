"""flashfsdp-train --tp end to end on 4 CPU ranks: (dp, tp) = (2, 2) trains the tiny preset and
saves; the run resumes at (2, 1) from the same checkpoint (DCP reshards the TP pieces, and the
data-parallel ones to another world size) with the saved model's validation loss, and goes on.
Two ranks for the resumption: four processes on a 2-core machine took twice as long to start."""

from __future__ import annotations

import pytest

from flashfsdp.checkpoint import latest
from tests.train.test_train import _metrics, _train

SHORT = ["--preset", "tiny", "--seq-len", "32", "--batch-size", "8", "--eval-batches", "1", "--sample-tokens", "8",
         "--eval-every", "4", "--save-every", "4"]


def test_train_at_2x2_dp_tp_then_resume_without_tp(tmp_path):
    out = tmp_path / "run"
    done = _train(*SHORT, "--steps", "4", "--nproc", "4", "--tp", "2", "--out", str(out))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "4 rank(s) as (dp, tp) = (2, 2)" in done.stderr
    rows = _metrics(out)
    train = [r["train_loss"] for r in rows if "train_loss" in r]
    assert len(train) == 4 and train[-1] < train[0]
    saved_val = [r["val_loss"] for r in rows if "val_loss" in r][-1]
    assert latest(str(out / "checkpoints")).endswith("step_4")

    resumed = _train("--resume", "--out", str(out), "--nproc", "2", "--tp", "1", "--steps", "6", "--eval-batches", "1",
                     "--sample-tokens", "0")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = _metrics(out)
    (first,) = [r for r in rows if r.get("resumed")]
    assert first["step"] == 4 and first["val_loss"] == pytest.approx(saved_val, rel=1e-4)
    assert [r["step"] for r in rows if "train_loss" in r][-2:] == [5, 6]
    assert latest(str(out / "checkpoints")).endswith("step_6")
