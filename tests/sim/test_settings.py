"""flashfsdp.sim.settings: the settings compared, the explicit prefetch lists and the sweep."""

from __future__ import annotations

import pytest

from flashfsdp import sim
from tests.sim.common import LINK, W
from tests.sim.common import model as _model


def test_settings_and_compare():
    model = _model()
    preds = sim.compare_settings(model, W, LINK)
    assert [p.label for p in preds] == [s.label for s in sim.SETTINGS]
    by = {p.label: p for p in preds}
    assert by["fwd+bwd (default)"].step_s <= by["no prefetch"].step_s
    row = preds[0].row()
    assert row["step_ms"] == pytest.approx(preds[0].step_s * 1e3)


def test_prefetch_ahead_lists():
    model = _model(n_blocks=3)
    forward, backward = sim.prefetch_ahead(model, 2)
    assert forward == {"<root>": ["layers.0", "layers.1"], "layers.0": ["layers.1", "layers.2"],
                       "layers.1": ["layers.2"], "layers.2": []}
    assert backward == {"layers.0": [], "layers.1": ["layers.0"], "layers.2": ["layers.1", "layers.0"]}
    with pytest.raises(ValueError, match="depth"):
        sim.prefetch_ahead(model, 0)


def test_sweep_rows_are_every_model_link_world_size_and_setting():
    small, large = _model(n_blocks=2), _model(n_blocks=3, fwd=0.02)
    rows = sim.sweep([small, large], [LINK, "ib400"], [2, 8])
    assert len(rows) == 2 * 2 * 2 * len(sim.SETTINGS)
    ib = sim.get_link("ib400").name
    assert [(r["link"], r["world_size"]) for r in rows[::len(sim.SETTINGS)]] == [
        ("test", 2), ("test", 8), (ib, 2), (ib, 8)] * 2
    assert [r["setting"] for r in rows[:len(sim.SETTINGS)]] == [s.label for s in sim.SETTINGS]
    first = rows[0]
    expected = sim.simulate(small, 2, LINK, **sim.SETTINGS[0].simulate_kwargs(small)).row()
    assert {k: first[k] for k in expected} == expected
    block = small.blocks[0]
    assert first["ag_per_block_ms"] == pytest.approx(LINK.all_gather_s(block.unsharded_bytes(2), 2) * 1e3)
    assert first["block_fwd_ms"] == pytest.approx(block.forward_s * 1e3)
    assert first["alpha_us"] == pytest.approx(LINK.alpha_s * 1e6)
