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
    started, command), or {} when the holder wrote none yet."""

    def __init__(self, out: str, holder: dict):
        self.holder = holder
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


def _read(fd: int) -> dict:
    """The record in the open lock file `fd` ({} if empty or unreadable)."""
    os.lseek(fd, 0, os.SEEK_SET)
    data = b""
    while chunk := os.read(fd, 65536):
        data += chunk
    try:
        record = json.loads(data.decode() or "{}")
    except ValueError:
        return {}
    return record if isinstance(record, dict) else {}


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
    import torch.distributed as dist  # noqa: PLC0415 - only the workers need it

    lock, message = None, None
    if rank == 0:
        try:
            lock = RunLock.acquire(out, command="flashfsdp-train rank 0 under torchrun")
        except RunLocked as err:
            message = str(err)
    box = [message]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        if rank == 0:
            print(f"flashfsdp-train: error: {box[0]}", file=sys.stderr, flush=True)
        return JobLock(False)
    return JobLock(True, lock)
