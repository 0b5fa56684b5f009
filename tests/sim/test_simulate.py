"""flashfsdp.sim.simulate: the replayed schedule's times, coupled ranks, memory and bad arguments."""

from __future__ import annotations

import pytest

from flashfsdp import sim
from flashfsdp.runtime.schedule import PrefetchPolicy
from tests.sim.common import LINK, MB, NO_PREFETCH, W, ag_time, rs_time
from tests.sim.common import model as _model


# ------------------------------------------------------------------------------------- schedule


def test_zero_comm_cost_step_is_total_compute():
    model = _model(loss_s=0.003, optimizer_s=0.004, root_forward_before=0.5, root_backward_after=0.25)
    free = sim.Link("free", 0.0, 1e30)
    for kwargs in ({}, {"policy": NO_PREFETCH}, {"reshard_after_forward": False}, {"shared_comm_stream": True}):
        pred = sim.simulate(model, W, free, **kwargs)
        assert pred.step_s == pytest.approx(model.compute_s())
        assert pred.exposed_s == pytest.approx(0.0, abs=1e-12)
        assert pred.efficiency == pytest.approx(1.0)
    assert sim.simulate(model, 1, LINK).step_s == pytest.approx(model.compute_s())  # W = 1 moves nothing


def test_no_prefetch_shared_stream_exposes_all_communication():
    model = _model()
    pred = sim.simulate(model, W, LINK, policy=NO_PREFETCH, shared_comm_stream=True)
    assert pred.all_gathers == 1 + 2 * len(model.blocks)  # root once, blocks in forward and backward
    assert pred.exposed_s == pytest.approx(pred.comm_s)
    assert pred.step_s == pytest.approx(model.compute_s() + pred.comm_s)


def test_no_prefetch_exposes_every_all_gather_and_the_last_reduce_scatter():
    model = _model(root_backward_after=0.5)  # the root's last backward compute hides the last block's RS
    pred = sim.simulate(model, W, LINK, policy=NO_PREFETCH)
    block = model.blocks[0]
    assert rs_time(block) < block.backward_s
    expected = ag_time(model.root) + 2 * len(model.blocks) * ag_time(block) + rs_time(model.root)
    assert pred.exposed_s == pytest.approx(expected)


def test_prefetch_hides_communication_when_compute_exceeds_it():
    # root_forward_before: the embedding's compute hides the first block's all-gather
    model = _model(root_forward_before=0.9, root_backward_after=0.5)
    block = model.blocks[0]
    assert ag_time(block) < block.forward_s and rs_time(block) < block.backward_s
    pred = sim.simulate(model, W, LINK)
    # Exposed: the root's all-gather (nothing runs before it) and the root's reduce-scatter (nothing
    # after it); the root's pre-backward prefetches the last block (reverse post-forward order).
    assert pred.exposed_s == pytest.approx(ag_time(model.root) + rs_time(model.root))
    no = sim.simulate(model, W, LINK, policy=NO_PREFETCH)
    assert pred.step_s < no.step_s


def test_explicit_prefetch_list_goes_through_the_policy():
    model = _model(root_forward_before=0.9, root_backward_after=0.5)
    implicit = sim.simulate(model, W, LINK)
    # An empty explicit list for the last block overrides its implicit prefetch of the one before
    # (the last block itself keeps its parameters for backward: keep_for_backward).
    explicit = sim.simulate(model, W, LINK, backward_prefetch={model.blocks[-1].name: []})
    assert implicit.exposed_s == pytest.approx(ag_time(model.root) + rs_time(model.root))
    assert explicit.exposed_s == pytest.approx(ag_time(model.root) + ag_time(model.blocks[-2]) + rs_time(model.root))
    assert explicit.step_s == pytest.approx(implicit.step_s + ag_time(model.blocks[-2]))


