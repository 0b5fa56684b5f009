"""``latest``: the newest complete checkpoint in a directory, interrupted saves included."""

from __future__ import annotations

import os
import re
import warnings

from .atomic import newest_copy, recovery_message
from .marker import MARKER

_SCRATCH = re.compile(r"^\.(.+)\.(tmp|old)$")


def latest(out_dir: str | os.PathLike) -> str | None:
    """The newest complete checkpoint directly under ``out_dir``, or None.

    Complete means the marker :data:`~flashfsdp.checkpoint.MARKER` is there. Each checkpoint name
    counts with its newest complete copy: itself, or, where a save of it was interrupted while
    moving the new checkpoint into place, a hidden sibling ``.<name>.tmp`` / ``.<name>.old``
    ([Note: recovery] in ``flashfsdp.checkpoint.atomic``), which is then returned with a warning
    naming both directories. Other hidden directories and incomplete ones are skipped. Newest is
    the highest saved ``step``, then the latest marker modification time. Local, no communication.

    Args:
        out_dir: the directory holding checkpoint directories (e.g. ``<out>/checkpoints``); a missing
            directory has none.

    Raises:
        TypeError: ``out_dir`` is not a str or os.PathLike.
        NotADirectoryError: ``out_dir`` exists but is a file.
    """
    if not isinstance(out_dir, (str, os.PathLike)):
        raise TypeError(f"latest: out_dir must be a str or os.PathLike, got {type(out_dir).__name__}")
    out_dir = os.path.abspath(os.fspath(out_dir))
    if not os.path.exists(out_dir):
        return None
    if not os.path.isdir(out_dir):
        raise NotADirectoryError(f"latest: out_dir {out_dir} is a file, not a directory")
    best, best_key = None, None
    for name in _names(out_dir):
        path = os.path.join(out_dir, name)
        found = newest_copy(path)
        if found is None:
            continue
        key = (found[1]["step"], os.path.getmtime(os.path.join(found[0], MARKER)))
        if best_key is None or key > best_key:
            best, best_key = (path, found), key
    if best is None:
        return None
    path, (source, marker) = best
    if source != path:
        warnings.warn(recovery_message("latest", path, source, marker["step"]), stacklevel=2)
    return source


def _names(out_dir: str) -> set[str]:
    """The checkpoint names under ``out_dir``: its visible directories, and the names whose hidden
    scratch siblings an interrupted save left."""
    names = set()
    for entry in os.scandir(out_dir):
        scratch = _SCRATCH.match(entry.name)
        if scratch is not None:
            names.add(scratch.group(1))
        elif not entry.name.startswith(".") and entry.is_dir():
            names.add(entry.name)
    return names
