"""flashfsdp.sim.engine: FIFO side streams on the compute stream's clock, link sharing, host
contention and peers' issue and end times."""

from __future__ import annotations

import pytest

from flashfsdp.sim import Contention
from flashfsdp.sim.engine import CommEngine, CommOp


def _op(stream: str, seconds: float, issue: float = 0.0, **kwargs) -> CommOp:
    """A collective of ``seconds`` on the link (no latency phase)."""
    return CommOp(stream, stream, "u", issue, [[seconds, True, True]], **kwargs)


def test_one_stream_is_first_in_first_out():
    engine = CommEngine(share_link=False, contention=None)
    a, b = _op("all_gather", 1.0), _op("all_gather", 0.5)
    engine.issue(a)
    engine.issue(b)
    assert engine.compute(0.25) == pytest.approx(0.25)  # compute does not slow the collectives
    assert engine.finish(b) == pytest.approx(1.5)
    assert (a.start, a.end, b.start) == (0.0, pytest.approx(1.0), pytest.approx(1.0))


def test_two_streams_run_at_once_or_share_the_link():
    for share, end in ((False, 1.0), (True, 2.0)):
        engine = CommEngine(share_link=share, contention=None)
        ag, rs = _op("all_gather", 1.0), _op("reduce_scatter", 1.0)
        engine.issue(ag)
        engine.issue(rs)
        engine.drain()
        assert ag.end == pytest.approx(end) and rs.end == pytest.approx(end)


def test_contention_slows_compute_and_the_collective_in_flight():
    engine = CommEngine(share_link=False, contention=Contention(0.5, 0.25))
    op = _op("all_gather", 0.5)
    engine.issue(op)
    # 0.5 s of collective at rate 0.25 takes 2 s, during which compute runs at half speed: 1 s of
    # compute needs those 2 s, then nothing is left in flight.
    assert engine.compute(1.0) == pytest.approx(2.0)
    assert op.end == pytest.approx(2.0)
    assert engine.compute(1.0) == pytest.approx(3.0)  # alone again: full speed


def test_a_collective_waits_for_the_peers():
    engine = CommEngine(share_link=False, contention=None)
    op = _op("all_gather", 0.5, ready=2.0, done_after=3.0)
    engine.issue(op)
    assert engine.started(op) == pytest.approx(2.0)  # not before the last rank issued it
    assert engine.finish(op) == pytest.approx(3.0)  # not before the last rank finished it


def test_waiting_on_nothing_issued_is_an_error():
    engine = CommEngine(share_link=False, contention=None)
    with pytest.raises(RuntimeError, match="never issued"):
        engine.finish(_op("all_gather", 1.0))
