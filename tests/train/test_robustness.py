"""flashfsdp-train's robustness settings, checked without launching a job: the collective timeout
(--timeout, and a rank that never joins a collective makes the others raise), --out writability,
the launcher's stores on 127.0.0.1 only, and the memory check counting each worker process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from flashfsdp.train import checks
from flashfsdp.train.cli import main
from flashfsdp.train.config import DEFAULT_TIMEOUT_S, TrainConfig, UsageError


def test_timeout_defaults_to_600_seconds_and_takes_a_number(tmp_path):
    assert DEFAULT_TIMEOUT_S == 600
    assert TrainConfig.from_argv(["--out", str(tmp_path)]).run.timeout == 600
    assert TrainConfig.from_argv(["--out", str(tmp_path), "--timeout", "2.5"]).run.timeout == 2.5


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf"])
def test_a_timeout_that_is_not_a_positive_number_names_the_option(tmp_path, value):
    with pytest.raises(UsageError, match=r"--timeout must be a positive number of seconds"):
        TrainConfig.from_argv(["--out", str(tmp_path), "--timeout", value])


def test_a_timeout_that_is_not_a_number_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        TrainConfig.from_argv(["--timeout", "soon"])
    assert exc.value.code == 2 and "--timeout" in capsys.readouterr().err


_RANK = textwrap.dedent("""
    import os, sys, time
    import torch, torch.distributed as dist
    from flashfsdp.train.launch import init_distributed
    rank, _, _ = init_distributed("cpu", timeout_s=float(sys.argv[1]))
    done = sys.argv[2]
    if rank == 0:
        try:
            dist.all_reduce(torch.ones(1))
            print("all_reduce returned")
        except RuntimeError as err:
            print("raised:", str(err).splitlines()[0][:200])
        open(done, "w").close()
    else:  # never joins the collective: waits for rank 0 to give up
        deadline = time.monotonic() + 120
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
    os._exit(0)  # the group is broken after a timeout: no collective teardown
""")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_rank_that_never_joins_makes_the_others_raise_after_the_timeout(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
               OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", _RANK, "2", str(tmp_path / "done")], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}) for r in range(2)]
    try:
        outputs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert outputs[0][0].startswith("raised:"), outputs[0]


def test_out_under_a_file_is_one_line_and_exit_code_2(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["--out", str(blocker / "run"), "--device", "cpu", "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{blocker} exists and is not a directory" in err[0]
    assert not (blocker.parent / "run").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in any directory")
def test_out_in_a_read_only_directory_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(UsageError, match=rf"--out {locked}/run: cannot write in {locked}"):
        checks.check_writable(str(locked / "run"))


def test_out_check_leaves_nothing_behind(tmp_path):
    checks.check_writable(str(tmp_path / "a" / "b"))
    assert os.listdir(tmp_path) == []


def _listening_addresses(pid: int) -> set[str]:
    """Local addresses of the TCP sockets process `pid` listens on ("127.0.0.1:port", "0.0.0.0:port")."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        target = os.readlink(f"/proc/{pid}/fd/{fd}") if os.path.exists(f"/proc/{pid}/fd/{fd}") else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in open(table).read().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].split(":")
                ip = ("127.0.0.1" if address == "0100007F" else
                      "0.0.0.0" if set(address) == {"0"} else address)
                found.add(f"{ip}:{int(port, 16)}")
    return found


def test_the_rendezvous_stores_listen_on_loopback_only():
    from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry

    from flashfsdp.train.rendezvous import LOOPBACK_BACKEND

    before = _listening_addresses(os.getpid())
    handler = rendezvous_handler_registry.create_handler(RendezvousParameters(
        backend=LOOPBACK_BACKEND, endpoint="127.0.0.1:0", run_id="loopback-test", min_nodes=1, max_nodes=1))
    try:
        info = handler.next_rendezvous()
        opened = _listening_addresses(os.getpid()) - before
        assert info.bootstrap_store_info.master_addr == "127.0.0.1"
        assert f"127.0.0.1:{info.bootstrap_store_info.master_port}" in opened
        assert len(opened) == 2 and all(a.startswith("127.0.0.1:") for a in opened), opened
    finally:
        handler.shutdown()


def test_the_memory_check_counts_each_worker_process(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    config = TrainConfig.from_argv(["--out", str(tmp_path), "--device", "cpu"])
    corpus = 10 * 2**20
    one, four = (checks.host_bytes_needed(config, 4, n, corpus) for n in (1, 4))
    model = checks.rank_bytes_needed(config, 4)
    assert one == model + checks.PROCESS_OVERHEAD_BYTES + corpus and four == 4 * one
    # Free memory for four models but not for four processes as well: refused, with the figures.
    monkeypatch.setattr(checks, "host_available_memory", lambda: int(4 * model / checks.USABLE_FRACTION) + 1)
    with pytest.raises(UsageError, match=r"for 4 rank\(s\) .* for the process and its data, per rank.*--nproc"):
        checks.check_fit(config, 4, 4, corpus)
    # In a worker the processes exist already: only the models still need memory.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    checks.check_fit(config, 4, 4, corpus)
