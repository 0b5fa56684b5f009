"""Replacing a checkpoint directory atomically, and recovering from a save interrupted doing it.

Rank 0 runs every function here that changes the file system; :func:`copies` and
:func:`newest_copy` only read (every rank may call them).

[Note: atomic save]
Every rank writes into the hidden sibling ``.<name>.tmp``; when all have finished, rank 0 writes
``extra.pt`` and then the completion marker into it (:func:`publish`), and swaps it into place:

    1. ``path`` -> ``.<name>.old``      (only when an older checkpoint is at ``path``)
    2. ``.<name>.tmp`` -> ``path``
    3. ``.<name>.old`` removed

[Note: recovery]
A crash can stop that sequence anywhere. What is left, by where it stopped:

    - before the marker: ``.tmp`` incomplete, ``path`` the previous checkpoint (or nothing);
    - after the marker, before 1: ``.tmp`` complete (the new checkpoint), ``path`` the previous;
    - between 1 and 2: ``.tmp`` complete (new), ``.old`` complete (previous), no ``path``;
    - after 2: ``path`` new, ``.old`` the previous one, possibly partly removed.

So of the complete copies of a checkpoint (a directory holding the marker), ``.tmp`` is always
the newest, then ``path``, then ``.old``: :func:`newest_copy` is the one to read (``load`` and
``latest`` say so in a warning when it is not ``path`` itself). The next save of the same name
first settles what was left (:func:`settle`): it finishes the interrupted swap and removes a copy
only when a newer complete copy exists, so the only complete copy is never deleted. A directory is
removed marker first (:func:`_remove`), so a half-removed one is never taken for complete.
"""

from __future__ import annotations

import os
import shutil

from .files import fsync_dir, write_file
from .marker import MARKER, complete_marker


def scratch(path: str) -> tuple[str, str]:
    """The hidden siblings ``(.<name>.tmp, .<name>.old)`` of the checkpoint directory ``path``."""
    parent, name = os.path.split(path)
    return os.path.join(parent, f".{name}.tmp"), os.path.join(parent, f".{name}.old")


def copies(path: str) -> list[tuple[str, dict]]:
    """The complete copies of checkpoint ``path`` as ``(directory, marker)``, newest first (see
    [Note: recovery]): ``.<name>.tmp``, ``path``, ``.<name>.old``, those holding a marker."""
    tmp, old = scratch(path)
    found = [(d, complete_marker(d)) for d in (tmp, path, old)]
    return [(d, marker) for d, marker in found if marker is not None]


def newest_copy(path: str) -> tuple[str, dict] | None:
    """``(directory, marker)`` of the newest complete copy of checkpoint ``path``, or None."""
    found = copies(path)
    return found[0] if found else None


def recovery_message(where: str, path: str, chosen: str, step: int) -> str:
    """The warning given when the newest complete copy of ``path`` is the hidden ``chosen``."""
    state = ("holds an older checkpoint" if complete_marker(path) is not None
             else "is missing or incomplete")
    return (f"{where}: a save of checkpoint {path} was interrupted while moving it into place: {path} {state}; "
            f"using the newest complete copy {chosen} (step {step}); the next save of {os.path.basename(path)} "
            f"moves it into place")


def refuse_to_replace(path: str) -> None:
    """Raise FileExistsError unless ``path`` is free, a flashfsdp checkpoint or an empty directory."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path):
        what = "a symbolic link"
    elif not os.path.isdir(path):
        what = "a file"
    elif os.path.isfile(os.path.join(path, MARKER)) or not os.listdir(path):
        return
    else:
        what = f"a directory that is not a flashfsdp checkpoint (it has no {MARKER})"
    raise FileExistsError(f"save: {path} exists and is {what}; save replaces only a flashfsdp checkpoint, so "
                          f"nothing was written: choose another path (e.g. <out>/checkpoints/step_<N>) or move it away")


def prepare(path: str) -> None:
    """Rank 0, before the ranks write: refuse to replace a non-checkpoint, settle what an
    interrupted save left, make a fresh ``.<name>.tmp``."""
    refuse_to_replace(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    settle(path)
    os.makedirs(scratch(path)[0])


def settle(path: str) -> None:
    """Rank 0: leave at most ``path`` of checkpoint ``path`` and its scratch siblings, keeping the
    newest complete copy ([Note: recovery]): a complete ``.tmp`` is swapped into place, a complete
    ``.old`` without a complete ``path`` is moved back; the rest is removed."""
    tmp, old = scratch(path)
    if complete_marker(tmp) is not None:
        _swap_in(path, tmp, old)
    elif complete_marker(path) is None and complete_marker(old) is not None:
        _remove(path)  # empty or incomplete (refuse_to_replace let nothing else through)
        _rename(old, path)
    _remove(old)
    _remove(tmp)


def publish(path: str, files: dict[str, bytes]) -> None:
    """Rank 0, after every rank wrote: ``files`` (name -> bytes, the marker last) into
    ``.<name>.tmp``, then the swap of [Note: atomic save]."""
    tmp, old = scratch(path)
    for name, data in files.items():
        write_file(os.path.join(tmp, name), data)
    refuse_to_replace(path)  # again: something may have appeared there meanwhile
    _swap_in(path, tmp, old)


def _swap_in(path: str, tmp: str, old: str) -> None:
    """The complete ``tmp`` into place; the checkpoint it replaces aside, then removed."""
    if os.path.lexists(path):
        _remove(old)
        _rename(path, old)
    _rename(tmp, path)
    _remove(old)


def discard_scratch(path: str) -> None:
    """Rank 0, after a save of checkpoint ``path`` failed on every rank: remove its scratch
    ``.<name>.tmp``, unless that holds a complete checkpoint (a publish that failed after writing
    the marker: then it is the newest copy, which ``load`` finds and the next save moves into place)."""
    tmp = scratch(path)[0]
    if complete_marker(tmp) is None:
        _remove(tmp)


def _rename(src: str, dst: str) -> None:
    os.rename(src, dst)
    fsync_dir(os.path.dirname(dst))


def _remove(directory: str) -> None:
    """Remove ``directory`` if present, its marker first (a half-removed checkpoint is incomplete)."""
    if not os.path.lexists(directory):
        return
    marker = os.path.join(directory, MARKER)
    if os.path.isfile(marker):
        os.remove(marker)
        fsync_dir(directory)
    shutil.rmtree(directory, ignore_errors=True)