def test_simulator_drives_the_runtime_policy():
    calls = []

    class Recording(PrefetchPolicy):
        """The default policy, noting every decision."""

        def forward_targets(self, key, order, explicit=None):
            out = super().forward_targets(key, order, explicit)
            calls.append(("forward", key, tuple(out)))
            return out

        def backward_targets(self, key, order, explicit=None):
            out = super().backward_targets(key, order, explicit)
            calls.append(("backward", key, tuple(out)))
            return out

        def admit(self, targets, inflight):
            calls.append(("admit", tuple(targets), inflight))
            return super().admit(targets, inflight)

    model = _model(n_blocks=3)
    sim.simulate(model, W, LINK, policy=Recording(), steps=2)
    starts = [i for i, c in enumerate(calls) if c[:2] == ("forward", "<root>")]  # each step's first decision
    assert len(starts) == 2
    first_step, last_step = calls[:starts[1]], calls[starts[1]:]
    assert ("forward", "<root>", ("layers.0",)) in last_step
    assert ("forward", "layers.1", ("layers.2",)) in last_step
    assert ("backward", "layers.2", ("layers.1",)) in last_step
    assert ("backward", "<root>", ("layers.2",)) in last_step  # reverse post-forward order
    assert ("admit", ("layers.1",), 0) in last_step
    # the first step has no recorded order yet: no forward prefetch
    assert ("forward", "<root>", ()) in first_step


def test_first_step_has_no_forward_prefetch():
    model = _model(root_forward_before=0.9)
    first = sim.simulate(model, W, LINK, steps=1)
    second = sim.simulate(model, W, LINK, steps=2)
    assert first.exposed_s > second.exposed_s


def test_host_blocking_waits_on_reductions():
    model = _model(bwd=0.001)  # reduce-scatters slower than backward compute
    assert rs_time(model.blocks[0]) > model.blocks[0].backward_s
    gpu = sim.simulate(model, W, LINK, record_timeline=True)
    cpu = sim.simulate(model, W, LINK, host_blocking=True, record_timeline=True)
    assert cpu.step_s >= gpu.step_s - 1e-12  # both bound by the reduce-scatter stream at the end
    # The post-backward of layers.i+1 finishes the reduction issued before it (layers.i+2's): a CPU
    # host blocks until it ended; a GPU's compute stream waits for that reduce-scatter to end too,
    # before its packed input may go (hold_until_passed, FSDP2's scheme with one input buffer); so
    # layers.i's backward starts only after layers.i+2's reduce-scatter ended, and the wait shows.
    for pred in (cpu, gpu):
        bwd = {s.unit: s for s in pred.timeline if s.kind == "backward"}
        rs = {s.unit: s for s in pred.timeline if s.kind == "reduce_scatter"}
        for i in range(len(model.blocks) - 2):
            assert bwd[f"layers.{i}"].start >= rs[f"layers.{i + 2}"].end - 1e-12, i
        assert any(s.kind == "wait_reduce_scatter" for s in pred.timeline)
    copy = sim.simulate(model, W, LINK, host_blocking=True, copy_bandwidth=1e9)
    # every block twice but the last one (kept for backward, see schedule.keep_for_backward)
    gathered = model.root.unsharded_bytes(W) + 2 * sum(b.unsharded_bytes(W) for b in model.blocks[:-1])
    gathered += model.blocks[-1].unsharded_bytes(W)
    assert copy.host_copy_s == pytest.approx(gathered / W / 1e9)  # this rank's shard, per all-gather
    assert copy.step_s > cpu.step_s


def test_shared_link_bandwidth_slows_concurrent_collectives():
    model = _model(fwd=0.001, bwd=0.002)
    separate = sim.simulate(model, W, LINK)
    shared = sim.simulate(model, W, LINK, share_link_bandwidth=True)
    fifo = sim.simulate(model, W, LINK, shared_comm_stream=True)
    assert separate.step_s < shared.step_s <= fifo.step_s + 1e-12


def test_timeline_accounts_for_the_step():
    model = _model(loss_s=0.001, optimizer_s=0.002)
    pred = sim.simulate(model, W, LINK, record_timeline=True)
    compute = [s for s in pred.timeline if s.stream == "compute" and not s.kind.startswith("wait_")]
    waits = [s for s in pred.timeline if s.kind.startswith("wait_")]
    assert sum(s.end - s.start for s in compute) == pytest.approx(model.compute_s())
    assert sum(s.end - s.start for s in waits) == pytest.approx(pred.exposed_s)
    comm = [s for s in pred.timeline if s.stream != "compute"]
    assert pred.comm_s - 1e-12 <= pred.comm_busy_s <= sum(s.end - s.start for s in comm) + 1e-12
    assert max(s.end for s in pred.timeline) == pytest.approx(pred.step_s)
    gathers = [s for s in pred.timeline if s.kind == "all_gather"]
    assert all(b.start >= a.end - 1e-12 for a, b in zip(gathers, gathers[1:]))  # one FIFO stream


