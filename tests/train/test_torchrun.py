"""flashfsdp-train under torchrun as two "nodes": two torchrun processes on this machine meeting in
torch's c10d rendezvous (no --node-rank), one worker each; the run directory every rank agrees on;
SIGTERM to both agents (what Slurm's scancel sends); a worker's GPU from LOCAL_RANK."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from flashfsdp.checkpoint import latest
from flashfsdp.train import checkpoints, launch
from flashfsdp.train.config import TrainConfig
from tests.harness import run_distributed

# Seconds a two-node run may take on a busy shared machine.
TIMEOUT_S = 300
# A few steps of the smallest tiny model; a stuck collective fails after --timeout, not 600 s.
TINY = ("--preset", "tiny", "--layers", "1", "--eval-batches", "1", "--sample-tokens", "0",
        "--timeout", "120")


def _free_port() -> int:
    """A port nothing listens on, below the kernel's ephemeral range: the port-0 binds of other
    processes (other tests' stores) land in that range, so this one stays free until the first
    agent binds it. Raises RuntimeError if none of 200 random candidates is free."""
    with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
        first_ephemeral = int(fh.read().split()[0])
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(min(20000, first_ephemeral - 1000), first_ephemeral)
        with socket.socket() as sock:
            try:
                sock.bind(("", port))  # every interface, as the rendezvous store binds
            except OSError:
                continue
        return port
    raise RuntimeError("no free port below the ephemeral range")


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # reference kernels
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return env


def _start_nodes(cwds: list, run_id: str, *args: str) -> list[subprocess.Popen]:
    """One torchrun per working directory, 2 nodes x 1 worker over one c10d endpoint; output in
    `<cwd>/torchrun.log`."""
    port = _free_port()
    procs = []
    for cwd in cwds:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
               "-m", "flashfsdp.train", *args]
        with open(cwd / "torchrun.log", "w") as log:
            procs.append(subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                          env=_env(), start_new_session=True))
    return procs


def _wait(procs: list[subprocess.Popen], cwds: list) -> list[int]:
    """The agents' exit codes; on a timeout, SIGTERM then SIGKILL (their workers, in sessions of
    their own, are stopped by the agents)."""
    deadline = time.monotonic() + TIMEOUT_S
    try:
        return [p.wait(timeout=max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _logs(cwds: list) -> str:
    return "\n".join(f"== {c}\n" + (c / "torchrun.log").read_text()[-3000:] for c in cwds)


def _nodes(tmp_path) -> list:
    cwds = [tmp_path / "node0", tmp_path / "node1"]
    for cwd in cwds:
        cwd.mkdir()
    return cwds


def test_two_torchrun_nodes_train_in_one_run_directory_and_resume(tmp_path):
    """No --out and a different working directory per node: each process makes its own default
    run directory, and every rank writes in rank 0's."""
    cwds = _nodes(tmp_path)
    procs = _start_nodes(cwds, uuid.uuid4().hex, *TINY, "--steps", "3")
    assert _wait(procs, cwds) == [0, 0], _logs(cwds)
    runs = [c / "runs" / name for c in cwds if (c / "runs").is_dir() for name in os.listdir(c / "runs")]
    assert len(runs) == 1, runs
    out = runs[0]
    step_3 = latest(str(out / "checkpoints"))
    assert step_3.endswith("step_3") and {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(step_3))

    procs = _start_nodes(cwds, uuid.uuid4().hex, "--resume", "--out", str(out), "--steps", "5",
                         *TINY)
    assert _wait(procs, cwds) == [0, 0], _logs(cwds)
    assert latest(str(out / "checkpoints")).endswith("step_5")
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["start_step"], summary["step"], summary["world_size"]) == (3, 5, 2)


def test_sigterm_to_both_agents_saves_a_final_checkpoint(tmp_path):
    cwds, out, run_id = _nodes(tmp_path), tmp_path / "run", uuid.uuid4().hex
    procs = _start_nodes(cwds, run_id, *TINY, "--steps", "1000", "--eval-every", "1000",
                         "--save-every", "1000", "--out", str(out))
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (out / "metrics.jsonl").exists() or "train_loss" not in (out / "metrics.jsonl").read_text():
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, _logs(cwds)
            time.sleep(0.05)
        for p in procs:
            p.send_signal(signal.SIGTERM)  # each agent forwards it to its worker
    finally:
        codes = _wait(procs, cwds)
    assert all(code != 0 for code in codes), _logs(cwds)
    step, path = checkpoints.final_checkpoint(str(out), run_id)
    assert step >= 1 and path == latest(str(out / "checkpoints")), _logs(cwds)
    assert json.loads((out / checkpoints.STOP_RECORD).read_text())["signal"] == "SIGTERM"


def test_a_local_rank_beyond_the_nodes_gpus_is_refused(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK=0 needs GPU 0, but this node has 0 CUDA "
                                           r"device\(s\); start torchrun with --nproc-per-node 0"):
        launch.local_device("cuda")
    assert str(launch.local_device("cpu")) == "cpu"


def _agree(rank: int, world_size: int, tmp: str) -> tuple:
    config = TrainConfig.from_argv(["--out", os.path.join(tmp, f"rank{rank}")])
    agreed, resume_from = launch.agree_run_dir(config, None)
    try:
        launch.agree_run_dir(config, os.path.join(config.run.out, "checkpoints", f"step_{rank}"))
    except RuntimeError as err:
        return agreed.run.out, resume_from, str(err)
    return agreed.run.out, resume_from, None


def test_ranks_take_rank_0s_run_directory_and_must_resume_the_same_checkpoint(tmp_path):
    results = run_distributed(_agree, 2, str(tmp_path), timeout=TIMEOUT_S)
    assert [r[:2] for r in results] == [(str(tmp_path / "rank0"), None)] * 2
    for _, _, error in results:
        assert error is not None and "--resume: the ranks found different checkpoints" in error
        assert f"rank 1: {tmp_path / 'rank1' / 'checkpoints' / 'step_1'}" in error


def _disagree(rank: int, world_size: int, tmp: str) -> str | None:
    config = TrainConfig.from_argv(["--out", tmp, "--tp", str(1 + rank), "--lr", "0.001"])
    try:
        launch.agree_run_dir(config, None)
    except RuntimeError as err:
        return str(err)
    return None


def test_ranks_started_with_different_options_are_refused_by_name(tmp_path):
    """Workers started with different --tp would build different meshes and hang in their first
    collective: every rank raises, naming the option and each rank's value (--lr agrees: not named)."""
    for error in run_distributed(_disagree, 2, str(tmp_path), timeout=TIMEOUT_S):
        assert error is not None and "the ranks were started with different options" in error
        assert "--tp (sharding.tp): rank 0: 1, rank 1: 2" in error and "--lr" not in error
