"""The flight recorder: its ring, what the hooks and operations tell it, the reports' diagnosis, the
dumps (on demand and on SIGTERM) and ``python -m flashfsdp.debug``.

The W = 2 diagnoses of real disagreements are in ``tests/bindings/test_disagreement.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from flashfsdp.debug import diagnose, find_dumps
from flashfsdp.debug.__main__ import main as debug_main
from flashfsdp.runtime import flight, flight_dump
from flashfsdp.runtime.flight_report import describe, first_divergence, position_of
from flashfsdp_dev.ranks import single_process_group


@pytest.fixture(autouse=True)
def fresh_recorder():
    flight.configure(16)
    yield
    flight.configure()


class _Owner:
    """A unit's hook owner: ``parent`` None makes it a root."""

    def __init__(self, parent=None):
        self.parent = parent


def test_the_ring_keeps_the_last_entries_and_their_states():
    for i in range(20):
        entry = flight.record("all_gather", (0, 1), 4 * i)
    assert [e.seq for e in flight.entries()] == list(range(5, 21))
    flight.waiting(entry)
    assert flight.position()["waiting"]["seq"] == 20
    flight.completed(entry)
    assert entry.state == flight.COMPLETED and flight.position()["waiting"] is None


def test_off_records_nothing():
    flight.configure(0)
    assert flight.record("all_gather", (0, 1), 4) is None and flight.entries() == []


def test_bad_size_from_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv(flight.ENV_ENTRIES, "many")
    with pytest.raises(ValueError, match="FLASHFSDP_FLIGHT_RECORDER='many'"):
        flight._entries_from_env()


def test_hooks_set_phase_unit_and_the_root_counts_steps():
    root = _Owner()
    saved = flight.enter_hook("pre_forward", root, "<root>")
    inner = flight.enter_hook("pre_forward", _Owner(parent=root), "layers.0")
    entry = flight.record("all_gather", (0, 1), 8)
    flight.exit_hook(inner)
    flight.exit_hook(saved)
    assert (entry.phase, entry.step, flight.position()["unit"]) == ("forward", 1, "layers.0")
    flight.exit_hook(flight.enter_hook("pre_backward", root, "<root>"))
    flight.exit_hook(flight.enter_hook("pre_forward", root, "<root>"))
    assert flight.step() == 2
    assert flight.record("all_reduce", (0, 1), 4).phase == flight.OUTSIDE


def test_an_operation_names_its_collectives_on_its_thread():
    with flight.operation("checkpoint.save"):
        entry = flight.record("control", (0, 1), 10, unit="checkpoint.save")
        assert flight.current_operation() == "checkpoint.save"
    assert entry.phase == "checkpoint.save" and flight.current_operation() is None


def test_a_backward_outside_the_hooks_is_backward():
    phases = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: phases.append(flight.current_phase()))
    y.sum().backward()
    assert phases == ["backward"]


def _entry(seq, kind, unit, phase, step, state="completed"):
    return {"seq": seq, "kind": kind, "group": [0, 1], "unit": unit, "phase": phase, "step": step, "nbytes": 64,
            "state": state, "issued_at": 0.0, "ended_at": None}


def _report(rank, entries, waiting=None, phase="forward", unit="layers.0", step=5):
    return {"rank": rank, "world_size": 2, "reason": "timeout", "error": "RuntimeError: Timed out",
            "position": {"step": step, "phase": phase, "unit": unit, "last_seq": entries[-1]["seq"] if entries else 0,
                         "waiting": waiting}, "entries": entries}


def _two_ranks():
    common = [_entry(s, "all_gather", "layers.0", "forward", 5) for s in range(400, 405)]
    rank0 = common + [_entry(405, "reduce_scatter", "layers.3", "backward", 5, "waiting")]
    rank1 = common + [_entry(405, "all_gather", "layers.0", "forward", 6, "waiting")]
    return [_report(0, rank0, rank0[-1]), _report(1, rank1, rank1[-1], step=6)]


def test_positions_and_the_first_divergence_in_words():
    reports = _two_ranks()
    assert position_of(reports[0]) == "rank 0 waits in the reduce-scatter of 'layers.3' (backward, step 5, seq 405)"
    assert position_of(reports[1]) == "rank 1 waits in the all-gather of 'layers.0' (forward, step 6, seq 405)"
    assert first_divergence(reports) == ("the ranks diverged at seq 405: rank 0 issued the reduce-scatter of "
                                         "'layers.3' (backward, step 5) where rank 1 issued the all-gather of "
                                         "'layers.0' (forward, step 6)")


