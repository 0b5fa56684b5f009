"""flashfsdp-train when what surrounds its workers goes away, with real processes and signals:

- the launcher killed alone (SIGKILL): its workers see it gone, stop after their current step with
  a final checkpoint (as on SIGTERM), and until they have ended the run directory's lock is
  refused to a second job, naming them; then it is taken over;
- Ctrl-C on `flashfsdp-train ... | tee log`: the pipe's reader dies first, yet the workers save
  their final checkpoint and the launcher exits 130 (its messages into the closed pipe dropped);
- the pieces: a lock whose holder is gone but whose recorded worker runs is refused (a reused pid
  is not taken for it), and output into a pipe nobody reads is dropped without an error.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from flashfsdp.checkpoint import latest
from flashfsdp.train import checkpoints
from flashfsdp.train.run_lock import LOCK_FILE, RunLock, RunLocked
from tests.train.test_signals import TIMEOUT_S, _env, _finish, _tiny, _trained_a_step, _wait_until


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (not ended, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    """The child processes of `pid` (Linux /proc)."""
    tasks = f"/proc/{pid}/task"
    return sorted(int(c) for t in os.listdir(tasks) for c in open(f"{tasks}/{t}/children").read().split())


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the workers through /proc")
def test_workers_end_with_a_killed_launcher_and_hold_the_run_directory_until_then(tmp_path):
    out, workers = tmp_path / "run", []
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "flashfsdp.train", *_tiny(out)], stdout=err, stderr=err,
                                env=_env(), start_new_session=True)
    try:
        _wait_until(lambda: _trained_a_step(out), proc, "training step")
        workers = _children(proc.pid)
        assert len(workers) == 2, workers
        os.kill(proc.pid, signal.SIGKILL)  # the launcher alone: its workers run in sessions of their own
        proc.wait()
        with pytest.raises(RunLocked) as refused:
            RunLock.acquire(str(out))
        assert sorted(refused.value.workers) == workers
        assert f"--out {out} is still in use by 2 worker(s) of a run whose launcher is gone (host " \
               f"{socket.gethostname()}, pid {proc.pid}, started " in str(refused.value)
        deadline = time.monotonic() + TIMEOUT_S
        while any(_alive(w) for w in workers):
            assert time.monotonic() < deadline, "the workers of the killed launcher still run"
            time.sleep(0.1)
    finally:
        for pid in [proc.pid, *(w for w in workers if _alive(w))]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    stderr = (tmp_path / "stderr.txt").read_text()
    assert f"its launcher (pid {proc.pid}) is gone; stopping after the current step" in stderr, stderr[-3000:]
    record = json.loads((out / checkpoints.STOP_RECORD).read_text())
    assert record["signal"] == "SIGTERM" and latest(str(out / "checkpoints")).endswith(f"step_{record['step']}")
    with RunLock.acquire(str(out)) as lock:  # the workers have ended: the lock is taken over
        assert lock.recovered["pid"] == proc.pid


def test_ctrl_c_with_the_output_piped_into_a_reader_that_died_first(tmp_path):
    """What `flashfsdp-train ... 2>&1 | tee log` and Ctrl-C do: the reader (tee) is gone before the
    launcher and its workers write their last lines."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "flashfsdp.train", *_tiny(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env=_env(), start_new_session=True)
    try:
        os.set_blocking(proc.stdout.fileno(), False)  # the reader keeps the pipe from filling up

        def trained() -> bool:
            proc.stdout.read()
            return _trained_a_step(out)

        _wait_until(trained, proc, "training step")
        proc.stdout.close()  # tee dies first ...
        os.killpg(proc.pid, signal.SIGINT)  # ... as Ctrl-C reaches the launcher's process group
    finally:
        code = _finish(proc)
    assert code == 128 + signal.SIGINT
    record = json.loads((out / checkpoints.STOP_RECORD).read_text())
    assert record["signal"] == "SIGINT" and latest(str(out / "checkpoints")).endswith(f"step_{record['step']}")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] == f"SIGINT at step {record['step']}"
    assert not (out / LOCK_FILE).exists()


def test_a_lock_is_refused_while_a_recorded_worker_of_its_dead_holder_runs(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    holder = {"host": socket.gethostname(), "pid": int(dead.stdout), "started": "2020-01-01 00:00:00 +0000"}
    (out / LOCK_FILE).write_text(json.dumps(holder))
    worker = subprocess.Popen([sys.executable, "-c", "import sys, time; from flashfsdp.train.run_lock import "
                               "register_worker; register_worker(sys.argv[1]); print('ok', flush=True); "
                               "time.sleep(600)", str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "ok"
        with pytest.raises(RunLocked) as refused:
            RunLock.acquire(str(out))
        assert refused.value.workers == [worker.pid] and f"kill {worker.pid}" in str(refused.value)
        lines = (out / LOCK_FILE).read_text().splitlines()
        reused = json.loads(lines[-1]) | {"started_ticks": "1"}  # the same pid, another process
        (out / LOCK_FILE).write_text("\n".join([*lines[:-1], json.dumps(reused)]) + "\n")
        with RunLock.acquire(str(out)) as lock:
            assert lock.recovered == holder
    finally:
        worker.kill()
        worker.wait()


def test_output_into_a_pipe_nobody_reads_is_dropped_without_an_error():
    from flashfsdp_cli.streams import SturdyStream, sturdy_output  # noqa: PLC0415

    read, write = os.pipe()
    os.close(read)
    stream = SturdyStream(io.TextIOWrapper(io.FileIO(write, "w"), line_buffering=True))
    assert stream.write("a line\n") == len("a line\n") and stream.lost
    stream.write("and more\n")
    stream.flush()
    stream.close()
    with sturdy_output():
        assert isinstance(sys.stdout, SturdyStream) and isinstance(sys.stderr, SturdyStream)
    assert not isinstance(sys.stdout, SturdyStream)
