"""Flight-recorder dumps: each rank's ring written to a directory when something goes wrong.

Where: :func:`set_trace_dir` (the training job passes its run directory; dumps then go to
``<dir>/flight/``), else the environment variable ``FLASHFSDP_TRACE_DIR`` (dumps straight into
it), else nowhere (the diagnosis is still raised). One file per rank, ``flight_rank<r>.json``,
written atomically (a temporary file renamed into place), replaced by the rank's next dump.

When: a flashfsdp collective fails or times out, a control exchange is interrupted or times out,
an NCCL watchdog aborts, ranks are found desynchronised (``divergence.failure`` calls
:func:`dump`), an application hands its own failure to :func:`report_failure`, and on SIGTERM /
SIGINT once :func:`install_signal_handlers` ran (``set_trace_dir`` does; with
``FLASHFSDP_TRACE_DIR`` set, the first multi-rank communicator does, from the main thread). The
Python handler hands the signal to the handler that was there before (SIGINT:
``KeyboardInterrupt``; SIGTERM's default: the process ends; the training job's: a stop after the
step). Python runs handlers between bytecodes only, so a rank blocked inside a collective (gloo's
wait, a store look-up) would run it when that returns; so the dump itself is written by a watcher
thread woken through ``signal.set_wakeup_fd`` (written by the interpreter's C-level handler the
moment the signal arrives), at once, whatever the main thread is blocked in; the Python handler
then does not dump it again. (Where the wakeup descriptor is someone else's already, e.g. an
asyncio loop's, there is no watcher and the handler dumps.) A signal's dump belongs to a normal
stop too: it is logged as a notice, not as an error.

``python -m flashfsdp.debug DIR`` reads the dumps of every rank and prints where they diverged.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

from flashfsdp.log import get_logger

from . import flight

ENV_DIR = "FLASHFSDP_TRACE_DIR"
SUBDIR = "flight"
_log = get_logger(__name__)
_trace_dir: str | None = None
_previous: dict[int, object] = {}
_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_lock = threading.Lock()
# per signal, how many deliveries the watcher thread ([0]) and the Python handler ([1]) have seen:
# the first of the two to see a delivery dumps it
_seen: dict[int, list[int]] = {int(s): [0, 0] for s in _SIGNALS}
_watcher: dict = {"thread": None, "socket": None}


def rank_and_world() -> tuple[int, int]:
    """(rank, world size) in the default group; from ``RANK``/``WORLD_SIZE`` (or 0, 1) without one."""
    import torch.distributed as dist  # noqa: PLC0415 - light module: torch only when asked

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)


def set_trace_dir(path: str | os.PathLike | None, signals: bool = True) -> None:
    """Dump into ``<path>/flight/`` from now on (None: back to ``FLASHFSDP_TRACE_DIR`` or nowhere);
    with ``signals``, also on SIGTERM / SIGINT (from the main thread only; elsewhere skipped).

    Raises:
        TypeError: ``path`` is not a path or None.
    """
    global _trace_dir
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"set_trace_dir: path must be a directory path or None, got {type(path).__name__}")
    _trace_dir = None if path is None else os.path.join(os.fspath(path), SUBDIR)
    if signals and path is not None:
        install_signal_handlers()


def trace_dir() -> str | None:
    """The directory dumps go to now (see the module docstring), or None."""
    return _trace_dir or os.environ.get(ENV_DIR) or None


def report(reason: str, error: BaseException | str | None = None, entries: int | None = None) -> dict:
    """This rank's report (see ``flight_report``): the last ``entries`` ring entries (None: all)."""
    rank, world = rank_and_world()
    recorded = flight.entries()
    if entries is not None:
        recorded = recorded[-entries:]
    text = None if error is None else (error if isinstance(error, str) else f"{type(error).__name__}: {error}")
    return {"rank": rank, "world_size": world, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
            "reason": reason, "error": None if text is None else text.strip().splitlines()[0][:500],
            "position": flight.position(), "entries": [e.as_dict() for e in recorded]}


