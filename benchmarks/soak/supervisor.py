"""Run W ranks that must each end on their own, and record how and when each one ended.

``flashfsdp_dev.ranks.spawn_ranks`` (the spawner of the other benchmarks and of the tests)
stops every rank as soon as one fails, which is what a test wants but hides what a fault
benchmark measures: whether the other ranks notice the failure themselves (an error from their
next collective, or the process group's timeout) and end, or hang. So here every rank runs in its
own process and the supervisor only watches: it polls the processes, notes when each ended, kills
a rank stopped by SIGSTOP once every other rank has ended (the job of any launcher: the stopped
rank cannot end itself), and kills whatever still runs at ``limit_s`` (counted as a hang).

Rank r joins a gloo process group over a file store with the given collective timeout (as
``flashfsdp-train --timeout``), calls ``fn(rank, world_size, *args)``, and, as the training job's
workers do, destroys the process group on the way out, success or error; the time of an error
(``time.monotonic()``, one clock for every process of the host) comes back with its message.
"""

from __future__ import annotations

import datetime
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

# Seconds between two looks at the ranks.
POLL_S = 0.02


@dataclass
class RankEnd:
    """How one rank ended.

    Attributes:
        rank: the rank.
        how: "ok" (fn returned), "error" (fn raised: ``error``, at ``error_at``), "killed" (ended
            by a signal it sent itself or got, exit code < 0), "stopped" (SIGSTOPped, then killed
            by the supervisor once the others had ended), "hung" (killed at the limit).
        exit_code: the process's exit code (negative: the signal).
        ended_at: ``time.monotonic()`` when the supervisor saw it gone.
        error: first line of the exception (type: message), or None.
        error_at: ``time.monotonic()`` when the exception was caught in the rank, or None.
        destroyed_at: ``time.monotonic()`` when the rank had destroyed its process group (then
            only the interpreter's exit was left), or None.
        result: what ``fn`` returned (JSON), or None.
    """

    rank: int
    how: str
    exit_code: int | None
    ended_at: float
    error: str | None = None
    error_at: float | None = None
    destroyed_at: float | None = None
    result: object = None


def _rank_main(rank: int, world_size: int, store: str, timeout_s: float, out_dir: str, fn, args) -> None:
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    record: dict = {}
    try:
        record["result"] = fn(rank, world_size, *args)
    except BaseException as exc:  # noqa: BLE001 - every way out is recorded
        record.update(error_at=time.monotonic(), error=f"{type(exc).__name__}: {str(exc).strip()[:300]}",
                      traceback=traceback.format_exc())
    _write(os.path.join(out_dir, f"rank{rank}.json"), record)
    dist.destroy_process_group()
    _write(os.path.join(out_dir, f"rank{rank}.json"), record | {"destroyed_at": time.monotonic()})
    if "error" in record:
        sys.exit(1)


def _write(path: str, record: dict) -> None:
    with open(path, "w") as f:
        json.dump(record, f)


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def run_independent(fn, world_size: int, args: tuple = (), *, timeout_s: float, limit_s: float) -> list[RankEnd]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` ranks that each end on their own.

    Args:
        fn: a module-level function (pickled by reference); its result must be JSON-serialisable.
        world_size: W >= 1.
        args: further arguments of ``fn`` (pickled).
        timeout_s: the process group's collective timeout, seconds.
        limit_s: seconds after which the ranks still running are killed and reported "hung".

    Returns:
        One :class:`RankEnd` per rank, by rank.
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, world_size, os.path.join(tmp, "store"), timeout_s, tmp,
                                                      fn, args), daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        ended: dict[int, tuple[str, float]] = {}
        deadline = time.monotonic() + limit_s
        while len(ended) < world_size:
            now = time.monotonic()
            for r, p in enumerate(procs):
                if r not in ended and p.exitcode is not None:
                    ended[r] = ("exited", now)
            stopped = [r for r, p in enumerate(procs) if r not in ended and _stopped(p.pid)]
            running = [r for r in range(world_size) if r not in ended and r not in stopped]
            for r in stopped if not running else ():
                os.kill(procs[r].pid, signal.SIGKILL)
                procs[r].join()
                ended[r] = ("stopped", time.monotonic())
            if now > deadline:
                for r in running + stopped:
                    os.kill(procs[r].pid, signal.SIGKILL)
                    procs[r].join()
                    ended[r] = ("hung", time.monotonic())
            time.sleep(POLL_S)
        return [_rank_end(r, procs[r].exitcode, *ended[r], tmp) for r in range(world_size)]


def _rank_end(rank: int, exit_code: int | None, state: str, ended_at: float, tmp: str) -> RankEnd:
    path = os.path.join(tmp, f"rank{rank}.json")
    record = {}
    if os.path.exists(path):
        with open(path) as f:
            record = json.load(f)
    if state in ("stopped", "hung"):
        how = state
    elif "error" in record:
        how = "error"
    elif exit_code is not None and exit_code < 0:
        how = "killed"
    else:
        how = "ok" if exit_code == 0 else "error"
    return RankEnd(rank, how, exit_code, ended_at, record.get("error"), record.get("error_at"),
                   record.get("destroyed_at"), record.get("result"))
