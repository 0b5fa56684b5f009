"""flashfsdp-train end to end: 2 ranks on CPU, loss falls, checkpoint, resume at 1 rank; bad input
(Ctrl-C and other stop signals: test_signals.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from flashfsdp.checkpoint import latest


def _train(*args: str, timeout: int = 420) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # real CPU speed: reference kernels
    # One thread per worker: a one-rank run would take every core, and on a loaded machine its
    # OpenMP threads spin waiting for one (a ninefold slowdown with the other core busy).
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "flashfsdp.train", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _metrics(out) -> list[dict]:
    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_train_two_ranks_then_resume_at_one(tmp_path):
    out = tmp_path / "run"
    # 8 steps: the loss falls by more than 1 nat/byte by step 5 (train and validation)
    done = _train("--preset", "tiny", "--steps", "8", "--out", str(out), "--eval-every", "4", "--save-every", "8",
                  "--sample-tokens", "24")
    assert done.returncode == 0, done.stderr[-3000:]
    rows = _metrics(out)
    train = {r["step"]: r["train_loss"] for r in rows if "train_loss" in r}
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert {r["world_size"] for r in rows if "world_size" in r} == {2}
    assert train[8] < train[1] - 1.0 and val[-1] < val[0] - 1.0
    assert latest(str(out / "checkpoints")).endswith("step_8")
    assert (out / "loss.png").stat().st_size > 0 and (out / "samples.txt").read_text().strip()
    saved_val = val[-1]

    resumed = _train("--resume", "--out", str(out), "--nproc", "1", "--steps", "10")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    rows = _metrics(out)
    (first,) = [r for r in rows if r.get("resumed")]
    assert first["step"] == 8 and first["world_size"] == 1
    assert first["val_loss"] == pytest.approx(saved_val, rel=1e-4)  # the saved model, at another W
    assert [r["step"] for r in rows if "train_loss" in r][-2:] == [9, 10]
    assert latest(str(out / "checkpoints")).endswith("step_10")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--data", "/nonexistent/corpus"], "--data PATH: no such file or directory"),
        (["--data", "{empty}"], "empty corpus"),
        (["--preset", "1b"], "--preset 1b"),
        (["--device", "cuda", "--nproc", "2"], "--device cuda: no CUDA device is available"),
        (["--resume"], "is not a flashfsdp-train run directory"),
    ],
)
def test_bad_input_is_one_line_and_leaves_nothing(tmp_path, capsys, args, message):
    """The launcher's checks, through the command's `main` in this process (they run before any
    worker starts; that an exit code and stderr pass through the process boundary: the runs above)."""
    from flashfsdp.train.cli import main  # noqa: PLC0415

    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    args = [a.replace("{empty}", str(empty)) for a in args]
    if args[0] == "--preset" and os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") > 512 * 2**30:
        pytest.skip("this machine could fit the 1b preset")
    assert main([*args, "--steps", "2", "--out", str(out)]) == 2
    stderr = capsys.readouterr().err
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in stderr
    assert not (out / "checkpoints").exists()
