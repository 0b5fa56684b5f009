"""flashfsdp.ShardedGradScaler in one process: torch's API and its upstream cases, the unscale fused
into the reduction (no extra pass over the gradients), bad input, the float16 warning, state dicts.

The multi-rank cases, against torch's ``fully_shard`` with torch's ``ShardedGradScaler``, are in
``test_grad_scaler_parity.py``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler

import flashfsdp
from flashfsdp import MixedPrecisionPolicy, ShardedGradScaler
from flashfsdp.kernels.dispatch import use_backend
from flashfsdp.runtime import loss_scale, reduce
from tests.models import make_batch, make_mlp

FP16 = MixedPrecisionPolicy(param_dtype=torch.float16)


def test_is_a_torch_grad_scaler():
    scaler = ShardedGradScaler("cpu")
    assert isinstance(scaler, torch.amp.GradScaler) and isinstance(scaler, TorchShardedGradScaler)
    assert flashfsdp.ShardedGradScaler is ShardedGradScaler and "ShardedGradScaler" in flashfsdp.__all__


def test_grad_scaling():
    """Upstream: test_fsdp_sharded_grad_scaler.py::TestShardGradScaler::test_grad_scaling."""
    scaler = ShardedGradScaler("cpu", init_scale=2.0)
    t0, t1 = torch.full((1,), 4.0), torch.full((1,), 8.0)
    outputs = scaler.scale([t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), t1.clone()]])
    assert outputs[0] == 16.0 and outputs[1][0] == 8.0 and outputs[1][1] == 16.0
    assert outputs[2][0] == 8.0 and outputs[2][1] == 16.0
    assert scaler._scale.device == t1.device
    half = scaler.scale(torch.ones(2, dtype=torch.float16))
    assert half.dtype == torch.float16 and half.tolist() == [2.0, 2.0]


def test_scaling_unscaling_sparse():
    """Upstream: test_fsdp_sharded_grad_scaler.py::TestShardGradScaler::test_scaling_unscaling_sparse."""
    scaler = ShardedGradScaler("cpu", init_scale=2.0)
    inv_scale, found_inf = torch.full((1,), 0.5), torch.zeros(1)
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    s = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, 64.0]), (2, 3))
    s1 = s.clone()
    s1.grad = s.clone()
    opt = torch.optim.SGD([s1], lr=1.0)
    assert scaler._unscale_grads_(opt, inv_scale, found_inf)[s1.device] == 0.0
    assert torch.equal(s1.grad.to_dense(), (s / 2).to_dense())
    s1.grad = torch.sparse_coo_tensor(i, torch.tensor([16.0, 32.0, float("inf")]), (2, 3))
    found_inf.zero_()
    assert scaler._unscale_grads_(opt, inv_scale, found_inf)[s1.device] == 1.0
    # coalescing duplicate fp16 indices overflows: marked as inf
    i = torch.tensor([[1, 1, 1], [0, 0, 2]])
    s1 = torch.sparse_coo_tensor(i, torch.tensor([2.0**15, 2.0**15, 1.0], dtype=torch.float16), (2, 3))
    s1.grad = s1.clone()
    found_inf.zero_()
    assert scaler._unscale_grads_(opt, inv_scale, found_inf)[s1.device] == 1.0


def test_inf_gradients_skip_optim_step():
    """Upstream: test_fsdp_sharded_grad_scaler.py::TestShardGradScaler::test_inf_gradients_skip_optim_step."""
    scaler = ShardedGradScaler("cpu", init_scale=2.0)
    t0 = torch.tensor([float("inf")])
    t0.grad = t0.clone()
    opt = torch.optim.SGD([t0], lr=1.0)
    scaler.scale(torch.full((1,), 4.0))
    assert scaler.step(opt) is None and scaler.steps_skipped == 1
    scaler.update()
    assert scaler.get_scale() == 1.0


def _train_plain(scaler, steps: int = 6, overflow_at: tuple[int, ...] = (2,), optimizer=torch.optim.AdamW):
    """An unsharded MLP with ``scaler``; the loss is blown up to inf at the steps ``overflow_at``."""
    model = make_mlp()
    opt = optimizer(model.parameters(), lr=1e-2)
    scales, norms = [], []
    for step in range(steps):
        x, y = make_batch("mlp", step, 4)
        loss = torch.nn.functional.mse_loss(model(x), y) * (float("inf") if step in overflow_at else 1.0)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        scales.append(scaler.get_scale())
    return [p.detach().clone() for p in model.parameters()], scales, norms, scaler.state_dict()


@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.Adam], ids=["adamw", "adam-fused"])
def test_plain_model_matches_torch_grad_scaler(optimizer):
    """On a model flashfsdp does not shard, without a process group, it is torch's GradScaler: same
    parameters, scales (growth every 2 steps, backoff on the overflow), norms and state dict. The
    fused optimizer (``_step_supports_amp_scaling``) takes the unscaled gradients too."""
    opt = optimizer if optimizer is torch.optim.AdamW else (lambda p, lr: torch.optim.Adam(p, lr=lr, fused=True))
    ours = _train_plain(ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=2), optimizer=opt)
    want = _train_plain(torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2), optimizer=opt)
    torch.testing.assert_close(ours[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(ours[2], want[2], rtol=0, atol=0, equal_nan=True)  # the overflow's norm: nan
    assert ours[1] == want[1] and ours[3] == want[3]
    assert ours[1] == [2**10, 2**11, 2**10, 2**10, 2**11, 2**11]


def test_state_dict_round_trip_through_checkpoint(tmp_path):
    """The state dict holds numbers only: ``flashfsdp.checkpoint.save(extra=...)`` stores it, and a new
    scaler loaded from it continues with the same scale and growth tracker."""
    scaler = ShardedGradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    _train_plain(scaler, steps=5, overflow_at=(1,))
    model = nn.Linear(2, 2)
    flashfsdp.checkpoint.save(str(tmp_path / "ckpt"), model, step=5, extra={"grad_scaler": scaler.state_dict()})
    restored = ShardedGradScaler("cpu")
    restored.load_state_dict(flashfsdp.checkpoint.load(str(tmp_path / "ckpt"), model)["extra"]["grad_scaler"])
    assert restored.state_dict() == scaler.state_dict() == {
        "scale": 2.0**10, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 3, "_growth_tracker": 0}
    restored.scale(torch.ones(()))
    assert restored.get_scale() == 2.0**10 and restored._get_growth_tracker() == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"init_scale": 0.0}, "init_scale must be a positive finite number"),
    ({"init_scale": float("inf")}, "init_scale must be a positive finite number"),
    ({"growth_factor": 1.0}, "growth_factor must be > 1"),
    ({"backoff_factor": 1.0}, "backoff_factor must be in (0, 1)"),
    ({"backoff_factor": 0.0}, "backoff_factor must be in (0, 1)"),
    ({"growth_interval": 0}, "growth_interval must be a positive int"),
    ({"growth_interval": 2.5}, "growth_interval must be a positive int"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=rf"ShardedGradScaler: {message.replace('(', '.').replace(')', '.')}"):
        ShardedGradScaler("cpu", **kwargs)


def test_unscale_twice_and_after_step_are_refused():
    scaler = ShardedGradScaler("cpu")
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.1)
    scaler.scale(w.sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="unscale_\\(\\) has already been called"):
        scaler.unscale_(opt)
    scaler.step(opt)
    with pytest.raises(RuntimeError, match="after step"):
        scaler.unscale_(opt)
    scaler.update()
    with pytest.raises(AssertionError, match="No inf checks were recorded"):
        scaler.update()


def test_disabled_scaler_only_steps():
    scaler = ShardedGradScaler("cpu", enabled=False)
    w = nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=1.0)
    loss = w.sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.step(opt)
    scaler.update()
    assert w.tolist() == [0.0, 0.0] and scaler.get_scale() == 1.0


def _sharded_fp16_mlp() -> nn.Module:
    model = make_mlp()
    for unit in model.units():
        flashfsdp.fully_shard(unit, mp_policy=FP16)
    return model


def test_float16_without_scaler_warns_once(monkeypatch):
    monkeypatch.setattr(loss_scale, "_armed_once", False)
    monkeypatch.setattr(loss_scale, "_warned", False)
    model = _sharded_fp16_mlp()
    x, y = make_batch("mlp", 0, 4)
    with pytest.warns(UserWarning, match="float16 but no loss scaler.*flashfsdp.ShardedGradScaler"):
        torch.nn.functional.mse_loss(model(x).float(), y).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.nn.functional.mse_loss(model(x).float(), y).backward()  # once only


def test_float16_with_scaler_does_not_warn(monkeypatch):
    monkeypatch.setattr(loss_scale, "_armed_once", False)
    monkeypatch.setattr(loss_scale, "_warned", False)
    model, scaler = _sharded_fp16_mlp(), ShardedGradScaler("cpu")
    x, y = make_batch("mlp", 0, 4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaler.scale(torch.nn.functional.mse_loss(model(x).float(), y)).backward()


def _count_calls(monkeypatch, owner, name: str) -> list:
    calls = []
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_unscale_is_fused_into_the_reduction(monkeypatch, backend):
    """From the second step on (the scaler knows the units after its first unscale_), no gradient
    is read to unscale: no explicit unscale pass, one accumulation per flat group and step as
    without a scaler (accumulate_grad_shard, or one pair of a bucket's accumulate_grad_shards),
    and the result equals torch's GradScaler's explicit pass."""
    explicit = _count_calls(monkeypatch, torch, "_amp_foreach_non_finite_check_and_unscale_")
    single = _count_calls(monkeypatch, reduce, "accumulate_grad_shard")
    multi = _count_calls(monkeypatch, reduce, "accumulate_grad_shards")

    class _Launches:  # accumulations so far: the single op's calls and the pairs of the multi op's
        def __len__(self):
            return len(single) + sum(len(args[0]) for args in multi)

    launches = _Launches()
    model, ref = _sharded_fp16_mlp(), _sharded_fp16_mlp()
    n_groups = sum(len(m._flashfsdp_state.unit.groups) for m in model.modules() if hasattr(m, "_flashfsdp_state"))
    scaler, ref_scaler = ShardedGradScaler("cpu", init_scale=2.0**12), torch.amp.GradScaler("cpu", init_scale=2.0**12)
    opt, ref_opt = (torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref))
    per_step = []
    with use_backend(backend):
        for step in range(3):
            x, y = make_batch("mlp", step, 4)
            before = (len(explicit), len(launches))
            scaler.scale(torch.nn.functional.mse_loss(model(x).float(), y)).backward()
            scaler.unscale_(opt)
            per_step.append((len(explicit) - before[0], len(launches) - before[1]))
            norm = flashfsdp.clip_grad_norm_(model, 1e9)
            ref_scaler.scale(torch.nn.functional.mse_loss(ref(x).float(), y)).backward()
            ref_scaler.unscale_(ref_opt)
            ref_norm = torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in ref.parameters()]))
            torch.testing.assert_close([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])
            torch.testing.assert_close(norm, ref_norm)
            for s, o in ((scaler, opt), (ref_scaler, ref_opt)):
                s.step(o)
                s.update()
                o.zero_grad()
    assert per_step[0][0] >= 1  # the first step: the scaler did not know the units yet
    assert per_step[1:] == [(0, n_groups), (0, n_groups)], per_step
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()))


def test_grad_replaced_by_hand_is_unscaled_explicitly(monkeypatch):
    """A ``.grad`` that is no longer the reduction's view, and a gradient changed in place after
    backward, are unscaled (and checked) by an explicit pass; the fused flag is not trusted."""
    model, scaler = _sharded_fp16_mlp(), ShardedGradScaler("cpu", init_scale=2.0**8)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    x, y = make_batch("mlp", 0, 4)
    for step in range(2):
        scaler.scale(torch.nn.functional.mse_loss(model(x).float(), y)).backward()
        if step == 1:
            first = next(iter(model.parameters()))
            expected = first.grad.clone()
            first.grad = first.grad * 2.0**8  # a new, scaled tensor: must be divided again
            model.head.bias.grad[0] = float("inf")  # in place, after the reduction's flag
        scaler.step(opt)
        scaler.update()
        if step == 0:
            opt.zero_grad()
    torch.testing.assert_close(first.grad, expected)
    assert scaler.steps_skipped == 1 and scaler.get_scale() == 2.0**7


def test_flag_communicator_chosen_without_local_gradients():
    """A rank without any gradient picks the same communicator for the flag as the ranks with
    gradients (the units' one), else the collectives would not match."""
    from flashfsdp.bindings.unscale import plan_unscale  # noqa: PLC0415

    model = _sharded_fp16_mlp()
    params = list(model.parameters())
    assert all(p.grad is None for p in params)
    plan = plan_unscale(params, 2.0**16)
    assert plan.comms and not plan.flags and not plan.explicit and not plan.groups
    x, y = make_batch("mlp", 0, 4)
    torch.nn.functional.mse_loss(model(x).float(), y).backward()
    assert plan_unscale(params, 2.0**16).comms.keys() == plan.comms.keys()
