"""flashfsdp.sim on a (dp, tp) layout: TP collectives on the compute path delay it by their ring
time on the TP link while the FSDP collectives keep overlapping; the Llama builder's compute,
layout and TP collectives against flashfsdp.estimate; a model without TP is predicted as before;
bad input named."""

from __future__ import annotations

import dataclasses

import pytest

from flashfsdp import sim
from flashfsdp.estimate import estimate
from flashfsdp.models import LlamaConfig
from tests.sim.common import LINK, MB, NO_PREFETCH
from tests.sim.common import model as _model

TP_LINK = sim.Link("tp test", alpha_s=2e-6, bandwidth=4e9)
FREE = sim.Link("free", 0.0, 1e30)
CONFIG = LlamaConfig(dim=64, n_layers=3, n_heads=4, multiple_of=16, max_seq_len=16, vocab_size=96)


def _tp_model(at=0.25, **kwargs) -> sim.Model:
    """The test model at tp = 2: each block runs an all-gather at ``at`` of its forward and a
    reduce-scatter at the end of its backward, 4 MiB each."""
    base = _model(**kwargs)
    ops = (sim.TPOp("all_gather", 4 * MB, "forward", 0, at, "input"),
           sim.TPOp("reduce_scatter", 4 * MB, "backward", 0, 1.0, "input gradient"))
    blocks = tuple(dataclasses.replace(b, tp_ops=ops) for b in base.blocks)
    return dataclasses.replace(base, blocks=blocks, tp=2)


def test_tp_collectives_delay_the_compute_by_their_time():
    model = _tp_model()
    op_s = TP_LINK.all_gather_s(4 * MB, 2)
    pred = sim.simulate(model, 4, FREE, tp_link=TP_LINK, record_timeline=True)
    assert pred.tp == 2 and pred.world_size == 4 and "TP tp test" in pred.link
    assert pred.tp_comm_s == pytest.approx(2 * len(model.blocks) * op_s)
    assert pred.step_s == pytest.approx(model.compute_s() + pred.tp_comm_s)
    assert pred.exposed_s == pytest.approx(0.0, abs=1e-12)
    block = model.blocks[0]
    forward = [s for s in pred.timeline if s.unit == block.name and s.stream == "compute" and s.start < 0.1]
    assert [s.kind for s in forward] == ["forward", "tp_all_gather", "forward"]
    assert forward[0].end - forward[0].start == pytest.approx(0.25 * block.forward_s)  # at = 0.25
    assert forward[1].end - forward[1].start == pytest.approx(op_s)
    assert pred.collective_bytes["tp_all_gather"] == pred.collective_bytes["tp_reduce_scatter"] == 4 * 4 * MB


def test_fsdp_collectives_overlap_the_tp_collectives_and_the_compute():
    # blocks whose compute alone hides the all-gathers: with TP the blocks only last longer
    kwargs = dict(root_forward_before=0.9, root_backward_after=0.5)
    flat = sim.simulate(_model(**kwargs), 4, LINK)
    tp = sim.simulate(_tp_model(**kwargs), 8, LINK, tp_link=TP_LINK, record_timeline=True)  # dp = 4
    assert tp.exposed_s == pytest.approx(flat.exposed_s)
    assert tp.all_gather_s == pytest.approx(flat.all_gather_s)  # over the same 4 data-parallel ranks
    assert tp.step_s == pytest.approx(flat.step_s + tp.tp_comm_s)
    # blocks of no compute: the next block's all-gather runs during this one's TP collective
    free_compute = _tp_model(at=0.0, fwd=0.0, bwd=0.0, root_fwd=0.0, root_bwd=0.0)
    pred = sim.simulate(free_compute, 8, LINK, tp_link=TP_LINK, record_timeline=True)
    tp_spans = [s for s in pred.timeline if s.kind == "tp_all_gather"]
    gathers = [s for s in pred.timeline if s.kind == "all_gather"]
    assert any(g.start < t.end and t.start < g.end for g in gathers for t in tp_spans)
    no_prefetch = sim.simulate(free_compute, 8, LINK, tp_link=TP_LINK, policy=NO_PREFETCH)
    assert pred.exposed_s < no_prefetch.exposed_s


def test_a_model_without_tp_is_predicted_as_before():
    model = _model(root_forward_before=0.5)
    base = sim.simulate(model, 4, LINK, record_timeline=True)
    other = sim.simulate(model, 4, LINK, record_timeline=True, tp_link=TP_LINK)
    assert (base.step_s, base.exposed_s, base.peak_bytes, base.timeline) == (
        other.step_s, other.exposed_s, other.peak_bytes, other.timeline)
    assert base.tp_comm_s == 0 and base.tp == 1 and not any(k.startswith("tp_") and v for k, v in
                                                             base.collective_bytes.items())
    # the builder at tp = 1: llama_model's compute, the runtime's layout (here of the same size)
    one, llama = sim.llama_tp_model("8b", 64, 1), sim.llama3_8b()
    assert [(u.forward_s, u.backward_s) for u in one.units] == [(u.forward_s, u.backward_s) for u in llama.units]
    p1, p2 = sim.simulate(one, 64, "ib400"), sim.simulate(llama, 64, "ib400")
    assert p1.all_gather_s == p2.all_gather_s and p1.step_s == pytest.approx(p2.step_s, rel=1e-4)


