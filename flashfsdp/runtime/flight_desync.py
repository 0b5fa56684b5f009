"""The desync window: ranks that wait on collectives that can never pair say so within seconds.

A job whose ranks stopped issuing the same collectives (one saves while another runs a forward,
one skipped a backward, ran one batch more, changed its gradient sync) waits until the process
group's timeout — 30 minutes with gloo's default, 10 with NCCL's — before ``divergence.py`` can
name where each rank is. So a flashfsdp collective still incomplete after the **desync window**
(:data:`DEFAULT_WINDOW_S` seconds; ``FLASHFSDP_DESYNC_WINDOW=<seconds>``, 0 for off; or
:func:`set_window`) makes its rank compare positions with the others' through the default
group's store:

1. it publishes its position under ``flashfsdp/desync/<rank>``: the collective it waits on (its
   channel, the process group it runs on, and its number there, ``Entry.gseq``) and how many
   collectives it has issued on every channel (``flight.issued``), with its last few entries;
2. it reads the positions the ranks of that collective published (and, in turn, those of the
   ranks they wait on: at most :data:`MAX_READS` per look), and works out which ranks can never
   complete (:func:`stuck_ranks`): a rank waits for each rank of its collective that has not issued
   that collective's number on that channel; a rank is stuck when one of those is stuck, or when a
   rank issued that number as another collective (kind, unit or size differ); ranks that published
   nothing (busy computing, loading, not in a flashfsdp collective) may still come, so a rank that
   waits only for them is not stuck;
3. a stuck rank raises :class:`DesyncError`, which the caller turns into ``divergence.failure``'s
   ``CollectiveFailure`` naming every rank's position, on every stuck rank at about the same time
   (each looks every :data:`POLL_S` seconds or so once past its window, and a rank found stuck
   leaves its position published: the others find the same desync); a rank whose peers wait
   on the same collective (slow, not desynced) or have not published keeps waiting, and looks again
   (less often the longer it waits), until the collective completes or the group's timeout.

Why this is sound: a published position stays true while its rank waits (it issues nothing
meanwhile, and it clears the key when the wait ends), and "has not issued" only becomes false
when that rank issues, which a waiting rank does not do. So if every rank of a cycle waits for
the next one, the first of them to complete would have needed another to complete before it:
none completes.

Nothing is read or written while collectives complete within the window: the common path is a
wait with a timeout (gloo's ``Work.wait(timeout)``, which leaves the work pending when it times
out). gloo cannot cancel a collective: after the error the one waited on stays pending (its
buffers held) until the group is destroyed or times out; a job that got this error should end
(the training job's workers exit). The NCCL watchdog (``nccl_watchdog.py``) applies the same
window to the collectives it watches and aborts the communicator on a desync.
"""

from __future__ import annotations

import datetime
import json
import os
import time

from flashfsdp.log import get_logger

from . import flight

ENV_WINDOW = "FLASHFSDP_DESYNC_WINDOW"
DEFAULT_WINDOW_S = 5.0
POLL_S, MAX_POLL_S = 0.2, 2.0  # seconds between two looks once past the window (growing to the max)
MAX_READS = 32  # positions read per look
RECENT = 64  # entries a position carries
_PREFIX = "flashfsdp/desync"
_log = get_logger(__name__)


class DesyncError(RuntimeError):
    """A collective outlasted the desync window while the ranks wait on collectives that cannot
    pair (see the module docstring); the message says which. ``divergence.failure`` turns it into
    the ``CollectiveFailure`` raised, whose message names every rank's position."""

    reason = "desync"


def _parse(raw: str | None) -> float | None:
    """Seconds from ``FLASHFSDP_DESYNC_WINDOW``'s value (None: off); unset or blank: the default.

    Raises:
        ValueError: not a number >= 0 (named with the variable).
    """
    if raw is None or not raw.strip():
        return DEFAULT_WINDOW_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"{ENV_WINDOW}={raw!r}: set it to the seconds a collective may wait before the ranks "
                         f"compare their positions (0: off)")
    return value or None


