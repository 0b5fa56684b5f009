"""The watchdog of one NCCL communicator: a deadline per collective in flight, NCCL's asynchronous
errors, and an abort that turns a hang into an error naming the collective and the unit.

NCCL through CuPy runs on the GPU and the host never waits for it (``Work.wait`` makes a stream
wait on an event): a collective that another rank never joins (mismatched calls, a dead rank) keeps
its kernel spinning, and the process hangs at its next host synchronisation. torch's NCCL process
group has a watchdog thread for this (``ProcessGroupNCCL``'s ``watchdogHandler``: each work's
deadline, ``ncclCommGetAsyncError``, ``ncclCommAbort``, then an error); this is its counterpart.

:class:`Watchdog` keeps, per collective issued, its name, the unit it serves (when the runtime
names it), its deadline and a completion test. :meth:`Watchdog.poll` (run every ``poll_s`` seconds
by a daemon thread, and by host waits) checks NCCL's asynchronous error, drops completed
collectives and, at the first error or overdue collective, aborts the communicator once
(``ncclCommAbort`` makes the stuck kernels return) and keeps the error; the communicator raises it
at its next call (:meth:`Watchdog.raise_if_failed`), and the thread writes it to stderr at once.
A failure also dumps the flight recorder (``flight_dump.py``) at once, and the raised error says
where every reachable rank is (``divergence.py``).

The desync window (``flight_desync.py``) applies here too: the oldest collective in flight past
the window (by its issue time) makes this rank compare its position with the other ranks' through
the store at each poll (less often the longer it waits); when the ranks wait on collectives that
cannot pair, the communicator is aborted as on a timeout, with :class:`CollectiveDesync`, long
before the deadline; when they wait on the same collective (slow, not desynced) or the others are
busy elsewhere, it keeps waiting.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Callable

from flashfsdp.log import get_logger

from . import divergence, flight, flight_desync, flight_dump

_log = get_logger(__name__)


class CollectiveError(RuntimeError):
    """A collective of an NCCL communicator failed or timed out; the communicator is aborted."""


class CollectiveTimeout(CollectiveError):
    """A collective did not complete within the communicator's timeout."""


class CollectiveDesync(CollectiveError):
    """A collective outlasted the desync window while the ranks wait on collectives that cannot pair."""


@dataclass
class Pending:
    """One collective in flight: its name, the unit it serves, deadline and completion test."""

    collective: str
    deadline: float
    done: Callable[[], bool]
    unit: str | None = None
    flight_entry: object = None  # its flight-recorder entry (``flight.py``), marked completed when seen done
    issued_at: float = 0.0  # the watchdog's clock when it was registered
    stall: object = None  # its ``flight_desync.Stall`` once past the desync window

    def describe(self) -> str:
        """``"all_gather_into_tensor of unit 'layers.0'"`` (or ``"... (unit not named)"``)."""
        return f"{self.collective} of unit '{self.unit}'" if self.unit else f"{self.collective} (unit not named)"


