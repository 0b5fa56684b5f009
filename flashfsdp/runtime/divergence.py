"""The error of a failed collective, naming where every reachable rank is and where they diverged.

When a flashfsdp collective fails on a rank (gloo's timeout, a peer's closed connection, an NCCL
watchdog abort, ranks found waiting on collectives that cannot pair once past the desync window:
``flight_desync.py``) or a control exchange is interrupted, :func:`failure` builds the exception to
raise instead of the backend's bare message:

1. the rank's report (``flight_dump.report``: position and the last :data:`REPORT_ENTRIES`
   collectives of its flight recorder) goes to the default group's store under
   ``flashfsdp/flight/<n>/<rank>`` (n: this process's count of failures under its default group),
   and a notice
   ``flashfsdp/flight/<n>/notice`` wakes the ranks that wait in a control exchange
   (``control.py`` polls :func:`notice_pending`): they stop waiting and report too;
2. it waits up to ``FLASHFSDP_DIAGNOSIS_GRACE`` seconds (default 3; 0.5 when the backend said a
   peer closed its connection: that peer reported before it went, or never will) for the reports
   of the other ranks of the collective's group (at most :data:`MAX_REPORTS`);
3. it dumps its ring (``flight_dump.dump``) and returns a :class:`CollectiveFailure` whose message
   is ``flight_report.describe`` of the reports it has: on every rank that reached this point, the
   same account of every rank ("rank 1 waits in the all-gather of 'layers.0' (forward, step 5, seq
   412); rank 0 waits in the reduce-scatter of 'layers.3' (backward, step 4, seq 418)").

The store is the one the process group was created with (a TCP or file store), which stays
reachable when the group's collectives do not. Without torch.distributed, or when the store
fails, the error names this rank alone. A failure after the first under the same default group
(the other collectives in flight, waited for while the error unwinds) exchanges and waits for
nothing: its error repeats the first diagnosis.
"""

from __future__ import annotations

import json
import os
import time

from flashfsdp.log import get_logger

from . import flight, flight_dump
from .flight_report import describe

GRACE_ENV = "FLASHFSDP_DIAGNOSIS_GRACE"
DEFAULT_GRACE_S, PEER_GONE_GRACE_S = 3.0, 0.5
REPORT_ENTRIES, MAX_REPORTS = 64, 32
POLL_S = 0.02  # seconds between two looks for the other ranks' reports
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")
_PREFIX = "flashfsdp/flight"
_log = get_logger(__name__)
# [the default group they were counted under, failures reported so far, the first one's diagnosis]
_failures: list = [None, 0, None]


class CollectiveFailure(RuntimeError):
    """A flashfsdp collective failed, timed out or was abandoned; the message says where each rank
    was (see the module docstring). The backend's own error is the ``__cause__``."""


def _store():
    """The default group's store, or None (no process group)."""
    import torch.distributed as dist  # noqa: PLC0415

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from flashfsdp._torch_private import get_default_store  # noqa: PLC0415

    return get_default_store()


def grace_seconds(error: BaseException | None) -> float:
    """How long to wait for the other ranks' reports (see the module docstring).

    Raises:
        ValueError: ``FLASHFSDP_DIAGNOSIS_GRACE`` is not a number >= 0.
    """
    raw = os.environ.get(GRACE_ENV)
    if raw:
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not value >= 0:
            raise ValueError(f"{GRACE_ENV}={raw!r}: set it to the seconds to wait for the other ranks' reports")
        return value
    text = str(error) if error is not None else ""
    return PEER_GONE_GRACE_S if any(s in text for s in _PEER_GONE) else DEFAULT_GRACE_S


def _failure_count() -> int:
    """The failures reported under the current default group (a new group starts from 0)."""
    import torch.distributed as dist  # noqa: PLC0415

    world = dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
    if _failures[0] is not world:
        _failures[:] = [world, 0, None]
    return _failures[1]


