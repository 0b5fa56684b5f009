"""Debugging a job whose ranks diverged: the flight recorder's dumps, and where they say it happened.

- :func:`set_trace_dir` — where each rank dumps its flight recorder (``<dir>/flight/``) on a failed
  or timed-out collective, an NCCL watchdog abort, SIGTERM or SIGINT (the training job passes its
  run directory; without it, ``FLASHFSDP_TRACE_DIR``).
- :func:`dump` — dump this rank's ring now; :func:`report_failure` — an application's own failure
  (a torch collective whose peer died, say) diagnosed as a flashfsdp collective's is, dumped and
  logged at once, before a cleanup that a signal could cut short.
- :func:`load_dumps` / :func:`diagnose` — read every rank's dump of a directory and say where the
  ranks are and where they diverged; ``python -m flashfsdp.debug RUN_OR_DIR`` prints it.

- :func:`set_desync_window` / :func:`desync_window` — how long a collective may wait before the
  ranks compare their positions through the store (``flashfsdp.runtime.flight_desync``: ranks
  waiting on collectives that cannot pair raise at once instead of at the process group's timeout).
- :func:`set_step` — the application's step the next collectives belong to (the training job's).

See ``flashfsdp.runtime.flight`` for what is recorded. A dump is read only when it is a flight
recorder report: a damaged one (missing keys, entries that are not a list, a rank that is not an
integer, an impossible world size, more than :data:`MAX_DUMP_BYTES`) is refused with one line
naming the file and what is wrong, its size bounded before it is read.
"""

from __future__ import annotations

import glob
import json
import os
import re

from flashfsdp.runtime.flight import set_step
from flashfsdp.runtime.flight_desync import set_window as set_desync_window
from flashfsdp.runtime.flight_desync import window as desync_window
from flashfsdp.runtime.flight_dump import ENV_DIR, SUBDIR, dump, report_failure, set_trace_dir, trace_dir
from flashfsdp.runtime.flight_report import describe

from .dump_check import MAX_DUMP_BYTES, MAX_WORLD_SIZE, check_report

__all__ = ["ENV_DIR", "MAX_DUMP_BYTES", "MAX_WORLD_SIZE", "desync_window", "diagnose", "dump", "find_dumps",
           "load_dumps", "report_failure", "set_desync_window", "set_step", "set_trace_dir", "trace_dir"]
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
    """Every rank's report found by :func:`find_dumps`, each checked (``dump_check.check_report``).

    Raises:
        FileNotFoundError: as :func:`find_dumps`.
        ValueError: a dump that is not a flight recorder report, one line: the file, and what is
            wrong with it (unreadable, not JSON, over :data:`MAX_DUMP_BYTES`, a key missing or of
            the wrong type, a rank other than its file name's, two dumps of one rank).
    """
    reports, seen = [], {}
    for file in find_dumps(path):
        try:
            size = os.path.getsize(file)
            if size > MAX_DUMP_BYTES:
                raise ValueError(f"it is {size} bytes, more than the {MAX_DUMP_BYTES} a dump can be")
            with open(file, encoding="utf-8") as f:
                report = json.load(f)
            check_report(report, int(_NAME.search(file).group(1)))
        except RecursionError:
            raise ValueError(f"{file}: not a flashfsdp flight recorder dump: nested too deep") from None
        except (OSError, ValueError) as exc:
            raise ValueError(f"{file}: not a flashfsdp flight recorder dump: {_one_line(exc)}") from None
        if report["rank"] in seen:
            raise ValueError(f"{file}: not a flashfsdp flight recorder dump: rank {report['rank']} has a dump already "
                             f"({seen[report['rank']]})")
        seen[report["rank"]] = file
        reports.append(report)
    return reports


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text[:300] if text else type(exc).__name__


def _absent(world: int, present: set[int]):
    """The ranks below ``world`` without a dump, in order (a generator: ``world`` may be large)."""
    return (r for r in range(world) if r not in present)


def diagnose(path: str | os.PathLike) -> str:
    """Where the ranks of the dumps in ``path`` are, and where they diverged (see
    ``flashfsdp.runtime.flight_report.describe``); ranks of the job without a dump are named
    (runs of them as ranges).

    Raises:
        FileNotFoundError / ValueError: as :func:`load_dumps`.
    """
    reports = load_dumps(path)
    world = max(max(r.get("world_size") or 1 for r in reports), max(r["rank"] for r in reports) + 1)
    present = {r["rank"] for r in reports}
    text = describe(reports, _absent(world, present))
    reasons = "; ".join(f"rank {r['rank']}: {r.get('reason')}" for r in sorted(reports, key=lambda r: r["rank"]))
    return f"{len(reports)} dump(s) of a job of {world} rank(s) ({reasons})\n{text}"