class Watchdog:
    """Deadlines and asynchronous errors of one communicator (see the module docstring).

    Args:
        name: the communicator, for messages (e.g. ``"NcclCommunicator(rank 0 of 2, cuda:0)"``).
        timeout_s: seconds a collective may stay incomplete after it was issued (> 0).
        abort: called once, on the first failure (``ncclCommAbort``); its own errors are noted.
        check_async_error: raises NCCL's asynchronous error, if any (``ncclCommGetAsyncError``).
        poll_s: seconds between the thread's polls.
        clock: the monotonic clock deadlines are measured on.

    Raises:
        ValueError: ``timeout_s`` or ``poll_s`` not positive.
    """

    def __init__(self, name: str, timeout_s: float, abort: Callable[[], None],
                 check_async_error: Callable[[], None], poll_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic):
        if not timeout_s > 0 or not poll_s > 0:
            raise ValueError(f"Watchdog: timeout_s and poll_s must be > 0, got {timeout_s} and {poll_s}")
        self.name, self.timeout_s, self.poll_s = name, float(timeout_s), float(poll_s)
        self._abort, self._check_async_error, self._clock = abort, check_async_error, clock
        self._pending: list[Pending] = []
        self._lock = threading.Lock()
        self.error: CollectiveError | None = None
        self._failed_entry = None  # the overdue collective's flight entry
        self._reason = "watchdog"  # why it failed, for the reports ("desync" past the window)
        self._diagnosed = False  # the error's message holds the ranks' positions
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def register(self, collective: str, done: Callable[[], bool], flight_entry=None) -> Pending:
        """Watch a collective just issued (``flight_entry``: its flight-recorder entry, if any);
        its deadline is now + ``timeout_s``."""
        now = self._clock()
        entry = Pending(collective, now + self.timeout_s, done, flight_entry=flight_entry, issued_at=now)
        with self._lock:
            self._pending.append(entry)
        return entry

    def in_flight(self) -> list[Pending]:
        """The collectives not seen complete yet (as of the last poll)."""
        with self._lock:
            return list(self._pending)

    def poll(self) -> CollectiveError | None:
        """Check NCCL's asynchronous error and every deadline; abort on the first failure.
        Returns the failure (also kept in :attr:`error`), None while all is well."""
        if self.error is not None:
            return self.error
        try:
            self._check_async_error()
        except Exception as exc:  # noqa: BLE001 - whatever NCCL reports is the failure
            return self._fail(CollectiveError(f"{self.name}: NCCL reported an asynchronous error ({exc}); "
                                              f"in flight: {self._describe_all()}"))
        now = self._clock()
        with self._lock:
            finished = [p for p in self._pending if p.done()]
            self._pending = [p for p in self._pending if p not in finished]
            overdue = next((p for p in self._pending if now > p.deadline), None)
        for p in finished:
            flight.completed(p.flight_entry)
            if p.stall is not None:
                p.stall.close()
        if overdue is not None:
            return self._fail(CollectiveTimeout(
                f"{self.name}: {overdue.describe()} did not complete within {self.timeout_s:g} s (another rank "
                f"never issued it, issued different collectives, or died); the communicator was aborted. "
                f"In flight: {self._describe_all()}"), overdue)
        return self._check_desync(now)

    def _check_desync(self, now: float) -> CollectiveError | None:
        """Past the desync window, the oldest collective in flight compares positions (see the
        module docstring); the failure on a desync, else None."""
        window = flight_desync.window()
        if window is None:
            return None
        with self._lock:
            stalled = next((p for p in self._pending if now - p.issued_at >= window and p.flight_entry is not None), None)
        if stalled is None:
            return None
        if stalled.stall is None:
            stalled.stall = flight_desync.Stall(stalled.flight_entry)
        verdict = stalled.stall.check()
        if verdict is None:
            return None
        stalled.stall.close()
        self._reason = "desync"
        return self._fail(CollectiveDesync(
            f"{self.name}: {stalled.describe()} is still in flight after the {window:g} s desync window, and the "
            f"ranks wait on collectives that cannot pair ({'; '.join(verdict.splitlines()[1:])}); the communicator "
            f"was aborted. In flight: {self._describe_all()}"), stalled)

    def _describe_all(self) -> str:
        with self._lock:
            return ", ".join(p.describe() for p in self._pending) or "nothing"

    def _fail(self, error: CollectiveError, overdue: Pending | None = None) -> CollectiveError:
        self.error = error
        self._failed_entry = overdue.flight_entry if overdue is not None else None
        try:
            self._abort()
        except Exception as exc:  # noqa: BLE001 - the error to report is the collective's
            error.args = (f"{error.args[0]} (aborting the communicator raised too: {exc!r})",)
        flight.failed(self._failed_entry)
        flight_dump.dump(f"watchdog: {type(error).__name__}", error)  # at once, from whichever thread fired
        return error

    def raise_if_failed(self) -> None:
        """Raise the failure the watchdog found, if any; the first time, its message gains where
        every reachable rank is (``divergence.failure``: the ranks' flight-recorder reports).

        Raises:
            CollectiveError: (or :class:`CollectiveTimeout`, :class:`CollectiveDesync`) naming the
                collective and unit.
        """
        if self.error is None:
            return
        if not self._diagnosed:
            self._diagnosed = True
            diagnosis = divergence.failure(self.error, self._failed_entry, self.name, reason=self._reason)
            self.error.args = (f"{self.error.args[0]}\n{str(diagnosis).split(chr(10), 1)[-1]}",)
        raise self.error

    def wait_until(self, done: Callable[[], bool], pause_s: float = 1e-3) -> None:
        """Block until ``done()`` while polling: a host wait that ends in an error, not a hang.

        Raises:
            CollectiveError: the watchdog found a failure (a deadline passed, an NCCL error).
        """
        while not done():
            self.raise_if_failed()
            self.poll()
            time.sleep(pause_s)
        self.raise_if_failed()

    def start(self) -> None:
        """Poll every ``poll_s`` seconds on a daemon thread until :meth:`stop`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=f"flashfsdp-watchdog {self.name}", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.poll() is not None:
                _log.error("%s", self.error)  # every rank's: the one that timed out says so
                return

    def stop(self) -> None:
        """Stop the thread (joins it)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None
