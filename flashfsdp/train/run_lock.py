"""One run per output folder: an exclusive lock on `<out>/run.lock` for the run's life.

Two jobs writing into one `--out` would interleave `metrics.jsonl`, overwrite `run.json` and
each other's checkpoints. The process that owns the run (the launcher of `flashfsdp-train`, or
rank 0 under a user's torchrun) takes `RunLock.acquire(out)` before anything is written there and
holds it until it exits; a second job finds it held and stops with `RunLocked` (exit code 2),
naming the holder: host, pid and start time, which the holder writes into the lock file.

[Note: the lock file] The lock is `fcntl.flock` on `<out>/run.lock` (on NFS, Linux emulates it
with POSIX locks, which the server arbitrates). The kernel drops it when its holder dies, however
it dies; a holder that ends normally unlinks the file before closing it. So a lock file that is
found with a holder's record in it but not locked is the lock of a process that died: it is
taken over, with a message naming that process. A process that opened the file just before its
holder unlinked it would lock an orphan inode: after locking, the inode must still be the one at
the path, else it tries again.

[Note: workers in the lock file] The launcher's workers are processes of their own: killed alone
(SIGKILL), the launcher drops the lock while its workers still train into `--out`. They end soon
after (each watches its parent: `flashfsdp.train.stopping.watch_parent`), after their current
step and its checkpoint. Until then the run directory is still theirs: each worker appends its
record (pid, host, and the process's start time from /proc, so that a reused pid is not taken
for it) to the lock file (`register_worker`), one JSON object a line after the holder's, and
`acquire` refuses a lock whose holder is gone while any of its workers on this host still runs,
naming them. A holder that takes the lock over rewrites the file with its own record only.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import os
import socket
import sys
import time

from flashfsdp.log import get_logger
from flashfsdp.train.errors import UsageError

LOCK_FILE = "run.lock"
_log = get_logger(__name__)


class RunLocked(UsageError):
    """`--out` is held by another live run (exit code 2). `holder` is its record (host, pid,
    started, command), or {} when the holder wrote none yet; `workers` the pids of the workers
    of a run whose launcher is gone but which still run (see [Note: workers in the lock file])."""

    def __init__(self, out: str, holder: dict, workers: list[int] | None = None):
        self.holder, self.workers = holder, list(workers or [])
        if self.workers:
            pids = " ".join(map(str, self.workers))
            super().__init__(f"--out {out} is still in use by {len(self.workers)} worker(s) of a run whose "
                             f"launcher is gone ({describe(holder)}; worker pid(s) {pids} still running): they "
                             "stop after their current step, saving a final checkpoint; wait for them to end "
                             f"(or stop them: kill {pids}), or choose another --out")
        else:
            super().__init__(f"--out {out} is in use by another run ({describe(holder)}); wait for it "
                             "to end or stop it, or choose another --out")


def describe(holder: dict) -> str:
    """"host H, pid P, started T" of a lock record (what is known of it)."""
    if not holder:
        return "holder unknown: it has not written its record yet"
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, "
            f"started {holder.get('started', '?')}")


def _record(command: str) -> dict:
    """This process's lock record."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %z"), "command": command}


