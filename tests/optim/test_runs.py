"""Flat runs: a unit's sharded parameters' local tensors are views of one master shard with
gradients in one flat shard, each unit is one run, and the whole step of a group is one fused call
over the runs."""

from __future__ import annotations

import torch

import flashfsdp.optim as fo
from flashfsdp.optim.runs import plan_runs
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