def test_contention_of_one_all_gather_behind_compute():
    # root_forward_before=1: the root's whole forward runs before layers.0, whose all-gather the
    # root prefetches (second step): compute and the collective overlap from the same instant.
    model = _model(root_fwd=0.01, root_forward_before=1.0)
    g = ag_time(model.blocks[0])
    compute_rate, comm_rate = 0.5, 0.25
    assert g / comm_rate < model.root.forward_s  # the all-gather ends inside the root's forward
    contention = sim.Contention(compute_rate, comm_rate)
    pred = sim.simulate(model, W, LINK, contention=contention, record_timeline=True)
    root_fwd = next(s for s in pred.timeline if s.kind == "forward" and s.unit == "<root>")
    ag0 = next(s for s in pred.timeline if s.kind == "all_gather" and s.unit == "layers.0")
    assert ag0.end - ag0.start == pytest.approx(g / comm_rate)
    # g / comm_rate seconds at half speed, then the rest at full speed
    lost = (1 - compute_rate) * g / comm_rate
    assert root_fwd.end - root_fwd.start == pytest.approx(model.root.forward_s + lost)
    free = sim.simulate(model, W, LINK)
    assert pred.step_s > free.step_s
    assert pred.compute_s == free.compute_s  # pure compute, as given
    assert pred.comm_s == pytest.approx(free.comm_s)  # stand-alone costs
    assert pred.comm_busy_s > free.comm_busy_s


def test_contention_rates_of_one_are_no_contention():
    model = _model(fwd=0.002, bwd=0.003, loss_s=0.001, optimizer_s=0.002)
    none = sim.Contention(1.0, 1.0)
    for kwargs in ({}, {"policy": NO_PREFETCH}, {"reshard_after_forward": False},
                   {"shared_comm_stream": True, "host_blocking": True, "copy_bandwidth": 1e9},
                   {"share_link_bandwidth": True}):
        a = sim.simulate(model, W, LINK, **kwargs)
        b = sim.simulate(model, W, LINK, contention=none, **kwargs)
        assert b.step_s == pytest.approx(a.step_s) and b.exposed_s == pytest.approx(a.exposed_s)
        slow = sim.simulate(model, W, LINK, contention=sim.Contention(0.5, 0.5), **kwargs)
        assert slow.step_s > a.step_s


def test_reduce_scatter_contention_is_separate():
    model = _model(fwd=0.002, bwd=0.02)  # reduce-scatters hide behind backward compute
    ag_only = sim.Contention(1.0, 1.0, reduce_scatter_compute_rate=0.5, reduce_scatter_comm_rate=1.0)
    assert ag_only.rates("all_gather") == (1.0, 1.0) and ag_only.rates("reduce_scatter") == (0.5, 1.0)
    base = sim.simulate(model, W, LINK, record_timeline=True)
    pred = sim.simulate(model, W, LINK, contention=ag_only, record_timeline=True)
    # layers.i's reduce-scatter runs during layers.i-1's backward, which loses half of that time
    # (layers.0's runs with nothing to overlap: the root has no backward after the blocks)
    overlapped = [s for s in base.timeline if s.kind == "reduce_scatter" and s.unit not in ("<root>", "layers.0")]
    assert len(overlapped) == len(model.blocks) - 1
    assert pred.step_s == pytest.approx(base.step_s + 0.5 * sum(s.end - s.start for s in overlapped))


# ------------------------------------------------------------------------------------- ranks


RANK_SETTINGS = ({}, {"policy": NO_PREFETCH}, {"reshard_after_forward": False},
                 {"shared_comm_stream": True, "host_blocking": True, "copy_bandwidth": 1e9},
                 {"contention": sim.Contention(0.6, 0.5), "shared_comm_stream": True, "host_blocking": True})


@pytest.mark.parametrize("kwargs", RANK_SETTINGS)
def test_identical_ranks_predict_what_one_rank_does(kwargs):
    model = _model(fwd=0.002, bwd=0.004, loss_s=0.001, optimizer_s=0.002)
    one = sim.simulate(model, W, LINK, **kwargs)
    for pred in sim.simulate_ranks([model, model], W, LINK, **kwargs):
        assert pred.step_s == pytest.approx(one.step_s) and pred.exposed_s == pytest.approx(one.exposed_s)
    [single] = sim.simulate_ranks([model], W, LINK, **kwargs)
    assert single.step_s == pytest.approx(one.step_s)