def _records(fd: int) -> list[dict]:
    """The records of the open lock file `fd`, one JSON object a line (the holder's first, then
    its workers'); a line that is not one is skipped."""
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    records = []
    for line in data.decode(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def _read(fd: int) -> dict:
    """The holder's record in the open lock file `fd` ({} if empty or unreadable)."""
    return next((r for r in _records(fd) if "worker" not in r), {})


def _process_start(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, field 22 of /proc/<pid>/stat), or None
    where /proc cannot tell (no such process, or no /proc); "zombie" for a process that ended but
    was not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return "zombie" if fields[0] == b"Z" else fields[19].decode()


def _running(record: dict) -> bool:
    """Whether the worker of `record` (this host's) still runs: its pid is a live process that
    started when the worker did (a pid reused since is not it)."""
    pid, started = record.get("worker"), record.get("started_ticks")
    if not isinstance(pid, int) or record.get("host") != socket.gethostname():
        return False
    now = _process_start(pid)
    if now is not None or os.path.isdir("/proc"):
        return now is not None and now != "zombie" and now == started
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def register_worker(out: str) -> None:
    """In a worker of `flashfsdp-train`'s own launcher: add this process to the lock file of run
    directory `out` that the launcher holds (see [Note: workers in the lock file]). Without a
    lock file (the launcher is gone and its successor released it) nothing is written.

    Raises:
        OSError: the lock file exists but cannot be written.
    """
    record = {"worker": os.getpid(), "host": socket.gethostname(), "started_ticks": _process_start(os.getpid())}
    try:
        fd = os.open(os.path.join(out, LOCK_FILE), os.O_WRONLY | os.O_APPEND)
    except FileNotFoundError:
        return
    try:
        os.write(fd, ("\n" + json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def _same_file(fd: int, path: str) -> bool:
    """Whether the open file `fd` is still the file at `path` (not unlinked by its last holder)."""
    try:
        on_disk = os.stat(path)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (on_disk.st_dev, on_disk.st_ino)


@dataclasses.dataclass
class RunLock:
    """The held lock of a run directory; `release` (or leaving a `with` block) gives it back.

    Attributes:
        out: the run directory.
        path: `<out>/run.lock`.
        recovered: the record of a dead holder whose lock was taken over, or None.
    """

    out: str
    path: str
    _fd: int | None
    _created_out: bool
    recovered: dict | None = None

    @classmethod
    def acquire(cls, out: str, command: str = "flashfsdp-train") -> RunLock:
        """Take the lock of run directory `out` (created if missing) without waiting.

        Args:
            out: the run directory (--out).
            command: what this process is, written into the record for a second job to show.

        Returns:
            The held lock. A lock left by a dead process is taken over, with a warning on the
            `flashfsdp` logger naming it (see [Note: the lock file]).

        Raises:
            RunLocked: another live process holds it; the message names host, pid and start time.
                Also when its holder is gone but workers it recorded still run (named).
            OSError: `out` cannot be created or the lock file cannot be opened.
        """
        created = not os.path.isdir(out)
        os.makedirs(out, exist_ok=True)
        path = os.path.join(out, LOCK_FILE)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                holder = _read(fd)
                os.close(fd)
                if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                    raise RunLocked(out, holder) from None
                raise
            if _same_file(fd, path):
                break
            os.close(fd)  # its holder released it between our open and our lock: try again
        running = [r["worker"] for r in _records(fd) if "worker" in r and _running(r)]
        if running:
            holder = _read(fd)
            os.close(fd)  # the file stays, with its records, for the next attempt to check again
            raise RunLocked(out, holder, running)
        lock = cls(out, path, fd, created, _read(fd) or None)
        if lock.recovered:
            _log.warning("%s: took over the lock of a run that ended without releasing it (%s: the "
                         "process is gone)", out, describe(lock.recovered))
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(_record(command)).encode(), 0)
        os.fsync(fd)
        return lock

    @property
    def held(self) -> bool:
        """Whether this lock is still held."""
        return self._fd is not None

    def release(self) -> None:
        """Unlink the lock file and drop the lock (idempotent). A run directory that `acquire`
        created and that is left empty is removed too (a run refused before writing anything)."""
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        os.close(self._fd)
        self._fd = None
        if self._created_out:
            try:
                os.rmdir(self.out)
            except OSError:
                pass  # not empty: the run wrote into it

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@dataclasses.dataclass
class JobLock:
    """The run directory's lock as every rank of a job sees it (`hold_on_rank0`).

    Attributes:
        held: whether the job holds it (rank 0 holds the file lock for all ranks).
        lock: rank 0's `RunLock` while held, else None.
    """

    held: bool
    lock: RunLock | None = None

    def release(self) -> None:
        """Release rank 0's lock (a no-op on other ranks and when not held)."""
        if self.lock is not None:
            self.lock.release()


def hold_on_rank0(out: str, rank: int) -> JobLock:
    """Collective: rank 0 takes the lock of run directory `out` for the job, and every rank learns
    whether it did (a job under a user's torchrun, which has no launcher of ours to hold it).

    Returns:
        `JobLock(held=True, ...)`, or `held=False` when another run holds it: then rank 0 has
        printed the one-line error naming the holder, and each rank should exit with code 2.
    """
    from flashfsdp.runtime.agreement import broadcast_value  # noqa: PLC0415 - only the workers need torch

    lock, message = None, None
    if rank == 0:
        try:
            lock = RunLock.acquire(out, command="flashfsdp-train rank 0 under torchrun")
        except RunLocked as err:
            message = str(err)
    message = broadcast_value(message, src=0)
    if message is not None:
        if rank == 0:
            print(f"flashfsdp-train: error: {message}", file=sys.stderr, flush=True)
        return JobLock(False)
    return JobLock(True, lock)
