"""Run a benchmark on two checkouts of flashfsdp, interleaved, and put their tables side by side.

A design change is judged against the code before it, on the same machine and under the same
load. This runs ``python -m benchmarks.<name> <args>`` alternately in the checkout ``--before``
(e.g. ``git worktree add /tmp/before <commit>``) and in this one, ``--rounds`` times each, every
run in a fresh process whose ``flashfsdp`` and ``benchmarks`` are its checkout's (``PYTHONPATH``
first), and writes the median of every numeric column over the rounds per (checkout, row), with
the rows' own in-run ratios (``vs_fsdp2`` ...) as the benchmark computed them. Each benchmark run
also measures torch FSDP2 in the same process, so the ratios compare each checkout with FSDP2
under the same load, and the checkouts with each other round by round.

    git worktree add /tmp/before HEAD~1
    python -m benchmarks.before_after --before /tmp/before --rounds 3 --record -- step --host-bound

Also, per row, the ratio after / before of ``--paired`` columns (default ``step_ms``) within each
round, whose two runs ran back to back: its median over the rounds, its range, and in how many
rounds the after run had the lower number. A drift of the machine between rounds (the unsharded
row, the same code in both checkouts, can move by several percent) cancels in these ratios, not
in the medians of each checkout.

``--bench-from-after``: a benchmark the ``--before`` checkout does not have (or has in an older
form) runs from this checkout in both: the before runs put first on ``PYTHONPATH`` (and take as
their working directory) a temporary folder holding only copies of this checkout's ``benchmarks/``
and ``flashfsdp_dev/``, then the before tree, so that they measure the before ``flashfsdp`` with
this checkout's benchmark code.

    python -m benchmarks.before_after --before /tmp/before --bench-from-after -- small_units --rounds 2

Writes ``before_after_<name>[_<tag>].csv`` / ``.md`` (``--record``: ``benchmarks/results/<device>/``),
the paired ratios as a second table in the ``.md`` and in ``before_after_<name>[_<tag>]_paired.csv``.
"""

from __future__ import annotations

import argparse
import csv
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.environment import environment
from benchmarks.outputs import add_output_arguments, output_dir
from benchmarks.tables import format_table, markdown_table, write_csv, write_markdown

HERE = Path(__file__).resolve().parent.parent
# The packages --bench-from-after copies from this checkout for the before runs.
BENCH_PACKAGES = ("benchmarks", "flashfsdp_dev")