_window: list = [_parse(os.environ.get(ENV_WINDOW))]  # seconds or None (off)
_timedelta: list = [None if _window[0] is None else datetime.timedelta(seconds=_window[0])]


def set_window(seconds: float | None = DEFAULT_WINDOW_S) -> None:
    """Compare positions after ``seconds`` of waiting from now on (0 or None: never).

    Raises:
        ValueError: ``seconds`` is negative, infinite or not a number.
    """
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                or not 0 <= seconds < float("inf")):
        raise ValueError(f"set_desync_window: seconds must be a number >= 0 or None, got {seconds!r}")
    _window[0] = seconds or None
    _timedelta[0] = None if not seconds else datetime.timedelta(seconds=seconds)


def window() -> float | None:
    """The desync window in seconds, None when off."""
    return _window[0]


def wait(work, entry) -> None:
    """``work.wait()`` of a gloo collective whose flight entry is ``entry``, watched past the window.

    Raises:
        DesyncError: the ranks wait on collectives that cannot pair (see the module docstring).
        Exception: what ``work.wait()`` raises (a timeout, a closed connection).
    """
    window_td = _timedelta[0]
    if window_td is None or entry is None:
        work.wait()
        return
    try:
        work.wait(window_td)
        return
    except RuntimeError:
        if work.is_completed():  # (failed, not timed out: the backend's error)
            raise
    stall = Stall(entry)
    try:
        while True:
            verdict = stall.check()
            if verdict is not None:
                raise DesyncError(verdict)
            try:
                work.wait(datetime.timedelta(seconds=stall.pause))
                return
            except RuntimeError:
                if work.is_completed():
                    raise
    finally:
        stall.close()


def _store():
    import torch.distributed as dist  # noqa: PLC0415 - light module: torch only when asked

    if not (dist.is_available() and dist.is_initialized()):
        return None, 0
    from flashfsdp._torch_private import get_default_store  # noqa: PLC0415

    return get_default_store(), dist.get_rank()


def brief(entry) -> dict:
    """What a position says of one collective (JSON values)."""
    return {"seq": entry.seq, "channel": entry.channel, "gseq": entry.gseq, "kind": entry.kind,
            "unit": entry.unit, "nbytes": entry.nbytes, "group": list(entry.group or ()), "phase": entry.phase,
            "step": entry.step}


class Stall:
    """One wait past the window: :meth:`check` publishes this rank's position and compares it with
    the others' (at most every :attr:`pause` seconds, growing), :meth:`close` clears it."""

    def __init__(self, entry):
        self.entry = entry
        self.pause = POLL_S
        self._next = 0.0
        self._published_seq = None  # flight.last_seq when this rank's position was published
        self._store, self.rank = _store()
        self._key = f"{_PREFIX}/{self.rank}"
        self.found = False  # whether check found this rank stuck

    def check(self) -> str | None:
        """The desync in words (:func:`describe_stuck`) when this rank can never complete its
        collective, else None (also before the next look is due, without a store, or when the
        store fails)."""
        now = time.monotonic()
        if self._store is None or now < self._next:
            return None
        self._next, self.pause = now + self.pause, min(self.pause * 1.5, MAX_POLL_S)
        try:
            mine = self._publish()
            reports = read_positions(self._store, mine)
        except Exception as exc:  # noqa: BLE001 - a store that fails tells nothing: keep waiting
            _log.warning("flashfsdp desync check: the store failed (%s); waiting on", exc)
            return None
        stuck = stuck_ranks(reports)
        if self.rank not in stuck:
            return None
        self.found = True  # (the position stays published: see close)
        return describe_stuck(reports, stuck, _window[0])

    def _publish(self) -> dict:
        mine = {"rank": self.rank, "waiting": brief(self.entry), "issued": flight.issued(),
                "recent": [brief(e) for e in flight.entries()[-RECENT:]]}
        last = flight.last_seq()
        if last != self._published_seq:  # (a rank that issues more while it waits: NCCL's streams)
            self._store.set(self._key, json.dumps(mine))
            self._published_seq = last
        return mine

    def close(self) -> None:
        """The wait ended (or raised): the position published is no longer true, and is cleared;
        except after this rank was found stuck, when it stays true (the collective can never
        complete, and gloo cannot cancel it) and stays published, so that every other rank of the
        desync finds it too, whatever its own window's phase (the job is to end: a new job's store
        starts empty)."""
        if self._published_seq is not None and not self.found:
            try:
                self._store.set(self._key, json.dumps({"rank": self.rank, "waiting": None}))
            except Exception:  # noqa: BLE001 - a failed store: the other ranks stop reading it too
                pass
            self._published_seq = None


