"""benchmarks.before_after: the medians per checkout and row, the refusals of bad arguments, and
--bench-from-after (this checkout's benchmark code against the before checkout's flashfsdp: a
probe benchmark naming what each run imported, and one real toy run). A full comparison of two
checkouts takes minutes; its parts are checked here."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from benchmarks.before_after import main, paired, summarise


def test_medians_per_checkout_and_row_keep_text_columns():
    rounds = lambda *steps: [[{"system": "flashfsdp", "step_ms": str(s), "device": "cpu", "table": "t"}]
                             for s in steps]
    rows = summarise({"before": rounds(10, 30, 20), "after": rounds(5, 7, 6)}, "system")
    assert [(r["checkout"], r["step_ms"], r["device"], r["rounds"]) for r in rows] == [
        ("before", 20.0, "cpu", 3), ("after", 6.0, "cpu", 3)]


def test_bad_arguments_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["--before", str(tmp_path), "--", "step"])  # not a checkout
    assert "not a flashfsdp checkout" in capsys.readouterr().err
    (tmp_path / "flashfsdp").mkdir()
    (tmp_path / "flashfsdp" / "__init__.py").write_text("")
    with pytest.raises(SystemExit):
        main(["--before", str(tmp_path)])  # no benchmark named
    assert "name the benchmark after --" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--before", str(tmp_path), "--rounds", "0", "--", "step"])
    assert "--rounds must be >= 1" in capsys.readouterr().err


def test_rounds_alternate_which_checkout_runs_first():
    from benchmarks.before_after import round_order

    assert [round_order(r) for r in range(4)] == [("before", "after"), ("after", "before")] * 2


def test_paired_ratios_are_taken_within_each_round():
    row = lambda system, step: {"system": system, "step_ms": str(step), "table": "t"}  # noqa: E731
    runs = {"before": [[row("flashfsdp", 10), row("fsdp2", 20)], [row("flashfsdp", 20), row("fsdp2", 40)],
                       [row("flashfsdp", 10), row("fsdp2", 20)]],
            # rows in another order in one round: matched by table and system, not position
            "after": [[row("flashfsdp", 9), row("fsdp2", 20)], [row("fsdp2", 44), row("flashfsdp", 19)],
                      [row("flashfsdp", 11), row("fsdp2", 20)]]}
    got = {(r["system"], r["column"]): r for r in paired(runs, "system", ["step_ms", "missing"])}
    assert set(got) == {("flashfsdp", "step_ms"), ("fsdp2", "step_ms")}  # a column no row has: no entry
    assert got[("flashfsdp", "step_ms")]["after_over_before"] == 0.95  # 0.9, 0.95, 1.1: the drift cancels
    assert (got[("flashfsdp", "step_ms")]["min"], got[("flashfsdp", "step_ms")]["max"]) == (0.9, 1.1)
    assert got[("flashfsdp", "step_ms")]["lower_after"] == "2/3"
    assert got[("fsdp2", "step_ms")]["after_over_before"] == 1.0 and got[("fsdp2", "step_ms")]["lower_after"] == "0/3"


def test_an_unknown_paired_column_is_refused_after_the_tables_are_written(tmp_path, monkeypatch, capsys):
    from benchmarks import before_after

    for module in ("flashfsdp/__init__.py", "benchmarks/step.py"):
        (tmp_path / "before" / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "before" / module).write_text("")
    row = {"system": "flashfsdp", "step_ms": "10", "table": "t"}
    monkeypatch.setattr(before_after, "run_once", lambda tree, name, args, out, code=None: [dict(row)])
    with pytest.raises(SystemExit):
        main(["--before", str(tmp_path / "before"), "--rounds", "1", "--out", str(tmp_path / "out"),
              "--paired", "step_ms,stepms", "--", "step"])
    err = capsys.readouterr().err
    assert "--paired stepms: no such column" in err and "step_ms" in err
    written = list((tmp_path / "out").rglob("before_after_step*"))
    assert {p.name for p in written} >= {"before_after_step.md", "before_after_step_paired.csv"}


PROBE = """import argparse, csv
from pathlib import Path

