"""benchmarks.soak's disagreement scenarios, end to end at W = 2: a rank that saves while the other
runs a forward, and int8 all-gathers on one rank; every rank raises, naming both ranks' positions
(or the setting that differs). No timing is asserted beyond the scenario's own target."""

from __future__ import annotations

import pytest

from benchmarks.soak.disagreements import DISAGREEMENTS, run_disagreement


@pytest.mark.parametrize("name", ["save vs forward", "int8 all-gathers on one rank"])
def test_both_ranks_raise_naming_both(name, tmp_path):
    scenario = next(d for d in DISAGREEMENTS if d.name == name)
    row = run_disagreement(scenario, 3.0, str(tmp_path))
    assert row["rank0_named"] and row["rank1_named"], row
    assert row["all_ended"] and row["rank0"] != "ok" and row["rank1"] != "ok", row
    assert all(words in row["diagnosis"] for words in scenario.named), row["diagnosis"]
