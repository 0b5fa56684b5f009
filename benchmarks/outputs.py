"""Where a benchmark's results go (:func:`add_output_arguments`, :func:`output_dir`).

By default an untracked ``bench-results/<device slug>/`` in the current directory, so that a run
never touches the committed tables; ``--record`` writes ``benchmarks/results/<device slug>/``, the
tables committed with the code (and quoted by the README); ``--out DIR`` anywhere else.
"""

from __future__ import annotations

import argparse
from pathlib import Path

RESULTS_ROOT = Path(__file__).resolve().parent / "results"  # committed: written with --record only
SCRATCH_DIRNAME = "bench-results"  # the default, untracked (.gitignore), under the current directory


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """Add ``--out DIR`` and ``--record`` (mutually exclusive) to a benchmark's command line;
    :func:`output_dir` turns them into the folder."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--out", type=Path, default=None,
                       help=f"output folder (default: ./{SCRATCH_DIRNAME}/<device>/, untracked)")
    group.add_argument("--record", action="store_true",
                       help="write into benchmarks/results/<device>/, the committed tables the README quotes")


def output_dir(slug: str, *, out: "Path | str | None" = None, record: bool = False) -> Path:
    """The folder a benchmark writes to, created if missing.

    ``out`` when given; else ``benchmarks/results/<slug>/`` with ``record`` (the committed tables);
    else ``./bench-results/<slug>/`` under the current directory (untracked scratch results).

    Raises:
        ValueError: both ``out`` and ``record`` given (the command line's ``--out`` and
            ``--record`` exclude each other).
    """
    if out is not None and record:
        raise ValueError(f"output_dir: give out ({out}) or record=True, not both")
    if out is not None:
        path = Path(out)
    else:
        path = (RESULTS_ROOT if record else Path.cwd() / SCRATCH_DIRNAME) / slug
    path.mkdir(parents=True, exist_ok=True)
    return path