def run_once(tree: Path, name: str, args: list[str], out: Path, code: Path | None = None) -> list[dict]:
    """One run of ``benchmarks.<name>`` in checkout ``tree``; the rows of every CSV it wrote.

    Args:
        tree: the checkout whose ``flashfsdp`` (and, without ``code``, whose benchmarks) run.
        name: the benchmark module under ``benchmarks``.
        args: its arguments (``--out`` is added).
        out: the folder it writes its tables to.
        code: a folder from :func:`bench_code_folder` whose ``benchmarks`` and ``flashfsdp_dev``
            run instead of ``tree``'s: first on ``PYTHONPATH`` and the working directory (which
            ``python -m`` puts first on ``sys.path``, so ``tree``'s own cannot shadow them).

    Raises:
        RuntimeError: the run failed (its output's tail in the message).
    """
    first = [str(code)] if code is not None else []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([*first, str(tree), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", f"benchmarks.{name}", *args, "--out", str(out)],
                          cwd=code if code is not None else tree, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmarks.{name} in {tree} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    rows = []
    for path in sorted(out.glob("*.csv")):
        with path.open() as fh:
            rows += [dict(row, table=path.stem) for row in csv.DictReader(fh)]
    return rows


def bench_code_folder(source: Path, folder: Path) -> Path:
    """``folder`` (created) holding copies of ``source``'s :data:`BENCH_PACKAGES` and nothing else
    (no ``__pycache__``): the benchmark code that ``--bench-from-after`` runs against another
    checkout's ``flashfsdp``. Returns ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    for package in BENCH_PACKAGES:
        shutil.copytree(source / package, folder / package, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return folder


def has_benchmark(tree: Path, name: str) -> bool:
    """Whether checkout ``tree`` holds the module ``benchmarks.<name>`` (a file or a package
    with ``__main__.py``)."""
    path = tree / "benchmarks" / Path(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__main__.py").is_file()


def _number(value: str) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def summarise(runs: dict[str, list[list[dict]]], key: str) -> list[dict]:
    """Per checkout and row (``table`` and ``key`` column), the median over rounds of every numeric
    column (other columns from the first round)."""
    out = []
    for checkout, rounds in runs.items():
        for i, first in enumerate(rounds[0]):
            row = {"checkout": checkout, **first}
            for column, value in first.items():
                values = [_number(r[i].get(column)) for r in rounds if i < len(r)]
                if _number(value) is not None and all(v is not None for v in values):
                    row[column] = round(statistics.median(values), 4)
            row["rounds"] = len(rounds)
            out.append(row)
    return sorted(out, key=lambda r: (r["table"], r.get(key, ""), r["checkout"] != "before"))


def paired(runs: dict[str, list[list[dict]]], key: str, columns: list[str]) -> list[dict]:
    """Per row (``table`` and ``key`` column) and each of ``columns``: after / before within each
    round (rows matched by table and key), as the median over the rounds, the smallest and largest
    ratio, and ``lower_after`` = in how many rounds the after number was the lower one."""
    out = []
    for i, first in enumerate(runs["before"][0]):
        name = (first["table"], first.get(key, ""))
        for column in columns:
            ratios = []
            for before, after in zip(runs["before"], runs["after"]):
                b = next((r for r in before if (r["table"], r.get(key, "")) == name), None)
                a = next((r for r in after if (r["table"], r.get(key, "")) == name), None)
                x = _number(b.get(column)) if b else None
                y = _number(a.get(column)) if a else None
                if x and y is not None:
                    ratios.append(y / x)
            if ratios:
                out.append({"table": name[0], key: name[1], "column": column,
                            "after_over_before": round(statistics.median(ratios), 4),
                            "min": round(min(ratios), 4), "max": round(max(ratios), 4),
                            "lower_after": f"{sum(r < 1 for r in ratios)}/{len(ratios)}"})
    return out


def _write_paired(ratios: list[dict], columns: list[str], directory: Path, stem: str) -> None:
    """``<stem>_paired.csv``, and the same table appended to ``<stem>.md``."""
    write_csv(ratios, directory / f"{stem}_paired.csv")
    with (directory / f"{stem}.md").open("a") as fh:
        fh.write("\n## After / before within each round\n\n"
                 "The two runs of a round ran back to back: median over the rounds of after / before, its "
                 "range, and the rounds in which the after run had the lower number.\n\n"
                 + "\n".join(markdown_table(ratios, columns)) + "\n")


def round_order(r: int) -> tuple[str, str]:
    """Which checkout runs first in round ``r`` (0-based): before first in even rounds, after first
    in odd ones, so that a machine that drifts during a round (warming up, other load) does not
    favour one checkout; an even number of rounds balances it."""
    return ("before", "after") if r % 2 == 0 else ("after", "before")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, required=True, help="checkout of the earlier code")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each checkout, interleaved")
    parser.add_argument("--key", default="system", help="the column that names a row (default: system)")
    parser.add_argument("--tag", default="", help="suffix of the output files")
    parser.add_argument("--paired", default="step_ms",
                        help="comma-separated columns whose after/before ratio within each round is reported (default: step_ms)")
    parser.add_argument("--bench-from-after", action="store_true",
                        help="run this checkout's benchmarks (and flashfsdp_dev) against the --before checkout's "
                             "flashfsdp: for a benchmark the before checkout does not have")
    add_output_arguments(parser)
    parser.add_argument("benchmark", nargs=argparse.REMAINDER, help="-- NAME [ARGS...]: benchmarks.NAME and its arguments")
    return parser


def _benchmark(parser: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The benchmark's name and arguments after ``--``, the other arguments checked (argparse's
    error, naming the argument, for each bad one)."""
    bench = [a for a in args.benchmark if a != "--"] if args.benchmark else []
    if not bench:
        parser.error("name the benchmark after --, e.g. -- step --host-bound")
    if not (args.before / "flashfsdp" / "__init__.py").is_file():
        parser.error(f"--before {args.before} is not a flashfsdp checkout (no flashfsdp/__init__.py)")
    if args.rounds < 1:
        parser.error("--rounds must be >= 1")
    if not has_benchmark(HERE, bench[0]):
        parser.error(f"benchmarks.{bench[0]}: no such benchmark in this checkout ({HERE / 'benchmarks'})")
    if not args.bench_from_after and not has_benchmark(args.before, bench[0]):
        parser.error(f"benchmarks.{bench[0]}: the --before checkout {args.before} does not have it; add "
                     f"--bench-from-after to run this checkout's benchmark against its flashfsdp")
    return bench


def run_rounds(before: Path, name: str, bench_args: list[str], rounds: int, *,
               bench_from_after: bool = False) -> dict[str, list[list[dict]]]:
    """``rounds`` runs of ``benchmarks.<name>`` in each checkout, interleaved (:func:`round_order`):
    per checkout ("before", "after"), per round, the rows of every CSV the run wrote.
    ``bench_from_after``: the before runs take this checkout's benchmark code
    (:func:`bench_code_folder`)."""
    trees = {"before": before.resolve(), "after": HERE}
    runs: dict[str, list[list[dict]]] = {k: [] for k in trees}
    with tempfile.TemporaryDirectory() as tmp:
        code = {"before": bench_code_folder(HERE, Path(tmp) / "bench-code") if bench_from_after else None,
                "after": None}
        for r in range(rounds):
            for checkout in round_order(r):
                out = Path(tmp) / f"{checkout}-{r}"
                runs[checkout].append(run_once(trees[checkout], name, bench_args, out, code[checkout]))
                print(f"round {r + 1}/{rounds}: {checkout} done", flush=True)
    return runs


def main(argv: list[str] | None = None) -> None:
    """Parse the command line, run both checkouts interleaved, print and write the table.

    Raises:
        SystemExit: bad arguments (``--before`` not a checkout, no benchmark named, a benchmark
            this checkout or, without ``--bench-from-after``, the before checkout lacks).
    """
    parser = _parser()
    args = parser.parse_args(argv)
    bench = _benchmark(parser, args)
    name = bench[0]
    runs = run_rounds(args.before, name, bench[1:], args.rounds, bench_from_after=args.bench_from_after)
    rows = summarise(runs, args.key)
    wanted = [c for c in args.paired.split(",") if c]
    unknown = [c for c in wanted if not any(c in row for row in rows)]
    ratios = paired(runs, args.key, [c for c in wanted if c not in unknown])
    env = environment(__import__("torch").device("cpu"))
    columns = ["checkout"] + [c for c in rows[0] if c not in ("checkout", "device", "torch", "triton", "date")]
    print(format_table(rows, columns))
    ratio_columns = ["table", args.key, "column", "after_over_before", "min", "max", "lower_after"]
    if ratios:
        print(format_table(ratios, ratio_columns))
    directory = output_dir(env.slug, out=args.out, record=args.record)
    stem = f"before_after_{name}" + (f"_{args.tag}" if args.tag else "")
    write_csv(rows, directory / f"{stem}.csv")
    flag = " --bench-from-after" if args.bench_from_after else ""
    note = [f"`python -m benchmarks.before_after --before <checkout>{flag} --rounds {args.rounds} -- {' '.join(bench)}`: "
            f"each checkout's run in a fresh process, interleaved (before first in odd rounds, after first in even "
            f"ones); medians over the rounds of each row's "
            f"numbers (ratios as each run computed them, against FSDP2 in the same run)."]
    if args.bench_from_after:
        note.append("--bench-from-after: both checkouts ran this checkout's benchmarks/ and flashfsdp_dev/ (copied "
                    "first on PYTHONPATH for the before runs); only flashfsdp differed.")
    write_markdown(rows, columns, directory / f"{stem}.md", title=f"Before / after: benchmarks.{name}", env=env,
                   notes=note)
    if ratios:
        _write_paired(ratios, ratio_columns, directory, stem)
    print(f"wrote {directory / stem}.csv/.md")
    if unknown:  # after writing what was measured: the rounds took minutes
        parser.error(f"--paired {','.join(unknown)}: no such column in benchmarks.{name}'s tables (they have: "
                     f"{', '.join(sorted({c for row in rows for c in row}))}); the rest was written")


if __name__ == "__main__":
    main()
