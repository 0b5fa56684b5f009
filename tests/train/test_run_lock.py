"""One run per output folder: the lock is refused to another process and released on exit; a dead
holder's lock is taken over with a message; the holder is named. End to end (a second job into a
running job's --out exits 2 naming the holder; an interrupted run writes its summary and plot and
leaves no lock; its resumption is recorded in run.json and clears stopped.json) these share the
launch of test_signals.py's SIGTERM run."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys

import pytest

from flashfsdp.train.run_lock import LOCK_FILE, RunLock, RunLocked


def test_a_dead_holders_lock_is_taken_over_with_a_message(tmp_path, caplog):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = {"host": socket.gethostname(), "pid": int(dead.stdout), "started": "2020-01-01 00:00:00 +0000"}
    (out / LOCK_FILE).write_text(json.dumps(record))
    with caplog.at_level(logging.WARNING, logger="flashfsdp"):
        with RunLock.acquire(str(out)) as lock:
            assert lock.recovered == record
            assert json.loads((out / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert f"took over the lock of a run that ended without releasing it (host {socket.gethostname()}, " \
           f"pid {record['pid']}, started 2020-01-01" in caplog.text
    assert not (out / LOCK_FILE).exists() and out.is_dir()


def test_the_lock_is_refused_to_another_process_and_released_on_exit(tmp_path):
    out = tmp_path / "new"
    with RunLock.acquire(str(out)):
        probe = ("import sys; from flashfsdp.train.run_lock import RunLock, RunLocked\n"
                 "try:\n    RunLock.acquire(sys.argv[1])\nexcept RunLocked as e:\n    print(e.holder['pid'], e)\n")
        held = subprocess.run([sys.executable, "-c", probe, str(out)], capture_output=True, text=True, timeout=120)
        assert held.stdout.startswith(f"{os.getpid()} --out {out} is in use by another run"), held.stderr
    assert not out.exists()  # created by the lock, nothing written: removed with it
    with RunLock.acquire(str(out)) as again:
        assert again.held and again.recovered is None
    assert not again.held


def test_the_holder_is_named_even_before_it_wrote_its_record():
    error = RunLocked("/runs/x", {})
    assert "holder unknown" in str(error) and "choose another --out" in str(error)
    with pytest.raises(RunLocked):
        raise error


def test_the_loss_plot_marks_where_each_resumption_began(tmp_path):
    pytest.importorskip("matplotlib")
    from flashfsdp.train import report  # noqa: PLC0415

    records = [{"step": 0, "val_loss": 5.0, "world_size": 2}, {"step": 1, "train_loss": 4.0},
               {"step": 1, "val_loss": 4.5, "resumed": True, "world_size": 1}, {"step": 2, "train_loss": 3.5},
               {"step": 2, "val_loss": 3.9, "resumed": True, "world_size": 2}]
    (tmp_path / report.METRICS).write_text("".join(json.dumps(r) + "\n" for r in records))
    assert report.resume_steps(str(tmp_path)) == [1, 2]
    assert report.plot_losses(str(tmp_path), 3.2) == str(tmp_path / report.PLOT)
