"""flashfsdp-train when one of its workers is killed (SIGKILL, as the kernel's OOM killer does):
the launcher names that rank, the surviving worker names it too and leaves a flight-recorder dump
that ``python -m flashfsdp.debug RUN`` reads, whether the survivor's collective fails first or the
launcher's SIGTERM reaches it first."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from flashfsdp.debug import load_dumps
from tests.train.test_launcher_gone import _children
from tests.train.test_signals import _env, _finish, _tiny, _trained_a_step, _wait_until


def _rank_of(pid: int) -> int:
    """The RANK in worker ``pid``'s environment (Linux /proc)."""
    env = dict(item.split("=", 1) for item in open(f"/proc/{pid}/environ").read().split("\0") if "=" in item)
    return int(env["RANK"])


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the workers through /proc")
def test_a_killed_worker_is_named_and_the_survivor_dumps(tmp_path):
    out = tmp_path / "run"
    with open(tmp_path / "stderr.txt", "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "flashfsdp.train", *_tiny(out)], stdout=err, stderr=err,
                                env=_env(), start_new_session=True)
    try:
        _wait_until(lambda: _trained_a_step(out), proc, "training step")
        ranks = {_rank_of(pid): pid for pid in _children(proc.pid)}
        assert sorted(ranks) == [0, 1], ranks
        os.kill(ranks[1], signal.SIGKILL)
        code = _finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert code != 0 and "worker rank 1 was killed by SIGKILL" in stderr, stderr[-3000:]
    assert re.search(r"^\[rank0\]:.*\brank 1\b", stderr, re.MULTILINE), stderr[-3000:]  # the survivor names it
    dumps = load_dumps(str(out))
    assert [d["rank"] for d in dumps] == [0], (dumps, stderr[-3000:])
    listed = subprocess.run([sys.executable, "-m", "flashfsdp.debug", str(out)], capture_output=True, text=True,
                            env=_env(), timeout=120)
    assert listed.returncode == 0 and "rank 0" in listed.stdout, listed.stdout + listed.stderr
