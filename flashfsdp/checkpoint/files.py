"""Small file-system helpers of the checkpoint functions: argument paths, durable writes."""

from __future__ import annotations

import os
from typing import Any


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
    """Write ``data`` to ``path`` durably (temporary file, fsync, rename)."""
    tmp = f"{path}.part"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
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