def test_a_rank_past_its_last_collective_and_a_silent_rank():
    entries = [_entry(7, "reduce_scatter", "layers.1", "backward", 3)]
    report = _report(1, entries, phase="backward", unit="layers.1", step=3)
    assert position_of(report) == ("rank 1 is in backward of 'layers.1' at step 3 (its last collective: the "
                                   "reduce-scatter of 'layers.1', backward, step 3, seq 7, completed)")
    text = describe([report], missing=[0], grace_s=5)
    assert "rank 0 sent no report within 5 s" in text


def test_one_rank_issued_more_than_the_other():
    entries = [_entry(s, "all_gather", "a", "forward", 1) for s in (1, 2)]
    reports = [_report(0, entries), _report(1, entries[:1])]
    assert first_divergence(reports) == ("the ranks diverged at seq 2: rank 0 issued the all-gather of 'a' "
                                         "(forward, step 1) and rank 1 issued nothing after seq 1")


def test_dumps_are_read_back_by_the_command_line(tmp_path, capsys):
    for report in _two_ranks():
        (tmp_path / "flight").mkdir(exist_ok=True)
        (tmp_path / "flight" / f"flight_rank{report['rank']}.json").write_text(json.dumps(report))
    assert len(find_dumps(tmp_path)) == 2
    assert "the ranks diverged at seq 405" in diagnose(tmp_path)
    assert debug_main([str(tmp_path), "--entries", "2"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 waits in the reduce-scatter of 'layers.3'" in out and "seq    405" in out


def test_the_command_line_without_dumps(tmp_path, capsys):
    assert debug_main([str(tmp_path)]) == 2
    assert "no flight recorder dump" in capsys.readouterr().err


def test_dump_writes_this_ranks_ring(tmp_path, monkeypatch):
    monkeypatch.setenv(flight_dump.ENV_DIR, str(tmp_path))
    flight.record("broadcast", (0,), 4)
    path = flight_dump.dump("on demand")
    content = json.loads(open(path).read())
    assert os.path.basename(path) == "flight_rank0.json" and content["reason"] == "on demand"
    assert [e["kind"] for e in content["entries"]] == ["broadcast"]


def test_set_trace_dir_puts_dumps_in_the_run_directory(tmp_path):
    flight_dump.set_trace_dir(tmp_path, signals=False)
    try:
        assert flight_dump.trace_dir() == os.path.join(str(tmp_path), "flight")
    finally:
        flight_dump.set_trace_dir(None)
    with pytest.raises(TypeError, match="set_trace_dir: path must be"):
        flight_dump.set_trace_dir(3)


def test_sigterm_dumps_then_ends_the_process(tmp_path):
    code = ("import os, signal, time; from flashfsdp.debug import set_trace_dir; "
            f"set_trace_dir({str(tmp_path)!r}); os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGTERM
    content = json.loads((tmp_path / "flight" / "flight_rank0.json").read_text())
    assert content["reason"] == "signal SIGTERM"


def test_the_process_group_communicator_records_its_collectives():
    from flashfsdp.runtime.process_group import ProcessGroupCommunicator  # noqa: PLC0415

    with single_process_group():
        comm = ProcessGroupCommunicator()
        out = torch.zeros(4)
        work = comm.all_gather_into_tensor(out, torch.ones(4))
        work.set_unit("layers.7")
        work.wait()
        comm.all_reduce(torch.ones(3)).wait()
    first, second = flight.entries()[-2:]
    assert (first.kind, first.unit, first.nbytes, first.state) == ("all_gather", "layers.7", 16, flight.COMPLETED)
    assert (second.kind, second.nbytes, second.group) == ("all_reduce", 12, (0,))


def test_a_watchdog_timeout_dumps_at_once_and_names_the_position(tmp_path, monkeypatch):
    from flashfsdp.runtime.nccl_watchdog import CollectiveTimeout, Watchdog  # noqa: PLC0415

    monkeypatch.setenv(flight_dump.ENV_DIR, str(tmp_path))
    dog = Watchdog("comm(rank 0 of 2)", 0.01, lambda: None, lambda: None, poll_s=10)
    entry = flight.record("reduce_scatter", (0, 1), 64, unit="layers.1")
    dog.register("reduce_scatter_tensor", lambda: False, entry).unit = "layers.1"
    done = flight.record("all_gather", (0, 1), 64, unit="layers.0")
    dog.register("all_gather_into_tensor", lambda: True, done)
    import time  # noqa: PLC0415

    time.sleep(0.02)
    assert isinstance(dog.poll(), CollectiveTimeout)
    assert done.state == flight.COMPLETED and entry.state == flight.FAILED
    assert json.loads((tmp_path / "flight_rank0.json").read_text())["reason"] == "watchdog: CollectiveTimeout"
    with pytest.raises(CollectiveTimeout, match=r"(?s)did not complete.*rank 0 waits in the reduce-scatter of "
                                                r"'layers.1'"):
        dog.raise_if_failed()


def test_the_application_sets_the_step_its_collectives_belong_to():
    root = _Owner()
    flight.set_step(7)  # (the training job's step: evaluation batches and micro-batches count for nothing)
    try:
        for _ in range(3):
            flight.exit_hook(flight.enter_hook("pre_forward", root, "<root>"))
        assert flight.step() == 7 and flight.record("all_gather", (0, 1), 8).step == 7
        with pytest.raises(TypeError, match="set_step: step must be an int"):
            flight.set_step("8")
    finally:
        flight.set_step(None)
    flight.exit_hook(flight.enter_hook("pre_forward", root, "<root>"))
    assert flight.step() == 8  # counted again, from the step set last


def test_a_sigterm_stop_handled_by_the_application_is_a_notice_not_an_error(tmp_path):
    # the training job's own SIGTERM handler stops after the step: the dump is no error
    code = ("import os, signal, time; from flashfsdp import log; from flashfsdp.debug import set_trace_dir; "
            "log.configure(prefix='job'); stopped = []; signal.signal(signal.SIGTERM, lambda *a: stopped.append(1)); "
            f"set_trace_dir({str(tmp_path)!r}); os.kill(os.getpid(), signal.SIGTERM); time.sleep(0.5); "
            "assert stopped, 'the application handler did not run'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "ring written to" in proc.stderr and "error" not in proc.stderr, proc.stderr
    assert json.loads((tmp_path / "flight" / "flight_rank0.json").read_text())["reason"] == "signal SIGTERM"


_BLOCKED_RANK = """
import datetime, os, sys, time
import torch, torch.distributed as dist
rank, store, trace = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=120))
from flashfsdp.debug import set_desync_window, set_trace_dir
from flashfsdp.runtime.process_group import ProcessGroupCommunicator
set_desync_window(0)  # (off: a plain gloo wait, blocked in C++ until the collective returns)
set_trace_dir(trace)
comm = ProcessGroupCommunicator()
if rank == 1:
    time.sleep(120)  # never issues the all-reduce
open(trace + "/blocked", "w").close()
comm.all_reduce(torch.ones(4)).wait()
"""


def test_sigterm_while_blocked_in_a_gloo_collective_dumps_at_once(tmp_path):
    import time  # noqa: PLC0415

    trace = tmp_path / "trace"
    trace.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, "-c", _BLOCKED_RANK, str(r), str(tmp_path / "store"), str(trace)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for r in (0, 1)]
    try:
        deadline = time.monotonic() + 90
        while not (trace / "blocked").exists() and time.monotonic() < deadline and procs[0].poll() is None:
            time.sleep(0.1)
        assert (trace / "blocked").exists(), procs[0].stderr.read() if procs[0].poll() is not None else "not blocked"
        time.sleep(1.0)  # inside the all-reduce's wait now
        procs[0].send_signal(signal.SIGTERM)
        dump = trace / "flight" / "flight_rank0.json"
        # at once, not when the collective gives up (its 120 s timeout): 30 s leaves room for a busy machine
        deadline = time.monotonic() + 30
        while not dump.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert dump.exists(), "no dump within 30 s of SIGTERM while blocked in the collective (timeout 120 s)"
        content = json.loads(dump.read_text())
        assert content["reason"] == "signal SIGTERM" and content["position"]["waiting"]["kind"] == "all_reduce"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
