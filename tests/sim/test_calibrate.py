"""flashfsdp.sim.calibrate: a traced step to the simulator's inputs and model, probes to a contention."""

from __future__ import annotations

import types

import pytest

from flashfsdp import sim
from flashfsdp.runtime.trace_spans import Span
from flashfsdp.sim import calibrate

# One CPU step in µs: the root's forward wraps two blocks, its backward theirs; host-side spans
# (waits, copy-in, pack, accumulate) inside the units; collectives on the communication stream.
STEP = [
    ("forward", "<root>", 0, 100), ("copy_in", "layers.0", 10, 15), ("forward", "layers.0", 20, 50),
    ("wait_all_gather", "layers.0", 20, 25), ("forward", "layers.1", 55, 90),
    ("backward", "<root>", 110, 300), ("backward", "layers.1", 130, 180), ("pack", "layers.1", 170, 175),
    ("accumulate", "layers.1", 175, 178), ("backward", "layers.0", 190, 260),
    ("all_gather", "layers.0", 12, 24), ("all_gather", "layers.1", 18, 30), ("reduce_scatter", "layers.1", 176, 200),
]


def _profile(steps) -> types.SimpleNamespace:
    spans = [Span(kind, unit, "comm" if kind in ("all_gather", "reduce_scatter") else "compute", step, start, end)
             for step, rows in enumerate(steps, 1) for kind, unit, start, end in rows]
    return types.SimpleNamespace(spans=spans, resolve=lambda: None)


def test_inputs_of_a_traced_step():
    no_backward = [row for row in STEP if row[0] != "backward"]  # an incomplete step is left out
    [inputs] = calibrate.inputs_from_profile(_profile([STEP, no_backward]), {"layers.0": 1000},
                                             accumulate_scale=0.5)
    units = inputs["units"]
    assert units["layers.0"] == {"forward_ms": pytest.approx(0.025), "backward_ms": pytest.approx(0.070)}
    # own span minus the host spans inside it, plus its pack and (scaled) accumulate
    assert units["layers.1"]["backward_ms"] == pytest.approx(0.042 + 0.005 + 0.5 * 0.003)
    assert units["<root>"] == {"forward_ms": pytest.approx(0.030), "backward_ms": pytest.approx(0.070)}
    assert inputs["root_forward_before"] == pytest.approx(0.015 / 0.030)
    assert inputs["root_backward_after"] == pytest.approx(0.040 / 0.070)
    assert inputs["loss_ms"] == pytest.approx(0.010)
    assert (inputs["copy_in_ms"], inputs["copy_in_bytes"]) == (pytest.approx(0.005), 1000)
    assert inputs["exposed_ms"] == pytest.approx(0.005)
    assert inputs["comm_busy_ms"] == pytest.approx((18 + 24) / 1e3)  # overlapping all-gathers count once
    assert calibrate.copy_bandwidth(inputs) == pytest.approx(1000 / 5e-6)
    assert calibrate.median_inputs([inputs, inputs]) == inputs


def test_model_from_inputs_orders_blocks_by_number():
    units = {name: {"forward_ms": 1.0, "backward_ms": 2.0} for name in ("layers.10", "<root>", "layers.2")}
    inputs = {"units": units, "root_forward_before": 0.5, "root_backward_after": 0.5, "loss_ms": 1.0}
    meta = {name: {"numel": 8, "param_bytes": 4, "reduce_bytes": 4} for name in units}
    model = calibrate.model_from_inputs(meta, inputs, optimizer_ms=2.0, name="m")
    assert [u.name for u in model.units] == ["<root>", "layers.2", "layers.10"]
    assert (model.loss_s, model.optimizer_s, model.name) == (pytest.approx(1e-3), pytest.approx(2e-3), "m")
    assert model.blocks[0].forward_s == pytest.approx(1e-3)


def test_contention_from_pooled_probes():
    ag = [(0.01, 0.02, 0.05, 0.04), (0.02, 0.04, 0.06, 0.05)]
    rs = [(0.01, 0.0125, 0.05, 0.045)]
    probes = [{"all_gather": ag[:1], "reduce_scatter": rs}, {"all_gather": ag[1:], "reduce_scatter": []}]
    fitted = calibrate.fit_probe_contention(probes, name="pooled")
    assert fitted == sim.fit_contention(ag, rs, name="pooled")
    assert calibrate.fit_probe_contention([{"all_gather": ag, "reduce_scatter": []}]) is None


def test_timeline_of_a_trace_is_in_seconds():
    spans = calibrate.timeline_of_profile(_profile([STEP]))
    assert spans[0] == sim.Span("compute", "forward", "<root>", 0.0, 100e-6)
    assert {s.stream for s in spans if s.kind == "all_gather"} == {"comm"}