def notice_pending() -> bool:
    """Whether another rank has reported a failure this process has not answered yet (one store
    look-up; False without a store)."""
    try:
        store = _store()
        return store is not None and store.check([f"{_PREFIX}/{_failure_count() + 1}/notice"])
    except Exception:  # noqa: BLE001 - a broken store: nothing to learn from it
        return False


def _peers(group: tuple | None, rank: int, world: int) -> list[int]:
    ranks = list(group) if group else list(range(world))
    others = [r for r in ranks if r != rank]
    return others[: MAX_REPORTS - 1]


def exchange_reports(mine: dict, group: tuple | None, grace_s: float) -> tuple[list[dict], list[int]]:
    """Publish ``mine``, then collect the other ranks' reports (see the module docstring).
    Returns (the reports found, mine included; the ranks that sent none)."""
    count = _failures[1] = _failure_count() + 1
    peers = _peers(group, mine["rank"], mine["world_size"])
    try:
        store = _store()
        if store is None:
            return [mine], []
        prefix = f"{_PREFIX}/{count}"
        store.set(f"{prefix}/{mine['rank']}", json.dumps(mine))
        store.set(f"{prefix}/notice", str(mine["rank"]))
        keys = [f"{prefix}/{r}" for r in peers]
        arrived = _await_keys(store, keys, grace_s)
        reports = [mine] + [json.loads(store.get(key)) for key in keys if key in arrived]
        return reports, [rank for rank, key in zip(peers, keys) if key not in arrived]
    except Exception as exc:  # noqa: BLE001 - the store is gone too: report this rank alone
        _log.error("flashfsdp flight recorder: could not exchange reports through the store: %s", exc)
        return [mine], []


def _await_keys(store, keys: list[str], grace_s: float) -> set[str]:
    """The ``keys`` present in ``store`` within ``grace_s`` seconds, looked for every
    :data:`POLL_S` (a store's own ``wait`` may round its timeout up to whole seconds)."""
    deadline, arrived = time.monotonic() + grace_s, set()
    while True:
        arrived |= {key for key in keys if key not in arrived and store.check([key])}
        if len(arrived) == len(keys) or time.monotonic() >= deadline:
            return arrived
        time.sleep(POLL_S)


def failure(error: BaseException, entry: "flight.Entry | None", what: str, reason: str | None = None) -> CollectiveFailure:
    """The exception to raise (``from error``) for ``error``, raised by ``what`` (e.g. "the
    all-gather of 'layers.0'") whose flight entry is ``entry`` (see the module docstring).
    ``error`` is returned unchanged when it already is a :class:`CollectiveFailure`."""
    if isinstance(error, CollectiveFailure):
        return error
    flight.failed(entry)
    first_line = (str(error).strip().splitlines() or [""])[0]
    _failure_count()  # (a new default group forgets the earlier diagnosis)
    if _failures[0] is not None and _failures[2] is not None:  # (without a process group: nothing to repeat)
        return CollectiveFailure(f"{what} failed too ({type(error).__name__}: {first_line}), after this earlier "
                                 f"failure: {_failures[2]}")
    if reason is None:
        reason = getattr(error, "reason", None) or (
            "timeout" if "timed out" in str(error).lower() or isinstance(error, TimeoutError) else "error")
    mine = flight_dump.report(reason, error, entries=REPORT_ENTRIES)
    grace = grace_seconds(error)
    reports, missing = exchange_reports(mine, getattr(entry, "group", None), grace)
    path = flight_dump.dump(reason, error)
    where = f"\nflight recorder dumps: {os.path.dirname(path)} (python -m flashfsdp.debug DIR)" if path else ""
    _failures[2] = (f"{what} failed on rank {mine['rank']} ({type(error).__name__}: {first_line}); where the ranks "
                    f"are:\n{describe(reports, missing, grace)}{where}")
    return CollectiveFailure(_failures[2])
