"""A benchmark's rows (a list of dicts) as tables: fixed-width text for the terminal
(:func:`format_table`), CSV with every column (:func:`write_csv`), and a Markdown page with the
environment line (:func:`write_markdown`, its table: :func:`markdown_table`); floats to 4
significant digits. :func:`memory_verdict` writes a memory check as one cell.

Every benchmark builds its rows, stamps them with ``benchmarks.environment.environment()``, prints
them and saves them under ``benchmarks.outputs.output_dir()`` (charts: ``benchmarks.plots``), in
the style of the Triton tutorials' ``triton.testing`` benchmarks and Liger-Kernel's
``benchmark/scripts/utils.py``.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:
    from benchmarks.environment import Environment


def _cell(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        return f"{value:.4g}" if abs(value) < 1e4 else f"{value:.0f}"
    return "" if value is None else str(value)


def format_table(rows: Sequence[Mapping[str, object]], columns: Sequence[str]) -> str:
    """A fixed-width plain-text table of ``columns`` (floats to 4 significant digits)."""
    cells = [[_cell(row.get(column)) for column in columns] for row in rows]
    widths = [max([len(column)] + [len(line[i]) for line in cells]) for i, column in enumerate(columns)]
    lines = ["  ".join(column.ljust(width) for column, width in zip(columns, widths)),
             "  ".join("-" * width for width in widths)]
    lines += ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)) for line in cells]
    return "\n".join(lines)


def write_csv(rows: Sequence[Mapping[str, object]], path: Path) -> None:
    """All rows, all their keys (in first-seen order) as columns."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(path, "w", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


def write_markdown(rows: Sequence[Mapping[str, object]], columns: Sequence[str], path: Path, *,
                   title: str, env: "Environment", notes: Sequence[str] = ()) -> None:
    """A Markdown page: title, environment line, notes, and a table of ``columns``."""
    lines = [f"# {title}", "",
             f"Device: {env.device_name} · torch {env.torch_version} · triton {env.triton_version} · {env.date}", ""]
    lines += [f"- {note}" for note in notes]
    if notes:
        lines.append("")
    lines += markdown_table(rows, columns)
    path.write_text("\n".join(lines) + "\n")


def markdown_table(rows: Sequence[Mapping[str, object]], columns: Sequence[str]) -> list[str]:
    """The lines of a Markdown table of ``columns`` (floats to 4 significant digits, NaN and None
    as empty cells)."""
    return (["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
            + ["| " + " | ".join(_cell(row.get(column)) for column in columns) + " |" for row in rows])


def memory_verdict(growth_mib: float, bound_mib: float, who: str = "") -> str:
    """A memory check as one line: ``"rank 0: growth 12.3 MiB ≤ bound 45.6 MiB"`` (``>`` and
    "(over)" when the growth exceeds the bound); ``who`` prefixes it when given."""
    within = growth_mib <= bound_mib
    return (f"{who + ': ' if who else ''}growth {growth_mib:.1f} MiB {'≤' if within else '>'} bound {bound_mib:.1f} MiB"
            + ("" if within else " (over)"))
