"""Debugging a job whose ranks diverged: the flight recorder's dumps, and where they say it happened.

- :func:`set_trace_dir` — where each rank dumps its flight recorder (``<dir>/flight/``) on a failed
  or timed-out collective, an NCCL watchdog abort, SIGTERM or SIGINT (the training job passes its
  run directory; without it, ``FLASHFSDP_TRACE_DIR``).
- :func:`dump` — dump this rank's ring now.
- :func:`load_dumps` / :func:`diagnose` — read every rank's dump of a directory and say where the
  ranks are and where they diverged; ``python -m flashfsdp.debug RUN_OR_DIR`` prints it.

See ``flashfsdp.runtime.flight`` for what is recorded.
"""

from __future__ import annotations

import glob
import json
import os
import re

from flashfsdp.runtime.flight_dump import ENV_DIR, SUBDIR, dump, set_trace_dir, trace_dir
from flashfsdp.runtime.flight_report import describe

__all__ = ["ENV_DIR", "diagnose", "dump", "find_dumps", "load_dumps", "set_trace_dir", "trace_dir"]
_NAME = re.compile(r"flight_rank(\d+)\.json$")


def find_dumps(path: str | os.PathLike) -> list[str]:
    """The dump files of ``path``: a directory holding ``flight_rank<r>.json`` files, or a run
    directory holding them in ``flight/``; sorted by rank.

    Raises:
        FileNotFoundError: ``path`` does not exist, or holds no dump (what was looked for is named).
    """
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path} is not a directory (give the directory of the flight_rank<r>.json dumps, "
                                f"or the run directory holding them in {SUBDIR}/)")
    for directory in (path, os.path.join(path, SUBDIR)):
        found = [f for f in glob.glob(os.path.join(directory, "flight_rank*.json")) if _NAME.search(f)]
        if found:
            return sorted(found, key=lambda f: int(_NAME.search(f).group(1)))
    raise FileNotFoundError(f"no flight recorder dump (flight_rank<r>.json) in {path} nor in {os.path.join(path, SUBDIR)}")


def load_dumps(path: str | os.PathLike) -> list[dict]:
    """Every rank's report found by :func:`find_dumps`.

    Raises:
        FileNotFoundError: as :func:`find_dumps`.
        ValueError: a dump that is not a flight recorder report (the file is named).
    """
    reports = []
    for file in find_dumps(path):
        try:
            with open(file, encoding="utf-8") as f:
                report = json.load(f)
            if not {"rank", "position", "entries"} <= set(report):
                raise ValueError("missing keys")
        except (OSError, ValueError) as exc:
            raise ValueError(f"{file} is not a flashfsdp flight recorder dump ({exc})") from exc
        reports.append(report)
    return reports


def diagnose(path: str | os.PathLike) -> str:
    """Where the ranks of the dumps in ``path`` are, and where they diverged (see
    ``flashfsdp.runtime.flight_report.describe``); ranks of the job without a dump are named.

    Raises:
        FileNotFoundError / ValueError: as :func:`load_dumps`.
    """
    reports = load_dumps(path)
    world = max(int(r.get("world_size") or 1) for r in reports)
    present = {int(r["rank"]) for r in reports}
    text = describe(reports, [r for r in range(world) if r not in present])
    reasons = "; ".join(f"rank {r['rank']}: {r.get('reason')}" for r in sorted(reports, key=lambda r: r["rank"]))
    return f"{len(reports)} dump(s) of a job of {world} rank(s) ({reasons})\n{text}"
