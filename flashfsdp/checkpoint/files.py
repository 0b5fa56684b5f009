"""Small file-system helpers of the checkpoint functions: argument paths, durable writes."""

from __future__ import annotations

import contextlib
import os
from typing import Any

from .space import explain, free_bytes, no_room


def check_path(path: Any, where: str) -> str:
    """``path`` as an absolute str. Raises TypeError (not a str / os.PathLike) or ValueError (it
    names no directory: "", ".", "..")."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.path.abspath(os.fspath(path))
    if os.path.basename(path) in ("", ".", ".."):
        raise ValueError(f"{where}: path {path!r} must name a directory (e.g. <out>/checkpoints/step_<N>)")
    return path


def write_file(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` durably (temporary file, fsync, rename).

    Raises:
        OSError: the write failed (the temporary file is removed); one that found no room
            (ENOSPC, EDQUOT, EFBIG) names ``path`` and the bytes it needed (``space.explain``).
    """
    tmp = f"{path}.part"
    free = free_bytes(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        if no_room(exc) is None:
            raise
        raise explain(exc, path, len(data), free) from exc
    os.replace(tmp, path)


def fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
