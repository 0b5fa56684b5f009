"""flashfsdp.sim with a Hierarchy: HSDP's shard link and replicate link, up to 4096 ranks."""

from __future__ import annotations

import pytest

from flashfsdp import sim
from tests.sim.common import LINK, MB, NO_PREFETCH
from tests.sim.common import model as _model

SLOW = sim.Link("slow inter-node", alpha_s=1e-4, bandwidth=1e8)


def _ar_time(unit: sim.Unit, link: sim.Link, shard_size: int, replicas: int) -> float:
    """The all-reduce of the unit's reduced shard (1/S of its padded gradients) across R replicas."""
    return link.all_reduce_s(unit.reduce_bytes_total(shard_size) // shard_size, replicas)


def test_ring_all_reduce_is_a_reduce_scatter_then_an_all_gather():
    assert sim.ring_all_reduce_s(8 * MB, 4, 1e-5, 1e9) == pytest.approx(2 * (3 / 4 * 8 * MB / 1e9 + 3 * 1e-5))
    assert LINK.all_reduce_s(MB, 1) == 0.0
    assert LINK.latency_s(4, "all_reduce") == pytest.approx(2 * 3 * LINK.alpha_s)


def test_hierarchy_shards_on_the_shard_link_and_all_reduces_each_shard_across_replicas():
    model = _model()
    hsdp = sim.Hierarchy(LINK, SLOW, shard_size=2)
    pred = sim.simulate(model, 8, hsdp, policy=NO_PREFETCH, shared_comm_stream=True, record_timeline=True)
    flat = sim.simulate(model, 2, LINK, policy=NO_PREFETCH, shared_comm_stream=True)
    # The all-gathers and reduce-scatters are those of FSDP over the shard group alone.
    assert (pred.world_size, pred.replicas) == (8, 4)
    assert pred.all_gather_s == pytest.approx(flat.all_gather_s)
    assert pred.reduce_scatter_s == pytest.approx(flat.reduce_scatter_s)
    assert pred.sharded_bytes == flat.sharded_bytes  # sharded over S = 2, not W = 8
    assert pred.all_reduce_s == pytest.approx(sum(_ar_time(u, SLOW, 2, 4) for u in model.units))
    # One shared FIFO, nothing prefetched: every collective is exposed, the all-reduces too.
    assert pred.step_s == pytest.approx(model.compute_s() + pred.comm_s)
    spans = [s for s in pred.timeline if s.kind in ("reduce_scatter", "all_reduce")]
    for rs, ar in zip(spans[::2], spans[1::2]):  # each all-reduce right behind its reduce-scatter
        assert (rs.kind, ar.kind, ar.unit) == ("reduce_scatter", "all_reduce", rs.unit)
        assert ar.start >= rs.end - 1e-12


@pytest.mark.parametrize("host_blocking", [False, True])
def test_every_all_reduce_finishes_within_the_step(host_blocking):
    model = _model()
    pred = sim.simulate(model, 8, sim.Hierarchy(LINK, SLOW, 2), host_blocking=host_blocking, record_timeline=True)
    all_reduces = [s for s in pred.timeline if s.kind == "all_reduce"]
    assert sorted(s.unit for s in all_reduces) == sorted(u.name for u in model.units)
    backward_end = max(s.end for s in pred.timeline if s.kind == "backward")
    assert all(s.end <= pred.step_s - model.optimizer_s + 1e-12 for s in all_reduces)
    assert max(s.end for s in all_reduces) >= backward_end  # the last one ends after the backward


def test_one_replica_is_plain_fsdp_over_the_shard_group():
    model = _model()
    one = sim.simulate(model, 4, sim.Hierarchy(LINK, SLOW, 4))
    flat = sim.simulate(model, 4, LINK)
    assert (one.step_s, one.exposed_s, one.all_reduce_s) == (pytest.approx(flat.step_s), pytest.approx(flat.exposed_s), 0.0)


def test_4096_gpus_hsdp_hides_the_latency_that_a_flat_ring_exposes():
    model = sim.llama3_8b()
    hsdp = sim.simulate(model, 4096, sim.Hierarchy("nvlink", "ib400", 8))
    flat = sim.simulate(model, 4096, "ib400")
    assert hsdp.replicas == 512 and hsdp.all_reduce_s > 0
    # A 4096-rank ring pays 4095 latencies per all-gather; a node's 8 NVLink ranks pay 7.
    assert hsdp.all_gather_s < flat.all_gather_s / 10
    assert hsdp.efficiency > flat.efficiency
    assert hsdp.sharded_bytes == pytest.approx(flat.sharded_bytes * 512, rel=1e-3)  # memory: sharded 8 ways


def test_bad_hierarchies_are_refused():
    with pytest.raises(ValueError, match="shard_size must be an integer >= 1"):
        sim.Hierarchy(LINK, SLOW, 0)
    with pytest.raises(ValueError, match="unknown link 'nvlinc'"):
        sim.Hierarchy("nvlinc", SLOW, 2)
    with pytest.raises(ValueError, match="not a multiple of the Hierarchy's shard_size 3"):
        sim.simulate(_model(), 8, sim.Hierarchy(LINK, SLOW, 3))
