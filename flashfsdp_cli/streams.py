"""Output that outlives its reader: `flashfsdp-train ... | tee log` stopped by Ctrl-C.

A terminal's Ctrl-C reaches every process of the foreground job: `tee` dies at once, and the
launcher and its workers (which write to the same pipe) are left with a pipe that nobody reads.
Python ignores SIGPIPE, so each later write raises `BrokenPipeError`: a worker saving its final
checkpoint would die at its first log line, and the launcher at its last message. So the
command's processes write through `sturdy_output`: a write (or flush) to stdout or stderr that
fails with an `OSError` points that file descriptor at the null device and drops the text, and the
process goes on; what it had still to say is lost with the reader, nothing else.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator


class SturdyStream:
    """A text stream (`sys.stdout` / `sys.stderr`) whose writes never raise `OSError`: the first
    one that fails sends its file descriptor to the null device (`os.devnull`), and the text is
    dropped. Everything else is the wrapped stream's.

    Attributes:
        stream: the wrapped stream.
        lost: whether a write failed (the output now goes to the null device).
    """

    def __init__(self, stream):
        self.stream = stream
        self.lost = False

    def write(self, text: str) -> int:
        """Write `text`; on an `OSError` drop it (see the class). Returns its length."""
        try:
            return self.stream.write(text)
        except OSError:
            self._to_null()
            return len(text)

    def flush(self) -> None:
        """Flush; on an `OSError` the buffered text goes to the null device."""
        try:
            self.stream.flush()
        except OSError:
            self._to_null()

    def _to_null(self) -> None:
        self.lost = True
        try:
            fd = self.stream.fileno()
        except (OSError, ValueError, AttributeError):  # not a file (a test's capture): drop the text
            return
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)
        with contextlib.suppress(OSError, ValueError):
            self.stream.flush()  # what stayed in its buffer, into the null device

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


@contextlib.contextmanager
def sturdy_output() -> Iterator[None]:
    """Inside the block, `sys.stdout` and `sys.stderr` are `SturdyStream`s (unless already);
    leaving it flushes them through the wrappers (so that the interpreter's last flush at exit
    cannot fail either) and puts the streams back."""
    saved = sys.stdout, sys.stderr
    if not isinstance(sys.stdout, SturdyStream) and sys.stdout is not None:
        sys.stdout = SturdyStream(sys.stdout)
    if not isinstance(sys.stderr, SturdyStream) and sys.stderr is not None:
        sys.stderr = SturdyStream(sys.stderr)
    try:
        yield
    finally:
        for stream in (sys.stdout, sys.stderr):
            if isinstance(stream, SturdyStream):
                stream.flush()
        sys.stdout, sys.stderr = saved
