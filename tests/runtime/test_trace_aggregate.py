"""flashfsdp.profile(aggregate=True): the same per-unit accounting as the plain profile, in
constant memory (only the step in progress keeps its spans; deterministic counts, no timing)."""

from __future__ import annotations

import json

import torch

import flashfsdp
from flashfsdp.kernels.dispatch import use_backend
from flashfsdp.runtime.trace_aggregate import AggregatingProfile
from tests.models import loss_fn, make_batch
from tests.training import make_model, units_of


def _profiled(steps: int, aggregate: bool):
    model = make_model("mlp")
    for unit in units_of("mlp", model):
        flashfsdp.fully_shard(unit)
    held = []
    with use_backend("reference"), flashfsdp.profile("cpu", aggregate=aggregate) as prof:
        for i in range(steps):
            x, y = make_batch("mlp", i, 4)
            loss_fn("mlp", model(x), y).backward()
            held.append(len(prof.spans))
    return prof, held


def _span_counts(prof) -> dict:
    counts: dict = {}
    for s in prof.spans:
        counts[(s.unit, s.kind)] = counts.get((s.unit, s.kind), 0) + 1
    return counts


def test_aggregated_counts_match_the_plain_profile_and_memory_stays_flat():
    plain, _ = _profiled(4, aggregate=False)
    folded, held = _profiled(4, aggregate=True)
    assert isinstance(folded, AggregatingProfile) and folded.steps_folded == 4
    summary = folded.summary()
    counts = {(u, kind): stat["count"] for u, v in summary["units"].items() for kind, stat in v["spans"].items()}
    assert counts == _span_counts(plain)
    # the step in progress only: the same number of spans every step once the forward order is
    # recorded (the first step gathers its forward unit by unit; later ones in buckets)
    assert held[2:] == held[1:2] * 2 and held[1] <= held[0]
    assert summary["steps"] == plain.summary()["steps"] == 4
    assert set(summary["units"]) == set(plain.summary()["units"])
    assert summary["compute_ms"] > 0 and summary["comm_ms"] >= summary["exposed_ms"] >= 0
    assert set(folded.unit_compute_ms()) == set(plain.unit_compute_ms())
    for v in summary["units"].values():
        for stat in v["spans"].values():
            assert stat["min_ms"] <= stat["mean_ms"] <= stat["max_ms"]


def test_the_chrome_trace_holds_the_last_step(tmp_path):
    folded, _ = _profiled(3, aggregate=True)
    folded.export_chrome_trace(str(tmp_path / "trace.json"))
    events = json.loads((tmp_path / "trace.json").read_text())["traceEvents"]
    steps = {e["args"]["step"] for e in events if e["ph"] == "X"}
    assert steps == {3}
