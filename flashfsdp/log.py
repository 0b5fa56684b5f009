"""The `flashfsdp` logger: progress messages and notices of the library and the training job.

Every module logs through `get_logger(__name__)`, a child of the `flashfsdp` logger carrying a
`RankFilter`: a record is kept only on the ranks chosen by `set_log_ranks` (rank 0 by default;
"all" keeps every rank's), so a notice printed by each of 16 ranks appears once; errors are kept
on every rank. The rank is
`torch.distributed.get_rank()` once a process group is initialised, else the RANK environment
variable (torchrun sets it before the group exists), else 0.

The library installs no handler of its own (Python's convention: the application decides);
without one, warnings and errors reach Python's last-resort handler on stderr. `configure`
installs one stream handler on the `flashfsdp` logger, as `flashfsdp-train` does.

This module imports nothing from torch, so a command line can set up logging before torch loads.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Callable, Iterable

LOGGER_NAME = "flashfsdp"
# The environment variable that sets the logging ranks at import ("all", or ranks as "0,3").
RANKS_ENV = "FLASHFSDP_LOG_RANKS"

_ranks: frozenset[int] | None = frozenset({0})  # None: every rank


def parse_ranks(spec: str | int | Iterable[int]) -> frozenset[int] | None:
    """The ranks of `spec`: "all" (None: every rank), an int, "0,3", or an iterable of ints.

    Raises:
        ValueError: a rank that is not a non-negative integer (the message names the value).
    """
    if isinstance(spec, str):
        if spec.strip().lower() == "all":
            return None
        parts = [p.strip() for p in spec.split(",") if p.strip()]
    elif isinstance(spec, int):
        parts = [spec]
    else:
        parts = list(spec)
    try:
        ranks = frozenset(int(p) for p in parts)
    except (TypeError, ValueError):
        raise ValueError(f"log ranks {spec!r}: give 'all' or ranks as non-negative integers, e.g. '0' or "
                         "'0,3'") from None
    if not ranks or min(ranks) < 0:
        raise ValueError(f"log ranks {spec!r}: give 'all' or ranks as non-negative integers, e.g. '0' or '0,3'")
    return ranks


def set_log_ranks(spec: str | int | Iterable[int]) -> None:
    """Keep the `flashfsdp` loggers' records on the ranks of `spec` only (see `parse_ranks`;
    "all": every rank). Process-wide; takes effect at once.

    Raises:
        ValueError: see `parse_ranks`.
    """
    global _ranks
    _ranks = parse_ranks(spec)


def log_ranks() -> frozenset[int] | None:
    """The ranks whose records are kept (None: every rank)."""
    return _ranks


def current_rank() -> int:
    """This process's rank: torch.distributed's once initialised (read without importing torch),
    else the RANK environment variable, else 0."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


class RankFilter(logging.Filter):
    """Keeps a record only on the ranks of `set_log_ranks`, and errors (ERROR and above) on every
    rank (the rank that failed says so); sets `record.rank` on the records kept."""

    def filter(self, record: logging.LogRecord) -> bool:
        """True for an error, or when this process's rank is one of the logging ranks."""
        rank = current_rank()
        record.rank = rank
        return record.levelno >= logging.ERROR or _ranks is None or rank in _ranks


_FILTER = RankFilter()


def get_logger(name: str | None = None) -> logging.Logger:
    """The `flashfsdp` logger, or its child for module `name` ("flashfsdp.train.trainer" or a
    short "train.trainer"), with the rank filter attached."""
    if name is None or name == LOGGER_NAME:
        full = LOGGER_NAME
    else:
        full = name if name.startswith(LOGGER_NAME + ".") else f"{LOGGER_NAME}.{name}"
    logger = logging.getLogger(full)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    return logger


class _Formatter(logging.Formatter):
    """`prefix: message`, `prefix: warning: message` at WARNING and above, and `prefix [rank r]: ...`
    when more than rank 0 logs, or for another rank's error."""

    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        """The record as one or more lines, each led by the prefix."""
        head, rank = self.prefix, getattr(record, "rank", current_rank())
        if _ranks != frozenset({0}) or rank != 0:
            head += f" [rank {rank}]"
        level = f"{record.levelname.lower()}: " if record.levelno >= logging.WARNING else ""
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return f"{head}: {level}{text}"


class _WriteHandler(logging.Handler):
    """Hands each formatted record to a `write(line)` callable."""

    def __init__(self, write: Callable[[str], None]):
        super().__init__()
        self.write = write

    def emit(self, record: logging.LogRecord) -> None:
        """Format and write `record` (errors go to `handleError`, as logging's own handlers)."""
        try:
            self.write(self.format(record))
        except Exception:  # noqa: BLE001 - logging must never raise into the caller
            self.handleError(record)


def _stderr_line(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def configure(ranks: str | int | Iterable[int] = 0, level: int = logging.INFO, prefix: str = LOGGER_NAME,
              write: Callable[[str], None] | None = None) -> logging.Handler:
    """Show the `flashfsdp` logger's records of `level` and above, from the ranks of `ranks`.

    Installs one handler on the `flashfsdp` logger (replacing the one of an earlier `configure`),
    stops propagation to the root logger's handlers (no line printed twice), and sets the ranks.

    Args:
        ranks: the logging ranks (see `parse_ranks`): 0 by default, "all" for every rank.
        level: the lowest level shown (`logging.INFO` by default).
        prefix: what each line starts with, e.g. "flashfsdp-train".
        write: called with each formatted line (default: print to stderr); a progress bar passes
            its own writer (e.g. `tqdm.write`) so that lines appear above the bar.

    Returns:
        The handler installed.

    Raises:
        ValueError: `ranks` is not valid (see `parse_ranks`).
    """
    set_log_ranks(ranks)
    logger = get_logger()
    for old in [h for h in logger.handlers if isinstance(h, _WriteHandler)]:
        logger.removeHandler(old)
    handler = _WriteHandler(write or _stderr_line)
    handler.setFormatter(_Formatter(prefix))
    logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
    return handler


def _ranks_from_environment() -> None:
    """`set_log_ranks` from `RANKS_ENV` if set; an invalid value keeps rank 0, with a warning."""
    spec = os.environ.get(RANKS_ENV)
    if spec:
        try:
            set_log_ranks(spec)
        except ValueError as err:
            get_logger().warning("%s ignored: %s", RANKS_ENV, err)


_ranks_from_environment()
