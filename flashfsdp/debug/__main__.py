"""``python -m flashfsdp.debug RUN_OR_DIR``: where the ranks of a failed job were, from their dumps.

Prints the diagnosis of :func:`flashfsdp.debug.diagnose`, then each rank's last ``--entries``
recorded collectives. Exit status 0, or 2 when no dump is found or a dump cannot be read.
"""

from __future__ import annotations

import argparse
import sys

from flashfsdp.debug import diagnose, load_dumps
from flashfsdp.runtime.flight_report import collective


def _entry_line(entry: dict) -> str:
    where = "" if entry["kind"] == "control" else f"{entry['phase']}, "
    return (f"    seq {entry['seq']:>6}  {collective(entry)} ({where}step {entry['step']}, {entry['nbytes']} B) "
            f"{entry['state']}")


def main(argv: list[str] | None = None) -> int:
    """The command line (see the module docstring); returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m flashfsdp.debug",
                                     description="Where the ranks of a job diverged, from their flight recorder dumps.")
    parser.add_argument("path", help="the directory of the flight_rank<r>.json dumps, or the run directory "
                                     "holding them in flight/")
    parser.add_argument("--entries", type=int, default=8, help="recorded collectives shown per rank (default 8)")
    args = parser.parse_args(argv)
    try:
        print(diagnose(args.path))
        reports = load_dumps(args.path)
    except (FileNotFoundError, ValueError) as exc:
        print(f"python -m flashfsdp.debug: {exc}", file=sys.stderr)
        return 2
    for report in sorted(reports, key=lambda r: r["rank"]):
        shown = report["entries"][-args.entries:] if args.entries > 0 else []
        print(f"\nrank {report['rank']} ({report.get('host')}, pid {report.get('pid')}): last {len(shown)} of "
              f"{len(report['entries'])} recorded collectives")
        for entry in shown:
            print(_entry_line(entry))
    return 0


if __name__ == "__main__":
    sys.exit(main())