def read_positions(store, mine: dict) -> dict[int, dict]:
    """``mine`` and the positions published by the ranks this rank waits on, and by the ranks those
    wait on in turn (at most :data:`MAX_READS` looked up), by rank; ranks with none are absent."""
    reports, looked = {mine["rank"]: mine}, {mine["rank"]}
    queue = [r for r in mine["waiting"]["group"] if r not in looked]
    while queue and len(looked) <= MAX_READS:
        rank = queue.pop(0)
        if rank in looked:
            continue
        looked.add(rank)
        key = f"{_PREFIX}/{rank}"
        if not store.check([key]):
            continue
        report = json.loads(store.get(key))
        if isinstance(report, dict) and isinstance(report.get("waiting"), dict):
            reports[rank] = report
            queue += [r for r in report["waiting"].get("group") or () if r not in looked]
    return reports


def _signature(entry: dict) -> tuple:
    """What must match for two ranks' collectives of the same number on one channel to pair."""
    if entry["kind"] == "control":  # (the payloads' lengths differ by rank)
        return ("control",)
    return entry["kind"], entry.get("unit"), entry.get("nbytes")


def _blocking(report: dict, reports: dict[int, dict]) -> tuple[bool, list[int]]:
    """(whether a rank issued ``report``'s collective number as another collective, the reported
    ranks that have not issued it yet)."""
    waiting = report["waiting"]
    channel, number, mine = waiting["channel"], waiting["gseq"], _signature(waiting)
    mismatch, behind = False, []
    for rank in waiting["group"]:
        other = reports.get(rank)
        if rank == report["rank"] or other is None:
            continue
        if int((other.get("issued") or {}).get(channel, 0)) < number:
            behind.append(rank)
            continue
        theirs = next((e for e in other.get("recent") or () if e["channel"] == channel and e["gseq"] == number), None)
        mismatch |= theirs is not None and _signature(theirs) != mine
    return mismatch, behind


def stuck_ranks(reports: dict[int, dict]) -> set[int]:
    """The reported ranks whose collective can never complete (see the module docstring): the
    greatest set in which each rank either waits on a collective another rank issued as another
    one, or waits for a rank of the set that has not issued it."""
    edges = {rank: _blocking(report, reports) for rank, report in reports.items()}
    stuck = set(reports)
    changed = True
    while changed:
        changed = False
        for rank in list(stuck):
            mismatch, behind = edges[rank]
            if not mismatch and not any(r in stuck for r in behind):
                stuck.discard(rank)
                changed = True
    return stuck


def _where(entry: dict) -> str:
    from .flight_report import collective  # noqa: PLC0415

    return f"{collective(entry)} (#{entry['gseq']} on its group {tuple(entry['group'])}, seq {entry['seq']})"


def describe_stuck(reports: dict[int, dict], stuck: set[int], window_s: float | None) -> str:
    """A first line (the window; what the errors built from it repeat), then a line per stuck rank:
    the collective it waits on and why it cannot complete."""
    who = ", ".join(map(str, sorted(stuck)))
    lines = [f"{'ranks' if len(stuck) > 1 else 'rank'} {who} wait{'' if len(stuck) > 1 else 's'} on collectives "
             f"that cannot pair (found after the {window_s or 0:g} s desync window)"]
    for rank in sorted(stuck):
        mismatch, behind = _blocking(reports[rank], reports)
        why = "which another rank issued as another collective" if mismatch else \
            "which " + ", ".join(f"rank {r}" for r in behind if r in stuck) + " has not issued"
        lines.append(f"rank {rank} waits on {_where(reports[rank]['waiting'])}, {why}")
    return "\n".join(lines)
