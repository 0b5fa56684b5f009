"""The desync window (``flashfsdp.runtime.flight_desync``): its setting, the verdict on published
positions, and the NCCL watchdog's side of it, whose Python code is tested here on the CPU (two
gloo ranks provide the store; the collectives it watches are stand-ins that never complete).

The training-level cases (a save against a forward, uneven batches, a skipped backward, differing
gradient sync, a slow rank) are in ``tests/bindings/test_disagreement.py``.
"""

from __future__ import annotations

import time

import pytest

from flashfsdp.runtime import flight, flight_desync
from tests.harness import run_distributed

WINDOW_S = 1.0


def _waiting(rank: int, gseq: int, kind: str = "all_gather", nbytes: int = 64, channel: str = "data:0",
             group=(0, 1), issued: dict | None = None, recent: list | None = None) -> dict:
    """A published position: ``rank`` waits on collective ``gseq`` of ``channel``."""
    entry = {"seq": gseq, "channel": channel, "gseq": gseq, "kind": kind, "unit": "layers.0", "nbytes": nbytes,
             "group": list(group), "phase": "forward", "step": 1}
    return {"rank": rank, "waiting": entry, "issued": issued if issued is not None else {channel: gseq},
            "recent": recent if recent is not None else [entry]}


def test_the_window_setting_and_its_variable():
    assert flight_desync._parse(None) == flight_desync.DEFAULT_WINDOW_S
    assert flight_desync._parse("2.5") == 2.5 and flight_desync._parse("0") is None
    for bad in ("soon", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match="FLASHFSDP_DESYNC_WINDOW"):
            flight_desync._parse(bad)
    with pytest.raises(ValueError, match="set_desync_window"):
        flight_desync.set_window(-3)
    try:
        flight_desync.set_window(0)
        assert flight_desync.window() is None
    finally:
        flight_desync.set_window()
    assert flight_desync.window() == flight_desync.DEFAULT_WINDOW_S


def test_the_same_collective_on_both_ranks_is_slow_not_desynced():
    assert flight_desync.stuck_ranks({0: _waiting(0, 5), 1: _waiting(1, 5)}) == set()


def test_one_number_issued_as_two_collectives_is_a_desync():
    reports = {0: _waiting(0, 5), 1: _waiting(1, 5, kind="reduce_scatter", nbytes=128)}
    assert flight_desync.stuck_ranks(reports) == {0, 1}
    text = flight_desync.describe_stuck(reports, {0, 1}, 2.0)
    assert text.startswith("ranks 0, 1 wait on collectives that cannot pair (found after the 2 s desync window)")
    assert "rank 0 waits on the all-gather of 'layers.0'" in text and "another rank issued as another" in text


def test_ranks_waiting_on_each_other_on_two_channels_are_a_desync():
    # rank 0 waits on the data group's #5, which rank 1 never issued; rank 1 on the control
    # group's #2, which rank 0 never issued
    rank0 = _waiting(0, 5, issued={"data:0": 5, "control:1": 1})
    rank1 = _waiting(1, 2, kind="control", channel="control:1", issued={"data:0": 4, "control:1": 2})
    assert flight_desync.stuck_ranks({0: rank0, 1: rank1}) == {0, 1}


def test_a_rank_that_published_nothing_may_still_come():
    # rank 1 computes (no position): rank 0 keeps waiting
    assert flight_desync.stuck_ranks({0: _waiting(0, 5)}) == set()
    # rank 2 waits for rank 1 that is busy elsewhere; rank 0 waits for rank 2, which issued it
    reports = {0: _waiting(0, 5, group=(0, 2)), 2: _waiting(2, 7, group=(1, 2), channel="data:1")}
    assert flight_desync.stuck_ranks(reports) == set()


class _Store:
    """The part of a torch Store the desync check uses, in memory."""

    def __init__(self):
        self.data = {}

    def set(self, key, value):
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key):
        return self.data[key]

    def check(self, keys):
        return all(k in self.data for k in keys)


def test_the_check_publishes_reads_and_clears(monkeypatch):
    store = _Store()
    monkeypatch.setattr(flight_desync, "_store", lambda: (store, 0))
    flight.configure(16)
    try:
        entry = flight.record("all_gather", (0, 1), 64, unit="layers.0", channel="data:0")
        import json  # noqa: PLC0415

        slow = flight_desync.Stall(entry)  # rank 1 waits on the same collective: slow
        store.set("flashfsdp/desync/1", json.dumps(_waiting(1, entry.gseq)))
        assert slow.check() is None and json.loads(store.get("flashfsdp/desync/0"))["waiting"]["gseq"] == 1
        slow.close()  # the wait ended: the position is cleared
        assert json.loads(store.get("flashfsdp/desync/0")) == {"rank": 0, "waiting": None}

        store.set("flashfsdp/desync/1", json.dumps(_waiting(1, entry.gseq, nbytes=999)))
        stall = flight_desync.Stall(entry)
        verdict = stall.check()
        assert verdict is not None and "ranks 0, 1 wait on collectives that cannot pair" in verdict
        assert stall.check() is None  # (not due yet: the next look waits POLL_S)
        stall.close()  # found stuck: the position stays, for the other ranks to find the same
        assert json.loads(store.get("flashfsdp/desync/0"))["waiting"]["nbytes"] == 64
    finally:
        flight.configure()


# ------------------------------------------------------------------ the NCCL watchdog's Python side
def _watchdog_rank(rank: int, world_size: int, desynced: bool) -> tuple:
    """Rank ``rank`` registers a stand-in NCCL all-gather that never completes with its watchdog
    (rank 1's has another size when ``desynced``) and polls: (the error's class, its message,
    seconds from the registration to the error), or (None, None, seconds polled) when none came
    within the window + 3 s (matching collectives: nothing to find) or + 60 s (a desync: room for a
    busy machine; the watchdog's timeout is 1800 s)."""
    from flashfsdp.runtime.nccl_watchdog import Watchdog  # noqa: PLC0415

    flight.configure(16)
    flight_desync.set_window(WINDOW_S)
    try:
        entry = flight.record("all_gather", (0, 1), 64 * (1 + (desynced and rank == 1)), unit="layers.0",
                              channel="nccl:stand-in")
        dog = Watchdog(f"comm(rank {rank} of 2)", 1800.0, lambda: None, lambda: None, poll_s=0.05)
        dog.register("all_gather_into_tensor", lambda: False, entry).unit = "layers.0"
        start = time.monotonic()
        while time.monotonic() - start < WINDOW_S + (60 if desynced else 3) and dog.poll() is None:
            time.sleep(0.05)
        seconds = time.monotonic() - start
        if dog.error is None:
            return None, None, seconds
        try:
            dog.raise_if_failed()
        except Exception as exc:  # noqa: BLE001 - the result
            return type(exc).__name__, str(exc), seconds
        return "not raised", None, seconds
    finally:
        flight_desync.set_window()
        flight.configure()


def test_the_nccl_watchdog_aborts_a_desync_on_every_rank_within_the_window():
    for kind, message, seconds in run_distributed(_watchdog_rank, 2, True, timeout=120):
        assert kind == "CollectiveDesync", message
        assert "is still in flight after the 1 s desync window" in message
        assert "the communicator was aborted" in message
        assert WINDOW_S <= seconds < WINDOW_S + 60  # by the window, not the 1800 s timeout


def test_the_nccl_watchdog_keeps_waiting_when_the_ranks_wait_on_the_same_collective():
    for kind, message, seconds in run_distributed(_watchdog_rank, 2, False, timeout=120):
        assert (kind, message) == (None, None) and seconds >= WINDOW_S + 3
