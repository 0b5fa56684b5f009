"""Checksums of a checkpoint's files: computed while DCP writes them, verified before a load.

Algorithm: CRC-32 (``zlib.crc32``, the ISO-HDLC / zip polynomial), one per file, stored in the
completion marker as unsigned ints. At save, each rank's shard files are checksummed from the very
bytes DCP writes (:class:`ChecksummingWriter`: no file is read back), ``extra.pt`` from its bytes
in memory and DCP's ``.metadata`` (small) read back by rank 0. At load, every rank checks the small
files it reads anyway, and the shard files are shared out: rank r reads and checks every W-th
(:func:`verify_share`), so a load reads each byte once more in all, spread over the ranks. CRC-32
detects every burst error of up to 32 bits and any other change but with probability 2^-32; it is
no defence against a deliberate forgery (see the trust model in ``flashfsdp.checkpoint``).
"""

from __future__ import annotations

import contextlib
import io
import os
import zlib
from pathlib import Path

from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import FileSystem

from .space import explain, free_bytes, no_room

CHUNK = 8 << 20  # bytes read at a time when verifying


class _RecordingFile(io.FileIO):
    """A file opened for writing (``wb``) that records the first ``OSError`` of its writes in
    ``errors`` (``"error"``: (the error, the file)): torch's zip writer reports a refused write
    only as "unexpected pos", losing it (see ``space.py``)."""

    def __init__(self, path, errors: dict):
        super().__init__(path, "wb")
        self._errors = errors

    def write(self, data) -> int:
        try:
            return super().write(data)
        except OSError as exc:
            self._errors.setdefault("error", (exc, os.fspath(self.name)))
            raise


class _ChecksummingStream(io.BufferedWriter):
    """A binary file opened for writing that keeps the CRC-32 of everything written through it."""

    def __init__(self, raw: io.FileIO):
        super().__init__(raw)
        self.crc = 0

    def write(self, data) -> int:
        self.crc = zlib.crc32(data, self.crc)
        return super().write(data)

    def fileno(self) -> int:  # DCP fsyncs the fileno: flush first, so that the bytes are in the file
        self.flush()
        return super().fileno()


class _ChecksummingFileSystem(FileSystem):
    """DCP's local file system, recording the CRC-32 of each ``.distcp`` file it writes, and the
    first write error of any file it writes (``errors``)."""

    def __init__(self, checksums: dict[str, int]):
        super().__init__()
        self.checksums = checksums
        self.errors: dict = {}

    @contextlib.contextmanager
    def create_stream(self, path, mode: str):
        if mode != "wb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with _ChecksummingStream(_RecordingFile(os.fspath(path), self.errors)) as stream:
            yield stream
        if str(path).endswith(".distcp"):
            self.checksums[Path(path).name] = stream.crc


class ChecksummingWriter(FileSystemWriter):
    """DCP's ``FileSystemWriter`` that also checksums the shard files this rank writes, and
    raises a write that found no room as the ``OSError`` it was (see ``space.py``).

    After ``dcp.save``, :attr:`checksums` maps each of this rank's shard file names
    (``__<rank>_<i>.distcp``) to its CRC-32, and :attr:`needed` is the bytes this rank planned
    to write (None before its plan). Arguments as ``FileSystemWriter``.
    """

    def __init__(self, path: str | os.PathLike, **kwargs):
        super().__init__(path, **kwargs)
        self.checksums: dict[str, int] = {}
        self.fs = _ChecksummingFileSystem(self.checksums)
        self.needed: int | None = None
        self._free = free_bytes(os.fspath(path))

    def write_data(self, plan, planner):
        """``FileSystemWriter.write_data``; a write that found no room raises ``space.explain``'s
        ``OSError`` (naming the file and the bytes needed) instead of torch's "unexpected pos"."""
        self.needed = sum((item.tensor_storage_size() or 0) if item.bytes_io_data is None
                          else item.bytes_io_data.nbytes for item in plan.items)
        return self._explained(lambda: super(ChecksummingWriter, self).write_data(plan, planner))

    def finish(self, metadata, results) -> None:
        """``FileSystemWriter.finish`` (DCP's ``.metadata``, on the coordinator), a write that
        found no room explained as in :meth:`write_data`."""
        self._explained(lambda: super(ChecksummingWriter, self).finish(metadata, results))

    def _explained(self, action):
        try:
            return action()
        except Exception as exc:
            recorded = self.fs.errors.get("error")
            error = no_room(recorded[0] if recorded else exc)
            if error is None:
                raise
            file = recorded[1] if recorded else os.fspath(self.path)
            raise explain(error, file, self.needed, self._free) from exc


def crc32_of_file(file: str) -> int:
    """The CRC-32 of the file's bytes (read in :data:`CHUNK` pieces). Raises OSError if unreadable."""
    crc = 0
    with open(file, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return crc


def check(where: str, file: str, crc: int, expected: int, holds: str) -> None:
    """Raise ValueError naming ``file`` and what it ``holds`` unless ``crc == expected``."""
    if crc != expected:
        raise ValueError(f"{where}: {file} fails its checksum (crc32 {crc:08x}, saved {expected:08x}): it changed "
                         f"after it was saved (damaged or edited); it holds {holds}; nothing was loaded: load "
                         f"another checkpoint (or pass verify=False to load it as it is)")


def verify_share(path: str, checksums: dict[str, int], contents: dict[str, list[str]], rank: int,
                 world_size: int) -> None:
    """Check this rank's share of the shard files of checkpoint ``path``: every ``world_size``-th
    of the files named in ``contents`` (sorted), starting at ``rank``.

    Args:
        checksums: file name -> CRC-32 as saved (the marker's).
        contents: file name -> the state-dict keys stored in it (named in the error).

    Raises:
        ValueError: a file has no saved checksum, or its bytes do not match it.
        OSError: a file cannot be read.
    """
    for name in sorted(contents)[rank::world_size]:
        if name not in checksums:
            raise ValueError(f"load: checkpoint {path} has no checksum for its shard file {name}: the marker does "
                             f"not belong to these files; load another checkpoint (or pass verify=False)")
        file = os.path.join(path, name)
        check("load", file, crc32_of_file(file), checksums[name], describe_keys(contents[name]))


def describe_keys(keys: list[str], limit: int = 8) -> str:
    """``'a', 'b', ... (N entries)``: the first ``limit`` state-dict keys of a file."""
    shown = ", ".join(f"'{k}'" for k in keys[:limit])
    more = f", ... ({len(keys)} entries)" if len(keys) > limit else ""
    return f"{shown}{more}" if keys else "no entries"