@pytest.mark.parametrize("kwargs", RANK_SETTINGS)
def test_a_slow_rank_makes_the_fast_one_wait_inside_collectives(kwargs):
    fast = _model(fwd=0.002, bwd=0.004, loss_s=0.001, optimizer_s=0.002)
    slow = sim.Model(fast.root, tuple(sim.Unit(b.name, b.numel, 3 * b.forward_s, b.backward_s, reduce_bytes=4)
                                      for b in fast.blocks), loss_s=0.001, optimizer_s=0.002)
    alone = {m: sim.simulate(m, W, LINK, record_timeline=True, **kwargs) for m in (fast, slow)}
    a, b = sim.simulate_ranks([fast, slow], W, LINK, record_timeline=True, **kwargs)
    # The ranks leave the step together (the last reduce-scatter needs both), no earlier than the slow
    # rank alone; the fast rank now waits for the slow one's issues: more exposed time.
    assert a.step_s == pytest.approx(b.step_s)
    assert b.step_s >= alone[slow].step_s - 1e-12
    assert a.exposed_s > alone[fast].exposed_s
    # every collective runs at the same time on both ranks
    comm_a = [(s.kind, s.unit, s.start, s.end) for s in a.timeline if s.stream != "compute"]
    comm_b = [(s.kind, s.unit, s.start, s.end) for s in b.timeline if s.stream != "compute"]
    assert len(comm_a) == len(comm_b) > 0
    for x, y in zip(comm_a, comm_b):
        assert x[:2] == y[:2] and x[2] == pytest.approx(y[2]) and x[3] == pytest.approx(y[3])


def _rank(root_fb, blocks_fb, before, after, loss, optimizer) -> sim.Model:
    root = sim.Unit("<root>", 32896, *root_fb, param_bytes=4)
    blocks = tuple(sim.Unit(f"layers.{i}", 262400, f, b, param_bytes=4) for i, (f, b) in enumerate(blocks_fb))
    return sim.Model(root, blocks, root_forward_before=before, root_backward_after=after, loss_s=loss,
                     optimizer_s=optimizer)


def test_coupled_ranks_settle_under_extreme_contention():
    # Two ranks as measured once by the toy benchmark: an all-gather that barely moves while its rank
    # computes makes each rank's compute speed depend on when the other rank ends the collective, and
    # plain fixed-point iteration flipped between two timelines 2 µs apart for ever.
    ranks = [_rank((0.00144, 0.00168), [(0.0018, 0.00259), (0.0015, 0.00228)], 0.483, 0.291, 0.000602, 0.000726),
             _rank((0.0015, 0.00222), [(0.00188, 0.00276), (0.00167, 0.00349)], 0.469, 0.267, 0.000784, 0.000477)]
    link = sim.Link("gloo", 0.000609, 887e6, reduce_scatter_alpha_s=0.00077, reduce_scatter_bandwidth=325e6)
    contention = sim.Contention(0.581, 0.001, reduce_scatter_compute_rate=0.613, reduce_scatter_comm_rate=0.892)
    for kwargs in ({}, {"reshard_after_forward": False}):
        a, b = sim.simulate_ranks(ranks, 2, link, contention=contention, shared_comm_stream=True, host_blocking=True,
                                  copy_bandwidth=[1.99e9, 2.02e9], steps=3, **kwargs)
        assert a.step_s == pytest.approx(b.step_s, rel=1e-6)
        assert a.step_s >= max(r.compute_s() for r in ranks)


def test_bad_simulate_ranks_arguments():
    model = _model()
    other = _model(block_numel=2 * MB)
    with pytest.raises(ValueError, match="one Model per rank"):
        sim.simulate_ranks([], W, LINK)
    with pytest.raises(ValueError, match="5 models for world_size 4"):
        sim.simulate_ranks([model] * 5, W, LINK)
    with pytest.raises(ValueError, match=r"models\[1\] has other units"):
        sim.simulate_ranks([model, other], W, LINK)
    with pytest.raises(ValueError, match="copy_bandwidth has 3 values for 2 models"):
        sim.simulate_ranks([model, model], W, LINK, copy_bandwidth=[1e9, 1e9, 1e9])
    with pytest.raises(ValueError, match="copy_bandwidth must be > 0"):
        sim.simulate_ranks([model, model], W, LINK, copy_bandwidth=[1e9, -1.0])
    with pytest.raises(ValueError, match="world_size"):
        sim.simulate_ranks([model], 0, LINK)


