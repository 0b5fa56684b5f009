"""Flight-recorder dumps: each rank's ring written to a directory when something goes wrong.

Where: :func:`set_trace_dir` (the training job passes its run directory; dumps then go to
``<dir>/flight/``), else the environment variable ``FLASHFSDP_TRACE_DIR`` (dumps straight into
it), else nowhere (the diagnosis is still raised). One file per rank, ``flight_rank<r>.json``,
written atomically (a temporary file renamed into place), replaced by the rank's next dump.

When: a flashfsdp collective fails or times out, a control exchange is interrupted or times out,
an NCCL watchdog aborts (``divergence.failure`` calls :func:`dump`), and on SIGTERM / SIGINT once
:func:`install_signal_handlers` ran (``set_trace_dir`` does; with ``FLASHFSDP_TRACE_DIR`` set,
the first multi-rank communicator does, from the main thread). A signal handler dumps, then hands
the signal to the handler that was there before (SIGINT: ``KeyboardInterrupt``; SIGTERM's default:
the process ends). Python runs handlers between bytecodes, so a rank blocked inside a collective
dumps when that collective returns or times out.

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
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(content, f)
        os.replace(tmp, path)
    except OSError as exc:
        _log.error("flashfsdp flight recorder: could not write %s: %s", path, exc)
        return None
    return path


def install_signal_handlers() -> bool:
    """Dump on SIGTERM and SIGINT, then pass the signal on (see the module docstring). Idempotent;
    returns False where it cannot install (not the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    for signum in (signal.SIGTERM, signal.SIGINT):
        if signum not in _previous:
            _previous[signum] = signal.signal(signum, _on_signal)
    return True


def arm_from_environment() -> None:
    """With ``FLASHFSDP_TRACE_DIR`` set, install the signal handlers (once; main thread only)."""
    if os.environ.get(ENV_DIR) and not _previous:
        install_signal_handlers()


def _on_signal(signum, frame) -> None:
    name = signal.Signals(signum).name
    path = dump(f"signal {name}")
    if path is not None:
        _log.error("flashfsdp flight recorder: %s: ring written to %s", name, path)
    previous = _previous.get(signum)
    if callable(previous):
        previous(signum, frame)
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
