"""flashfsdp-train stopped by SIGINT (Ctrl-C: to the process group) or SIGTERM (to the launcher)
after a few steps leaves a complete final checkpoint of the step it reports, its summary and
plot, and exits with 128 + the signal; the launcher says so only when that checkpoint is on disk;
the resumption is recorded in run.json and clears stopped.json; while the job runs, a second job
into its --out exits 2 naming the holder (the run lock's pieces: test_run_lock.py); the pieces
(`StopFlag`, the stop record) alone."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

from flashfsdp.checkpoint import latest
from flashfsdp.checkpoint.marker import MARKER, new_marker
from flashfsdp.debug import load_dumps
from flashfsdp.train import checkpoints, stopping
from flashfsdp.train.run_lock import LOCK_FILE

SAVED = re.compile(r"the workers saved a final checkpoint at step (\d+), (\S+) \(")
# Seconds a whole launch may take on a busy shared machine.
TIMEOUT_S = 240


def _tiny(out, eval_batches: int = 1) -> list[str]:
    """The smallest 2-rank job of the tiny preset; 1000 steps keep it running until signalled."""
    return ["--preset", "tiny", "--layers", "1", "--steps", "1000", "--eval-every", "1000",
            "--eval-batches", str(eval_batches), "--save-every", "1000", "--sample-tokens", "0",
            "--nproc", "2", "--out", str(out)]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # reference kernels
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")  # one thread per worker (see test_train.py)
    return env


def _start(tmp_path, *args: str) -> subprocess.Popen:
    """The launcher, in its own session, its output in files (a full pipe would block it)."""
    out, err = (open(tmp_path / name, "w") for name in ("stdout.txt", "stderr.txt"))
    with out, err:
        return subprocess.Popen([sys.executable, "-m", "flashfsdp.train", *args], stdout=out,
                                stderr=err, env=_env(), start_new_session=True)


def _wait_until(ready, proc: subprocess.Popen, what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        assert proc.poll() is None, f"the launcher exited ({proc.returncode}) before {what}"
        assert time.monotonic() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.05)


def _finish(proc: subprocess.Popen) -> int:
    try:
        return proc.wait(timeout=TIMEOUT_S)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _trained_a_step(out) -> bool:
    path = out / "metrics.jsonl"
    return path.exists() and any("train_loss" in json.loads(line)
                                 for line in path.read_text().splitlines() if line.endswith("}"))


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_signal_saves_the_step_it_reports_and_the_run_resumes(tmp_path, sig):
    """SIGINT goes to the whole process group, as a terminal's Ctrl-C does (every worker gets it
    directly as well); SIGTERM to the launcher only, as a scheduler's kill does (its agent forwards
    it). The SIGTERM run is also the running job of the run lock's end-to-end check (one launch for
    both): a second job into its --out exits 2 with one line naming it as the holder."""
    out = tmp_path / "run"
    proc = _start(tmp_path, *_tiny(out))
    try:
        _wait_until(lambda: _trained_a_step(out), proc, "training step")
        if sig == signal.SIGTERM:
            second = subprocess.run([sys.executable, "-m", "flashfsdp.train", *_tiny(out)], capture_output=True,
                                    text=True, env=_env(), timeout=TIMEOUT_S)
            assert proc.poll() is None
        if sig == signal.SIGINT:
            os.killpg(proc.pid, sig)  # what a terminal's Ctrl-C sends: the launcher and every worker
        else:
            os.kill(proc.pid, sig)  # the launcher only: its elastic agent forwards it to the workers
    finally:
        code = _finish(proc)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert code == 128 + sig, stderr[-3000:]
    (step, path), = SAVED.findall(stderr)
    assert 1 <= int(step) < 1000 and path == str(out / "checkpoints" / f"step_{step}")
    assert latest(str(out / "checkpoints")) == path
    record = json.loads((out / checkpoints.STOP_RECORD).read_text())
    assert (record["step"], record["signal"]) == (int(step), sig.name)
    # the training job gives the flight recorder its run directory: each worker dumped its ring
    assert sorted(report["rank"] for report in load_dumps(str(out))) == [0, 1]
    # the interrupted run wrote its summary and plot, and left no lock behind
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"].startswith(f"{sig.name} at step") and summary["step"] == int(step)
    assert (out / "loss.png").stat().st_size > 0 and not (out / LOCK_FILE).exists()
    if sig == signal.SIGINT:
        return  # the lock and resuming are the same for both signals

    assert second.returncode == 2, second.stderr[-2000:]
    lines = second.stderr.strip().splitlines()
    assert len(lines) == 1 and f"is in use by another run (host {socket.gethostname()}, pid {proc.pid}, " \
                                "started " in lines[0], second.stderr
    last = int(step)
    resumed = subprocess.run([sys.executable, "-m", "flashfsdp.train", "--resume", "--out", str(out),
                              "--nproc", "1", "--steps", str(last + 1)],
                             capture_output=True, text=True, env=_env(), timeout=TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert latest(str(out / "checkpoints")).endswith(f"step_{last + 1}")
    # the resumption is recorded in run.json and clears stopped.json
    run = json.loads((out / "run.json").read_text())
    (record,) = run["resumptions"]
    assert record["step"] == last and record["world_size"] == 1
    assert record["changed"]["training.steps"] == [1000, last + 1] and record["changed"]["run.nproc"] == [2, 1]
    assert run["training"]["steps"] == last + 1 and not (out / checkpoints.STOP_RECORD).exists()


def test_a_signal_before_the_first_step_saves_nothing_and_says_so(tmp_path):
    """SIGTERM while the ranks run their first validation (long: 100 batches): they stop before
    their first step, a fresh run has nothing to save, and the launcher claims no checkpoint."""
    out = tmp_path / "run"
    proc = _start(tmp_path, *_tiny(out, eval_batches=100))
    try:
        _wait_until(lambda: (out / "run.json").exists(), proc, "run.json")  # after the handlers
        os.kill(proc.pid, signal.SIGTERM)
    finally:
        code = _finish(proc)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert code == 128 + signal.SIGTERM, stderr[-3000:]
    assert "saved a final checkpoint" not in stderr
    assert "interrupted (SIGTERM) without a final checkpoint" in stderr
    assert f"{out} holds no checkpoint" in stderr
    assert latest(str(out / "checkpoints")) is None and not (out / checkpoints.STOP_RECORD).exists()


def _complete_checkpoint(out, step: int) -> str:
    """A directory `latest` counts as a complete checkpoint of `step` (its marker only)."""
    path = checkpoints.checkpoint_dir(str(out), step)
    os.makedirs(path)
    with open(os.path.join(path, MARKER), "wb") as fh:
        fh.write(new_marker(step, 2, True, {}))
    return path


def test_the_launcher_claims_only_the_recorded_checkpoint_of_its_own_job(tmp_path, capsys):
    out = str(tmp_path)
    assert stopping.report_stop("prog", out, "job", signal.SIGTERM) == 143
    assert (f"without a final checkpoint (stopped before the first step, or a worker ended before "
            f"saving); {out} holds no checkpoint") in capsys.readouterr().err

    path = _complete_checkpoint(tmp_path, 3)
    checkpoints.record_stop(out, 3, "another job", "SIGTERM")
    assert checkpoints.final_checkpoint(out, "job") is None
    assert stopping.report_stop("prog", out, "job", signal.SIGINT) == 130
    assert "(SIGINT) without a final checkpoint" in capsys.readouterr().err

    checkpoints.record_stop(out, 4, "job", "SIGTERM")  # its checkpoint never completed
    assert checkpoints.final_checkpoint(out, "job") is None
    stopping.report_stop("prog", out, "job", signal.SIGTERM)
    assert f"the newest checkpoint is {path}" in capsys.readouterr().err

    checkpoints.record_stop(out, 3, "job", "SIGTERM")
    assert checkpoints.final_checkpoint(out, "job") == (3, path)
    stopping.report_stop("prog", out, "job", signal.SIGTERM)
    assert capsys.readouterr().err == (f"prog: interrupted; the workers saved a final checkpoint at "
                                       f"step 3, {path} (SIGTERM; resume with --resume)\n")
    _complete_checkpoint(tmp_path, 5)  # a newer checkpoint: the recorded one is not the final one
    assert checkpoints.final_checkpoint(out, "job") is None


def test_stop_flag_records_the_first_stop_signal_and_restores_the_handlers():
    before = {sig: signal.getsignal(sig) for sig in stopping.STOP_SIGNALS}
    flag = stopping.StopFlag()
    try:
        assert not flag.requested
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        assert flag.requested and flag.signum == signal.SIGTERM
    finally:
        flag.restore()
    assert {sig: signal.getsignal(sig) for sig in stopping.STOP_SIGNALS} == before
    assert [stopping.stop_signal_of(c) for c in (130, 143, 1, 137)] == [2, 15, None, None]