# ------------------------------------------------------------------------------------- memory


def test_max_inflight_limits_peak_memory():
    model = _model(n_blocks=6)
    fwd, bwd = sim.prefetch_ahead(model, 3)
    peaks = {m: sim.simulate(model, W, LINK, policy=PrefetchPolicy(max_inflight=m), forward_prefetch=fwd,
                             backward_prefetch=bwd).peak_bytes for m in (0, 1, 2, 3)}
    assert peaks[0] < peaks[1] < peaks[2] < peaks[3]
    block = model.blocks[0].unsharded_bytes(W)
    assert peaks[3] - peaks[2] == block and peaks[2] - peaks[1] == block


def test_reshard_after_forward_false_keeps_parameters_and_skips_backward_all_gathers():
    model = _model()
    on = sim.simulate(model, W, LINK)
    off = sim.simulate(model, W, LINK, reshard_after_forward=False)
    assert on.all_gathers == 1 + 2 * len(model.blocks) - 1  # the last block is kept for backward
    assert off.all_gathers == 1 + len(model.blocks)
    assert off.peak_bytes > on.peak_bytes
    # every unit's parameters are alive at the end of forward
    assert off.peak_bytes >= off.sharded_bytes + sum(u.unsharded_bytes(W) for u in model.units)


def test_sharded_state_shrinks_with_world_size():
    model = _model()
    for world_size in (1, 2, 8):
        pred = sim.simulate(model, world_size, LINK)
        assert pred.sharded_bytes == sum(u.padded_numel(world_size) // world_size * 16 for u in model.units)
        assert pred.peak_bytes > pred.sharded_bytes


def test_slow_reduce_scatters_do_not_pile_up_memory():
    # GPU semantics: each post-backward makes the compute stream wait for the previous unit's pack,
    # so at most a couple of reductions queue up however many blocks there are.
    short, long = _model(n_blocks=4, bwd=0.001), _model(n_blocks=12, bwd=0.001)
    a, b = sim.simulate(short, W, LINK), sim.simulate(long, W, LINK)
    assert a.peak_bytes - a.sharded_bytes == b.peak_bytes - b.sharded_bytes
    assert b.exposed_s > a.exposed_s  # the backward is bound by the reduce-scatters


# ------------------------------------------------------------------------------------- bad input


def test_bad_simulate_arguments():
    model = _model()
    with pytest.raises(ValueError, match="backward_prefetch.*nope"):
        sim.simulate(model, W, LINK, backward_prefetch={"<root>": ["nope"]})
    with pytest.raises(ValueError, match="steps"):
        sim.simulate(model, W, LINK, steps=0)
    with pytest.raises(ValueError, match="copy_bandwidth"):
        sim.simulate(model, W, LINK, copy_bandwidth=-1.0)
    with pytest.raises(ValueError, match="loss_s"):
        sim.Model(model.root, model.blocks, loss_s=-1.0)
    with pytest.raises(ValueError, match="root_forward_before"):
        sim.Model(model.root, model.blocks, root_forward_before=1.5)
    with pytest.raises(ValueError, match="unique"):
        sim.Model(model.root, (model.blocks[0], model.blocks[0]))
    with pytest.raises(ValueError, match="tokens_per_rank"):
        sim.llama3_8b(tokens_per_rank=0)
    with pytest.raises(ValueError, match="flops_per_s"):
        sim.llama3_8b(flops_per_s=0)


def test_keeping_the_last_block_for_backward_saves_its_all_gather():
    """keep_for_backward: one all-gather fewer per step than a policy without it (max_inflight
    large enough), and never a longer step; max_inflight = 0 gathers the last block twice."""
    model = _model()
    kept = sim.simulate(model, W, LINK)
    lean = sim.simulate(model, W, LINK, policy=PrefetchPolicy(max_inflight=0))
    assert kept.all_gathers == 2 * len(model.blocks)
    assert lean.all_gathers == 1 + 2 * len(model.blocks)
    assert kept.step_s <= lean.step_s