def test_llama_tp_model_reuses_the_estimate_layout_and_tp_collectives():
    model = sim.llama_tp_model(CONFIG, 8, 2, tokens=32, param_dtype=None, reduce_dtype=None)
    one = sim.llama_tp_model(CONFIG, 8, 1, tokens=32, param_dtype=None, reduce_dtype=None)
    est = estimate(CONFIG, 8, tp=2, tokens=32)
    assert model.tp == 2 and model.info["dp"] == 4
    assert [u.forward_s * 2 for u in model.units] == pytest.approx([u.forward_s for u in one.units])
    assert [u.unsharded_bytes(4) for u in model.units] == [s.all_gather_bytes(None) for s in est.units]
    pred = sim.simulate(model, 8, "ib400", tp_link="nvlink")
    got = pred.collective_bytes
    assert got["all_gather"] == est.comm.all_gather_forward + est.comm.all_gather_backward
    assert (got["tp_all_gather"], got["tp_reduce_scatter"], got["tp_all_reduce"]) == (
        est.tp_comm.all_gather, est.tp_comm.reduce_scatter, est.tp_comm.all_reduce)
    assert sum(len(u.tp_ops) for u in model.units) == est.tp_comm.collectives
    assert pred.tp_comm_s == pytest.approx(sum(
        {"all_gather": sim.LINKS["nvlink"].all_gather_s, "reduce_scatter": sim.LINKS["nvlink"].reduce_scatter_s,
         "all_reduce": sim.LINKS["nvlink"].all_reduce_s}[op.kind](op.nbytes, 2) for u in model.units for op in u.tp_ops))
    # the attention's share places the collectives between attention and feed-forward
    between = [op.at for op in model.blocks[0].tp_ops if 0 < op.at < 1]
    share = sim.attention_fraction(CONFIG)
    assert between == pytest.approx([share, share, 1 - share, 1 - share])


def test_70b_on_8_nodes_of_8_gpus_tp_within_a_node():
    model = sim.llama_tp_model("70b", 64, 8, tokens=8192)
    pred = sim.simulate(model, 64, "ib400", tp_link="nvlink")
    flat = sim.llama3_70b(tokens_per_rank=8192)
    assert model.compute_s() == pytest.approx(flat.compute_s() / 8)
    assert pred.world_size == 64 and pred.tp_comm_s > 0 and pred.step_s > pred.compute_s + pred.tp_comm_s - 1e-9
    fsdp = sim.simulate(flat, 64, "ib400")
    # states: 1/64 of them either way (the norms, replicated over the TP ranks, add a little); the
    # unsharded TP-local pieces of a unit are 1/8 of the whole unit's
    assert pred.sharded_bytes == pytest.approx(fsdp.sharded_bytes, rel=1e-3)
    assert pred.peak_bytes - pred.sharded_bytes < (fsdp.peak_bytes - fsdp.sharded_bytes) / 7


@pytest.mark.parametrize("call, message", [
    (lambda: sim.llama_tp_model(CONFIG, 4, 3), "tp must be an integer >= 1 dividing world_size=4, got 3"),
    (lambda: sim.llama_tp_model(CONFIG, 4, 0), "tp must be an integer >= 1"),
    (lambda: sim.llama_tp_model(CONFIG, 8, 8), "tp"),
    (lambda: sim.simulate(_tp_model(), 3, LINK), "world_size 3 is not a multiple of the model's tp 2"),
    (lambda: sim.simulate(_tp_model(), 4, sim.Hierarchy(LINK, LINK, 2)), "link: a Hierarchy"),
    (lambda: sim.simulate(_tp_model(), 4, LINK, tp_link="nvlinc"), "unknown link 'nvlinc'"),
    (lambda: sim.TPOp("broadcast", 1, "forward"), "TPOp: kind"),
    (lambda: sim.TPOp("all_gather", 1, "sideways"), "TPOp: pass_"),
    (lambda: sim.TPOp("all_gather", 1, "forward", 2), "TPOp: part"),
    (lambda: sim.TPOp("all_gather", 1, "forward", 0, 1.5), "TPOp: at"),
    (lambda: sim.TPOp("all_gather", -1, "forward"), "TPOp: nbytes"),
    (lambda: sim.Unit("u", 8, 0, 0, tp_ops=("x",)), "tp_ops must hold"),
    (lambda: sim.Unit("u", 8, 0, 0, flat_numel=6).padded_numel(4), "flat_numel 6 was laid out for another"),
    (lambda: sim.Model(sim.Unit("r", 1, 0, 0), (), tp=0), "tp must be an integer >= 1"),
])
def test_bad_input_is_named(call, message):
    with pytest.raises(ValueError, match=message):
        call()
