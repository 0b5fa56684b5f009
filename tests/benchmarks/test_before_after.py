"""benchmarks.before_after: the medians per checkout and row, and the refusals of bad arguments
(a running comparison of two checkouts takes minutes; its parts are checked here)."""

from __future__ import annotations

import pytest

from benchmarks.before_after import main, summarise


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