import benchmarks, flashfsdp, flashfsdp_dev

parser = argparse.ArgumentParser()
parser.add_argument("--out", type=Path)
out = parser.parse_args().out
out.mkdir(parents=True, exist_ok=True)
with open(out / "probe.csv", "w", newline="") as f:
    csv.writer(f).writerows([["system", "step_ms", "flashfsdp", "benchmarks", "flashfsdp_dev"],
                             ["probe", "1.0", flashfsdp.__file__, benchmarks.__file__, flashfsdp_dev.__file__]])
"""


def _tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def _probe_checkouts(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A before checkout with its own (older) benchmarks package, without benchmarks.probe; an
    after checkout (this one, for before_after) with it."""
    from benchmarks import before_after

    before = _tree(tmp_path / "before", {"flashfsdp/__init__.py": "", "benchmarks/__init__.py": "",
                                         "flashfsdp_dev/__init__.py": ""})
    after = _tree(tmp_path / "after", {"flashfsdp/__init__.py": "", "benchmarks/__init__.py": "",
                                       "benchmarks/probe.py": PROBE, "flashfsdp_dev/__init__.py": ""})
    monkeypatch.setattr(before_after, "HERE", after)
    return before, after


def test_a_benchmark_the_before_checkout_lacks_runs_from_this_one(tmp_path, monkeypatch):
    before, after = _probe_checkouts(tmp_path, monkeypatch)
    main(["--before", str(before), "--bench-from-after", "--rounds", "1", "--out", str(tmp_path / "out"),
          "--", "probe"])
    with open(tmp_path / "out" / "before_after_probe.csv", newline="") as f:
        rows = {r["checkout"]: r for r in csv.DictReader(f)}
    imported = {checkout: {k: Path(r[k]) for k in ("flashfsdp", "benchmarks", "flashfsdp_dev")}
                for checkout, r in rows.items()}
    assert imported["before"]["flashfsdp"] == before / "flashfsdp" / "__init__.py"  # the before code ...
    for package in ("benchmarks", "flashfsdp_dev"):  # ... run by copies of this checkout's benchmark code
        path = imported["before"][package]
        assert path.parent.name == package and path.parent.parent.name == "bench-code", path
        assert not path.is_relative_to(before) and not path.is_relative_to(after)
    assert all(path.is_relative_to(after) for path in imported["after"].values())
    assert "--bench-from-after: both checkouts ran this checkout's benchmarks/" in (
        tmp_path / "out" / "before_after_probe.md").read_text()


def test_a_benchmark_missing_from_a_checkout_is_refused_before_any_run(tmp_path, monkeypatch, capsys):
    before, _ = _probe_checkouts(tmp_path, monkeypatch)
    with pytest.raises(SystemExit):
        main(["--before", str(before), "--rounds", "1", "--", "probe"])
    assert "the --before checkout" in (err := capsys.readouterr().err) and "add --bench-from-after" in err
    with pytest.raises(SystemExit):
        main(["--before", str(before), "--bench-from-after", "--", "no_such_benchmark"])
    assert "benchmarks.no_such_benchmark: no such benchmark in this checkout" in capsys.readouterr().err


def test_bench_from_after_runs_a_real_benchmark(tmp_path):
    """This checkout as both: its copied benchmarks and flashfsdp_dev run on their own (toy size)."""
    from benchmarks.before_after import HERE

    main(["--before", str(HERE), "--bench-from-after", "--rounds", "1", "--out", str(tmp_path), "--",
          "small_units", "--cpu", "--in-process", "--world-size", "1", "--layers", "1", "--dim", "8", "--batch", "2",
          "--steps", "1", "--warmup", "0", "--count-steps", "1", "--rounds", "1", "--systems", "flashfsdp", "fsdp2"])
    with open(tmp_path / "before_after_small_units.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert sorted((r["checkout"], r["system"]) for r in rows) == [
        ("after", "flashfsdp"), ("after", "fsdp2"), ("before", "flashfsdp"), ("before", "fsdp2")]
    assert all(float(r["loss_max_diff_vs_fsdp2"]) == 0.0 for r in rows)
