"""The files of a flashfsdp checkpoint directory and its completion marker ``flashfsdp.json``.

The marker is written last, by rank 0, once every other file is complete: a directory holding a
readable marker is a *complete* checkpoint. Version 2 markers hold a ``crc32`` checksum of every
file (see ``checksums.py``); version 1 markers (earlier flashfsdp releases) hold none.
"""

from __future__ import annotations

import json
import os
import time

MARKER = "flashfsdp.json"
EXTRA = "extra.pt"
METADATA = ".metadata"  # DCP's metadata file
FORMAT = "flashfsdp-checkpoint"
VERSION = 2


def new_marker(step: int, world_size: int, has_optimizer: bool, checksums: dict[str, int]) -> bytes:
    """The marker's JSON bytes: format, version, step, world size, whether the optimizer was saved,
    the local time, and ``checksums`` (file name -> crc32 as an unsigned int)."""
    marker = {"format": FORMAT, "version": VERSION, "step": step, "world_size": world_size,
              "has_optimizer": has_optimizer, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "checksums": dict(sorted(checksums.items()))}
    return json.dumps(marker, indent=1).encode()


def read_marker(path: str) -> dict:
    """The marker of the checkpoint directory ``path``.

    Raises:
        ValueError: the marker is missing (the save did not finish, or ``path`` is not a
            checkpoint), unreadable, or not a flashfsdp marker (the file is named).
    """
    marker_path = os.path.join(path, MARKER)
    if not os.path.isfile(marker_path):
        raise ValueError(f"load: {path} is not a complete flashfsdp checkpoint: {MARKER} is missing (the save "
                         f"did not finish, or this is not a checkpoint directory); use latest() to find a complete one")
    try:
        with open(marker_path) as f:
            marker = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"load: {marker_path} is unreadable ({exc})") from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT or not isinstance(marker.get("step"), int):
        raise ValueError(f"load: {marker_path} is not a flashfsdp checkpoint marker")
    checksums = marker.get("checksums")
    if checksums is not None and not (isinstance(checksums, dict) and
                                      all(isinstance(v, int) for v in checksums.values())):
        raise ValueError(f"load: {marker_path} is corrupt: its checksums are not a map of file names to integers")
    return marker


def complete_marker(path: str) -> dict | None:
    """The marker of ``path`` if it is a complete checkpoint directory, else None (never raises)."""
    try:
        return read_marker(path) if os.path.isdir(path) else None
    except (ValueError, OSError):
        return None
