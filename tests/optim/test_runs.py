"""Flat runs (``runtime/flat_runs.py``): a unit's sharded parameters' local tensors are views of one
master shard with gradients in one flat shard, each unit is one run (split where asked: at padding,
after chunks that are not whole vectors), the whole step of a group is one fused call over the
runs, and run states move into and out of flat buffers and slot vectors that span the segments of
the parameters an optimizer holds (no more), a run's new state becoming its buffer where it spans one."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import flashfsdp.optim as fo
from flashfsdp import fully_shard
from flashfsdp.runtime.flat_runs import FlatStates, plan_runs
from flashfsdp.runtime.sharding_spec import local_of
from tests.optim.common import sharded_mlp, train


def _units_with_grads(model):
    model(torch.randn(4, 7)).sum().backward()
    return [p for p in model.parameters() if p.grad is not None]


def test_each_unit_is_one_run_of_views_into_its_shards():
    model = sharded_mlp()
    params = _units_with_grads(model)
    runs, rest = plan_runs(params, age=lambda p: 0)
    assert rest == []
    assert len(runs) == 5  # 3 blocks, the shift bias, the root (inp + head)
    assert sorted(len(r.params) for r in runs) == [1, 4, 4, 4, 4]
    for run in runs:
        for p in run.params:
            local, grad = local_of(p), local_of(p.grad)
            assert local.untyped_storage().data_ptr() == run.flat.untyped_storage().data_ptr()
            assert grad.untyped_storage().data_ptr() == run.grad().untyped_storage().data_ptr()
            o = local.storage_offset() - run.lo
            assert torch.equal(run.flat[o : o + local.numel()], local.detach().reshape(-1))
            assert torch.equal(run.grad()[o : o + local.numel()], grad.reshape(-1))


def test_runs_break_at_missing_gradients_and_ages():
    model = sharded_mlp()
    params = _units_with_grads(model)
    up_weight, up_bias = model.blocks[0].up.weight, model.blocks[0].up.bias
    up_bias.grad = None
    runs, _ = plan_runs([p for p in params if p.grad is not None], age=lambda p: 0)
    assert len(runs) == 6  # block 0: [up.weight] and [down.weight, down.bias]
    assert any(len(r.params) == 1 and r.params[0] is up_weight for r in runs)
    runs, _ = plan_runs([p for p in params if p.grad is not None], age=lambda p: int(p is model.blocks[1].down.weight))
    assert len(runs) == 8  # block 1 splits around down.weight


def test_one_fused_call_per_group_and_state_as_flat_views(monkeypatch):
    model = sharded_mlp()
    optim = fo.AdamW(model.parameters(), lr=1e-2)
    calls = []
    real = torch._fused_adamw_
    monkeypatch.setattr(torch, "_fused_adamw_", lambda params, *a, **k: calls.append(len(params)) or real(params, *a, **k))
    train(model, optim, 2)
    assert calls == [5, 5]
    storages = {optim.state[p]["exp_avg"].untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 5
    for p in model.parameters():
        st = optim.state[p]
        assert st["exp_avg"].shape == p.shape and st["exp_avg_sq"].shape == p.shape
        assert st["step"].item() == 2.0


def _three_linears():
    """One unit at W = 1: chunks of 256, 16, 80, 5 (+3 padding), 15 (+1 padding) and 3 floats."""
    torch.manual_seed(0)
    model = fully_shard(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 5), nn.Linear(5, 3)))
    model(torch.randn(2, 16)).sum().backward()
    return list(model.parameters())


@pytest.mark.parametrize("kwargs, groups", [
    (dict(), [[0, 1, 2, 3, 4, 5]]),
    (dict(padding=False), [[0, 1, 2, 3], [4], [5]]),  # 5 and 15 floats end before the next 16-byte offset
    (dict(vector_bytes=256), [[0, 1], [2], [3], [4], [5]]),  # only the 256-float weight is 256-byte whole
    (dict(vector_bytes=64), [[0, 1, 2, 3], [4], [5]]),  # 1024, 64 and 320 bytes are 64-byte whole
])
def test_padding_and_vector_widths_split_runs(kwargs, groups):
    params = _three_linears()
    runs, rest = plan_runs(params, age=lambda p: 0, **kwargs)
    assert rest == []
    index = {id(p): i for i, p in enumerate(params)}
    assert [[index[id(p)] for p in run.params] for run in runs] == groups
    for run in runs:
        first, last = local_of(run.params[0]), local_of(run.params[-1])
        assert run.flat.numel() == last.storage_offset() + last.numel() - first.storage_offset()


def test_run_states_are_gathered_into_and_scattered_from_flat_buffers():
    params = _three_linears()
    (run,), _ = plan_runs(params, age=lambda p: 0)
    states = FlatStates()
    states.cover(params)
    per_param = [{"step": torch.tensor(3.0), "exp_avg": torch.full_like(p, float(i))} for i, p in enumerate(params)]
    state, slots = states.gather(run, per_param)
    assert [float(s) for s in slots[0]] == [3.0] * 6 and state["step"] is per_param[0]["step"]
    assert state["exp_avg"].shape == run.flat.shape
    for i, (p, s) in enumerate(zip(params, per_param)):  # each parameter's state now its view of the buffer
        assert states.is_view(p, "exp_avg", s["exp_avg"]) and torch.equal(s["exp_avg"], torch.full_like(p, float(i)))
        assert s["step"].data_ptr() == slots[0][i].data_ptr()
    kept, new_slots = states.scatter(run, "mu", torch.tensor(0.5), per_param)
    assert new_slots is not None and all(float(s["mu"]) == 0.5 for s in per_param) and kept is per_param[0]["mu"]
    made = torch.arange(run.flat.numel(), dtype=torch.float32)
    kept, _ = states.scatter(run, "buf", made, per_param)
    assert torch.equal(kept, made)
    for p, s in zip(params, per_param):
        o = local_of(p).storage_offset() - run.lo
        assert torch.equal(s["buf"].reshape(-1), made[o : o + p.numel()])


def test_bad_input_to_runs_and_states_is_refused():
    params = _three_linears()
    with pytest.raises(ValueError, match="vector_bytes must be None or a positive int, got 0"):
        plan_runs(params, age=lambda p: 0, vector_bytes=0)
    (run,), _ = plan_runs(params, age=lambda p: 0)
    with pytest.raises(ValueError, match=r"0.weight is not among the parameters covered \(cover\(\) first\)"):
        FlatStates().view(params[0], "exp_avg")
    states = FlatStates()
    states.cover(params)
    with pytest.raises(ValueError, match=r"state 'exp_avg' has 3 local elements, the parameter's chunk 256"):
        states.take(params[0], "exp_avg", torch.zeros(3))
    with pytest.raises(ValueError, match=r"state 'buf' has shape \(3,\), the run"):
        states.scatter(run, "buf", torch.zeros(3), [{} for _ in params])
    states.cover(params[:3] + params[4:])  # segments [0, 1, 2] and [4, 5]: the run of all six crosses them
    with pytest.raises(ValueError, match=r"the run \[0, 379\) reaches out of its segment \[0, 352\)"):
        states.run_view(run, "exp_avg")


def _ranges(states: FlatStates, params) -> list[tuple[int, int, int, int]]:
    return sorted({(s.lo, s.hi, s.first, s.stop) for s in map(states.segment_of, params)})


def test_segments_cover_the_optimizers_parameters_only():
    # chunks (offset, numel): 0.weight (0, 256), 0.bias (256, 16), 1.weight (272, 80), 1.bias (352, 5),
    # 2.weight (360, 15), 2.bias (376, 3)
    params = _three_linears()
    states = FlatStates()
    assert states.cover(params) and _ranges(states, params) == [(0, 379, 0, 6)]
    assert not states.cover(params)  # the same segments: nothing changes
    # one parameter, or two apart (index 2 missing): no buffer spans what they do not hold
    assert states.cover([params[1]])
    assert _ranges(states, [params[1]]) == [(256, 272, 1, 2)] and states.segment_of(params[0]) is None
    states.cover([params[1], params[3]])
    assert _ranges(states, [params[1], params[3]]) == [(256, 272, 1, 2), (352, 357, 3, 4)]
    view = states.view(params[3], "exp_avg")
    assert view.untyped_storage().nbytes() == 5 * 4 and view.shape == params[3].shape
    assert states.slot(params[3], "step", torch.float32, torch.device("cpu")).untyped_storage().nbytes() == 4
    # a segment gone takes its buffers along; the state that viewed one keeps its values
    states.cover(params)
    assert not states.is_view(params[3], "exp_avg", view)
    assert states.view(params[3], "exp_avg").untyped_storage().nbytes() == 379 * 4


def test_a_run_spanning_its_segment_gives_its_new_state_as_the_buffer():
    params = _three_linears()
    states = FlatStates()
    states.cover(params)
    (run,), _ = plan_runs(params, age=lambda p: 0)
    made = torch.arange(run.flat.numel(), dtype=torch.float32)
    per_param = [{} for _ in params]
    kept, _ = states.scatter(run, "exp_avg", made, per_param)
    assert kept is made  # no copy: the state torch made is the buffer
    assert all(states.is_view(p, "exp_avg", s["exp_avg"]) for p, s in zip(params, per_param))
    # a buffer that exists already is copied into
    again = torch.ones(run.flat.numel())
    kept, _ = states.scatter(run, "exp_avg", again, per_param)
    assert kept is not again and kept.data_ptr() == made.data_ptr() and torch.equal(made, again)
    # a run that does not span its segment (the first parameter left out) is copied
    (short,), _ = plan_runs(params[1:], age=lambda p: 0)
    value = torch.full((short.flat.numel(),), 2.0)
    kept, _ = states.scatter(short, "exp_avg_sq", value, per_param[1:])
    assert kept.data_ptr() != value.data_ptr() and torch.equal(kept, value)
    assert float(states.view(params[0], "exp_avg_sq").abs().max()) == 0.0
