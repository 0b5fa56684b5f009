"""A save that runs out of room, in words: which file, how many bytes the save needs, how many
were free.

The write that fails is deep inside DCP (``torch.save``'s zip writer on a Python stream), which
reports it as "enforce fail at inline_container.cc ... unexpected pos" once the stream refused
bytes, the ``OSError`` itself lost. So the streams a save writes through record the first
``OSError`` of their writes (``checksums.py``), and the save raises that one, with the file, the
bytes this rank was writing and the space that was free when it began (:func:`explain`).
"""

from __future__ import annotations

import errno
import os
import resource

# The errors of a write that found no room: a full file system, a full quota, a file over the
# process's size limit (RLIMIT_FSIZE, ``ulimit -f``).
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def free_bytes(path: str) -> int | None:
    """Bytes available to this process on the file system of ``path`` (its nearest existing
    ancestor), or None where it cannot be known."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        stat = os.statvfs(path)
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


def no_room(exc: BaseException | None) -> OSError | None:
    """The first ``OSError`` of :data:`NO_ROOM` in ``exc`` and its causes and contexts, or None."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_ROOM:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _size(n: int | None) -> str:
    """"396304 bytes (387.0 KiB)"; "an unknown number of bytes" for None."""
    if n is None:
        return "an unknown number of bytes"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n} bytes ({n / scale:.1f} {unit})"
    return f"{n} bytes"


def explain(error: OSError, file: str, needed: int | None, free: int | None) -> OSError:
    """An ``OSError`` of ``error``'s errno saying what could not be written and what it needed.

    Args:
        error: the ``OSError`` a write raised (ENOSPC, EDQUOT or EFBIG).
        file: the file being written.
        needed: the bytes this rank writes for the save (all its files), if known.
        free: the bytes that were free on the file system when the save began, if known.

    Returns:
        ``OSError(error.errno, "No space left on device writing FILE: ...")`` (its strerror
        first), saying that the checkpoint being replaced stays until the new one is complete.
    """
    reason = error.strerror or os.strerror(error.errno or 0)
    what = f"{reason} writing {file}: this rank's part of the checkpoint needs {_size(needed)}"
    if error.errno == errno.EFBIG:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        shown = "no limit" if limit == resource.RLIM_INFINITY else _size(limit)
        what += (f", and this process may write files of at most {shown} (its file size limit, "
                 "RLIMIT_FSIZE / ulimit -f): raise the limit")
    else:
        what += (f", {_size(free)} were free on its file system when the save began (the "
                 "checkpoint it replaces stays until the new one is complete, so a save needs room "
                 "for both): free some space, keep fewer checkpoints, or save elsewhere")
    return OSError(error.errno, what)
