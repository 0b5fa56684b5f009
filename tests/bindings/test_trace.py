"""flashfsdp.profile(): spans per unit and step, exposed communication, Chrome trace export."""

from __future__ import annotations

import json

import pytest
import torch

import flashfsdp
from tests.harness import run_distributed
from tests.models import loss_fn, make_batch
from tests.training import local_rows, make_model, units_of


def _profiled(rank, world_size, path):
    model = make_model("llama")
    for unit in units_of("llama", model):
        flashfsdp.fully_shard(unit)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with flashfsdp.profile() as prof:
        for step in range(2):
            x, y = make_batch("llama", step, 2 * world_size)
            loss_fn("llama", model(local_rows(x, rank, world_size)), local_rows(y, rank, world_size)).backward()
            opt.step()
            opt.zero_grad()
    if rank == 0:
        prof.export_chrome_trace(path)
    kinds = {(s.kind, s.unit, s.stream) for s in prof.spans}
    return {"kinds": kinds, "summary": prof.summary(), "compute": prof.unit_compute_ms(), "steps": prof.step}


def test_profile_records_every_phase_per_unit(tmp_path):
    path = str(tmp_path / "trace.json")
    results = run_distributed(_profiled, 2, path)
    for r in results:
        assert r["steps"] == 2
        for unit in ("<root>", "layers.0", "layers.1"):
            for kind, stream in [("copy_in", "all_gather"), ("all_gather", "all_gather"), ("forward", "compute"),
                                 ("backward", "compute"), ("pack", "reduce_scatter"),
                                 ("reduce_scatter", "reduce_scatter"), ("accumulate", "reduce_scatter")]:
                assert (kind, unit, stream) in r["kinds"], (kind, unit)
        s = r["summary"]
        assert s["comm_ms"] > 0 and s["compute_ms"] > 0 and 0 <= s["exposed_ms"]
        assert set(s["units"]) == {"<root>", "layers.0", "layers.1"}
        # Own compute time: the root's forward excludes its blocks' forwards.
        assert all(v["forward"] >= 0 and v["backward"] >= 0 for v in r["compute"].values())
    trace = json.load(open(path))
    names = {e["name"] for e in trace["traceEvents"]}
    assert "all_gather::layers.1" in names and "reduce_scatter::layers.0" in names


def test_profiles_do_not_nest():
    with flashfsdp.profile():
        with pytest.raises(RuntimeError, match="profiles do not nest"):
            with flashfsdp.profile():
                pass