def dump(reason: str, error: BaseException | str | None = None) -> str | None:
    """Write this rank's whole ring to the trace directory; returns the file, or None (no directory,
    or the write failed: logged, never raised, so that it cannot hide the error being reported)."""
    directory = trace_dir()
    if directory is None:
        return None
    content = report(reason, error)
    path = os.path.join(directory, f"flight_rank{content['rank']}.json")
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"  # (the watcher thread may dump too)
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(content, f)
        os.replace(tmp, path)
    except OSError as exc:
        _log.error("flashfsdp flight recorder: could not write %s: %s", path, exc)
        return None
    return path


def report_failure(error: BaseException) -> None:
    """Make sure an application's failure is said and dumped at once, before any cleanup that a
    signal could cut short: a ``divergence.CollectiveFailure`` (diagnosed and dumped already) is
    logged; any other ``Exception`` (a torch collective whose peer died, the application's own
    error) is diagnosed as a flashfsdp collective's failure is (``divergence.failure``: the ranks'
    reports through the store, naming the ranks that sent none), dumped, and logged. Logged as an
    error, on every rank; ``KeyboardInterrupt`` and other ``BaseException``s are left alone.
    Never raises."""
    if not isinstance(error, Exception):
        return
    from . import divergence  # noqa: PLC0415 - divergence imports this module

    try:
        diagnosed = divergence.failure(error, None, f"{type(error).__name__} outside a flashfsdp collective")
    except Exception as exc:  # noqa: BLE001 - the report must not hide the error it reports
        _log.error("flashfsdp: %s: %s (its diagnosis failed: %s)", type(error).__name__, error, exc)
        return
    _log.error("%s", diagnosed)


def install_signal_handlers() -> bool:
    """Dump on SIGTERM and SIGINT, at once (a watcher thread), then pass the signal on (see the
    module docstring). Idempotent; returns False where it cannot install (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for signum in _SIGNALS:
        if signum not in _previous:
            _previous[signum] = signal.signal(signum, _on_signal)
    _start_watcher()
    return True


def _start_watcher() -> None:
    """The watcher thread of the module docstring, reading the wakeup descriptor (main thread)."""
    if _watcher["thread"] is not None and _watcher["thread"].is_alive():
        return
    reader, writer = socket.socketpair()
    writer.setblocking(False)
    try:
        before = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
    except ValueError:  # (not the main thread of the main interpreter)
        reader.close()
        writer.close()
        return
    if before != -1:  # someone else's (an event loop's): theirs stays, the handler dumps
        signal.set_wakeup_fd(before)
        reader.close()
        writer.close()
        return
    _watcher["socket"] = (reader, writer)
    thread = threading.Thread(target=_watch, args=(reader,), name="flashfsdp-signal-dump", daemon=True)
    _watcher["thread"] = thread
    thread.start()


def _watch(reader: socket.socket) -> None:
    while True:
        try:
            data = reader.recv(64)
        except OSError:
            return
        if not data:
            return
        for signum in data:
            if signum in _seen and _first_to_see(signum, 0):
                _dump_for(signum)


def _forget_watcher_in_child() -> None:
    """After a fork: the child's signals must not wake the parent's watcher."""
    if _watcher["socket"] is None:
        return
    try:
        signal.set_wakeup_fd(-1)
    except ValueError:
        pass
    _watcher.update(thread=None, socket=None)
    for counts in _seen.values():
        counts[:] = [0, 0]


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_watcher_in_child)


def _first_to_see(signum: int, side: int) -> bool:
    """Count a delivery of ``signum`` seen by ``side`` (0 the watcher, 1 the handler); True when
    the other side has not seen it yet (then this side dumps it)."""
    with _lock:
        counts = _seen[signum]
        counts[side] += 1
        watching = _watcher["thread"] is not None and _watcher["thread"].is_alive()
        return counts[side] > counts[1 - side] or (side == 1 and not watching)


def _dump_for(signum: int) -> None:
    name = signal.Signals(signum).name
    path = dump(f"signal {name}")
    if path is not None:
        _log.info("flashfsdp flight recorder: %s: ring written to %s", name, path)


def arm_from_environment() -> None:
    """With ``FLASHFSDP_TRACE_DIR`` set, install the signal handlers (once; main thread only)."""
    if os.environ.get(ENV_DIR) and not _previous:
        install_signal_handlers()


def _on_signal(signum, frame) -> None:
    if _first_to_see(signum, 1):
        _dump_for(signum)
    previous = _previous.get(signum)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
