"""flashfsdp.profile(): spans per unit and step, communication and exposed communication, the
Chrome trace export, and the torch.profiler labels."""

from __future__ import annotations

import json
import time

import pytest
import torch

import flashfsdp
from flashfsdp.runtime import trace
from flashfsdp.runtime.communicator import LocalCommunicator, Work
from flashfsdp.runtime.trace_spans import COMM_KINDS
from tests.harness import run_distributed
from tests.models import loss_fn, make_batch
from tests.training import local_rows, make_model, units_of

SLEEP_S = 0.04  # per MLP block forward, in the configuration that adds compute between collectives
STEPS = 2


def _train(kind: str, rank: int, world_size: int, sleep_s: float = 0.0, path: str | None = None) -> dict:
    """One warm-up step (records the execution order the prefetch follows), then ``STEPS`` profiled
    steps; every block's forward sleeps ``sleep_s`` (compute between issue and wait)."""
    model = make_model(kind)
    units = units_of(kind, model)
    for unit in units:
        flashfsdp.fully_shard(unit)
    model.set_bucket_bytes(0)  # spans per unit (a bucket's collectives: tests/bindings/test_buckets.py)
    blocks = units[:-2] if kind == "mlp" else units[:-1]
    for block in blocks:  # after fully_shard's own pre-hook: inside the block's forward span
        block.register_forward_pre_hook(lambda module, args: time.sleep(sleep_s))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(i: int) -> None:
        x, y = make_batch(kind, i, 2 * world_size)
        loss_fn(kind, model(local_rows(x, rank, world_size)), local_rows(y, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()

    step(0)
    with flashfsdp.profile("cpu") as prof:
        t0 = time.perf_counter()
        for i in range(STEPS):
            step(i + 1)
        wall_ms = (time.perf_counter() - t0) * 1e3
    if path is not None:
        prof.export_chrome_trace(path)
    return {"kinds": {(s.kind, s.unit, s.stream) for s in prof.spans}, "summary": prof.summary(),
            "compute": prof.unit_compute_ms(), "steps": prof.step, "wall_ms": wall_ms,
            "n_spans": len(prof.spans),
            "spans": [(s.kind, s.unit, s.stream, s.step, s.start, s.end) for s in prof.spans]}


def _profiled(rank: int, world_size: int, path: str) -> dict:
    return {"llama": _train("llama", rank, world_size, path=path if rank == 0 else None),
            "mlp_sleep": _train("mlp", rank, world_size, SLEEP_S)}


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    """Every W = 2 gloo configuration, in one run of two ranks."""
    path = str(tmp_path_factory.mktemp("trace") / "trace.json")
    return run_distributed(_profiled, 2, path), path


def _check_bounds(r: dict) -> None:
    """Exposed communication lies inside communication, and both inside the profiled wall time."""
    s = r["summary"]
    assert s["inexact_spans"] == 0  # gloo reports every completion
    assert s["exposed_ms"] <= s["comm_ms"] + 1e-6
    assert s["exposed_ms"] <= r["wall_ms"]
    for stream, busy in s["comm_streams_ms"].items():  # a stream's busy time is a union: <= wall
        assert 0 < busy <= r["wall_ms"], stream
    assert sum(u["comm_ms"] for u in s["units"].values()) == pytest.approx(s["comm_ms"])
    assert sum(u["exposed_ms"] for u in s["units"].values()) == pytest.approx(s["exposed_ms"])


def test_profile_records_every_phase_per_unit(w2):
    results, _ = w2
    for r in (rank["llama"] for rank in results):
        assert r["steps"] == STEPS
        for unit in ("<root>", "layers.0", "layers.1"):
            for kind, stream in [("copy_in", "all_gather"), ("all_gather", "all_gather"), ("forward", "compute"),
                                 ("backward", "compute"), ("pack", "reduce_scatter"),
                                 ("reduce_scatter", "reduce_scatter"), ("accumulate", "reduce_scatter"),
                                 ("wait_all_gather", "compute"), ("wait_reduce_scatter", "compute")]:
                assert (kind, unit, stream) in r["kinds"], (kind, unit)
        s = r["summary"]
        assert s["comm_ms"] > 0 and s["compute_ms"] > 0
        assert set(s["comm_streams_ms"]) == {"all_gather", "reduce_scatter"}
        assert set(s["units"]) == {"<root>", "layers.0", "layers.1"}
        _check_bounds(r)
        # Own compute time: the root's forward excludes its blocks' forwards.
        assert all(v["forward"] >= 0 and v["backward"] >= 0 for v in r["compute"].values())


def _waits_after_their_collectives(spans: list[tuple]) -> list[tuple[tuple, tuple]]:
    """Each collective span with the wait recorded with it (just before it in the list)."""
    pairs = []
    for i, span in enumerate(spans):
        if span[0] in COMM_KINDS:
            wait = spans[i - 1]
            assert (wait[0], wait[1], wait[3]) == (f"wait_{span[0]}", span[1], span[3]), (span, wait)
            pairs.append((span, wait))
    return pairs


def test_communication_spans_end_no_later_than_their_waits(w2):
    """W = 2 gloo, with compute between the prefetches and their waits: every collective ends
    when its Work completed, never after its wait returned, and the bounds hold (orderings only:
    no assertion on how long anything took)."""
    results, _ = w2
    for rank in results:
        run = rank["mlp_sleep"]
        _check_bounds(run)
        pairs = _waits_after_their_collectives(run["spans"])
        assert pairs
        for comm, wait in pairs:
            start, end, wait_end = comm[4], comm[5], wait[5]
            assert start <= end <= wait_end, (comm, wait)


def test_chrome_trace_has_one_track_per_stream_with_its_span_kinds(w2):
    results, path = w2
    events = json.load(open(path))["traceEvents"]
    tracks = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert set(tracks) == {"compute stream", "all_gather stream", "reduce_scatter stream"}
    assert len(set(tracks.values())) == 3
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == results[0]["llama"]["n_spans"]
    kinds_on = {name.split()[0]: set() for name in tracks}
    for e in spans:
        kind, unit = e["name"].split("::")
        assert (e["cat"], e["args"]["unit"]) == (kind, unit)
        assert e["tid"] == tracks[f"{e['args']['stream']} stream"]
        assert e["args"]["step"] in range(1, STEPS + 1) and e["args"]["exact"] is True
        assert e["ts"] >= 0 and e["dur"] >= 0
        kinds_on[e["args"]["stream"]].add(kind)
    assert kinds_on == {"compute": {"forward", "backward", "wait_all_gather", "wait_reduce_scatter"},
                        "all_gather": {"copy_in", "all_gather"},
                        "reduce_scatter": {"pack", "reduce_scatter", "accumulate"}}
    assert {e["args"]["unit"] for e in spans} == {"<root>", "layers.0", "layers.1"}
    # Every unit gathers, reduces and accumulates at every step.
    for step in range(1, STEPS + 1):
        for kind in ("all_gather", "reduce_scatter", "accumulate"):
            units = {e["args"]["unit"] for e in spans if e["cat"] == kind and e["args"]["step"] == step}
            assert units == {"<root>", "layers.0", "layers.1"}, (kind, step)


def test_communication_time_excludes_the_compute_between_issue_and_wait():
    """W = 1 (LocalCommunicator): the collectives complete inside the call that issues them, so a
    prefetched all-gather's span ends before the block compute that runs between its issue and
    its wait begins, and the compute stream never waits (orderings, not durations)."""
    r = _train("mlp", 0, 1, SLEEP_S)
    s = r["summary"]
    forwards = [span for span in r["spans"] if span[0] == "forward"]
    spanned = 0
    for comm, wait in _waits_after_their_collectives(r["spans"]):
        assert comm[5] <= wait[4], (comm, wait)  # completed before its wait started
        # a prefetch: another unit's forward ran between the issue and the wait
        spanned += any(comm[4] <= f[4] and f[5] <= wait[4] and f[1] != comm[1] for f in forwards)
    assert spanned > 0
    assert s["exposed_ms"] == 0.0
    assert ("all_gather", "blocks.1", "all_gather") in r["kinds"]
    assert sum(u["comm_ms"] for u in s["units"].values()) == pytest.approx(s["comm_ms"])


class _UntimedWork(Work):
    """A third-party Work that can wait and poll but cannot say when it completed."""

    def __init__(self, work: Work):
        self.work = work

    def wait(self) -> None:
        self.work.wait()

    def is_completed(self) -> bool:
        return self.work.is_completed()


class _UntimedCommunicator(LocalCommunicator):
    def all_gather_into_tensor(self, out, inp):
        return _UntimedWork(super().all_gather_into_tensor(out, inp))

    def reduce_scatter_tensor(self, out, inp, op="sum"):
        return _UntimedWork(super().reduce_scatter_tensor(out, inp, op))


def test_collectives_without_a_completion_time_are_bounded_and_marked():
    """Completed before the wait started: the span ends at the wait's start, marked inexact."""
    model = make_model("mlp")
    for unit in units_of("mlp", model):
        flashfsdp.fully_shard(unit, communicator=_UntimedCommunicator())
    x, y = make_batch("mlp", 0, 4)
    loss_fn("mlp", model(x), y).backward()
    with flashfsdp.profile("cpu") as prof:
        loss_fn("mlp", model(x), y).backward()
    comm = [(i, s) for i, s in enumerate(prof.spans) if s.kind in COMM_KINDS]
    assert comm and all(not s.exact for _, s in comm)
    assert prof.summary()["inexact_spans"] == len(comm)
    for i, s in comm:
        wait = prof.spans[i - 1]  # recorded with it, just before
        assert (wait.kind, wait.unit) == (f"wait_{s.kind}", s.unit)
        assert s.end == wait.start  # the upper bound: no later than the wait began


UNITS = ("blocks.0", "blocks.1", "blocks.2", "shift", "<root>")
PHASES = ("copy_in", "all_gather", "wait_all_gather", "pack", "reduce_scatter", "wait_reduce_scatter", "accumulate",
          "pre_forward", "post_forward", "pre_backward", "post_backward")


def test_torch_profiler_shows_every_phase_without_flashfsdp_profile():
    model = make_model("mlp")
    for unit in units_of("mlp", model):
        flashfsdp.fully_shard(unit)
    model.set_bucket_bytes(0)  # every phase per unit
    x, y = make_batch("mlp", 0, 4)
    loss_fn("mlp", model(x), y).backward()  # records the order the prefetch follows
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tprof:
        loss_fn("mlp", model(x), y).backward()
    assert trace.active() is None
    names = {e.name for e in tprof.events() if e.name.startswith("flashfsdp::")}
    missing = {f"flashfsdp::{phase}::{unit}" for phase in PHASES for unit in UNITS} - names
    assert not missing, sorted(missing)


def test_labels_cost_nothing_without_a_torch_profiler():
    assert not trace.torch_profiler_enabled()
    assert trace.label("all_gather", "layers.0") is trace.label("pack", "<root>")  # one shared no-op
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert trace.torch_profiler_enabled()
        assert isinstance(trace.label("all_gather", "layers.0"), torch.profiler.record_function)


class _Hooks:
    """What the bindings' hooks look like to ``trace.labelled``: an object with a named unit."""

    def __init__(self, name: str):
        self.name = name

    @trace.labelled("pre_forward", lambda self: self.name)
    def pre_forward(self, x: int) -> int:
        return x + 1


def test_labelled_hooks_appear_in_torch_profiler_and_pass_results_through():
    hooks = _Hooks("layers.3")
    assert hooks.pre_forward(1) == 2
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tprof:
        assert hooks.pre_forward(2) == 3
    assert "flashfsdp::pre_forward::layers.3" in {e.name for e in tprof.events()}
    assert _Hooks.pre_forward.__name__ == "pre_forward"


def test_profiles_do_not_nest():
    with flashfsdp.profile():
        with pytest.raises(RuntimeError, match="profiles do not nest"):
            with flashfsdp.profile():
                pass


def test_profile_rejects_an_unknown_device_type():
    with pytest.raises(ValueError, match="device_type must be 'cpu' or 'cuda', got 'tpu'"):
        with flashfsdp.profile("tpu"):
            pass
