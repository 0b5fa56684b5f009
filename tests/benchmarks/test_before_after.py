"""benchmarks.before_after: the medians per checkout and row, and the refusals of bad arguments
(a running comparison of two checkouts takes minutes; its parts are checked here)."""

from __future__ import annotations

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

    (tmp_path / "before" / "flashfsdp").mkdir(parents=True)
    (tmp_path / "before" / "flashfsdp" / "__init__.py").write_text("")
    row = {"system": "flashfsdp", "step_ms": "10", "table": "t"}
    monkeypatch.setattr(before_after, "run_once", lambda tree, name, args, out: [dict(row)])
    with pytest.raises(SystemExit):
        main(["--before", str(tmp_path / "before"), "--rounds", "1", "--out", str(tmp_path / "out"),
              "--paired", "step_ms,stepms", "--", "step"])
    err = capsys.readouterr().err
    assert "--paired stepms: no such column" in err and "step_ms" in err
    written = list((tmp_path / "out").rglob("before_after_step*"))
    assert {p.name for p in written} >= {"before_after_step.md", "before_after_step_paired.csv"}
