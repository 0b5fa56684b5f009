"""ShardedGradScaler at W = 2, each case against torch's ``fully_shard`` with torch's
``ShardedGradScaler`` (``tests.fsdp2_suite.runner``: same seeds, results compared).

Ports upstream ``test/distributed/_composable/fsdp/test_fully_shard_grad_scaler.py`` (the 1-D
mesh subtests) and extends it to float16 training with an overflow on one rank, gradient
accumulation, clipping after ``unscale_`` and CPU offload.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.amp.grad_scaler import OptState
from torch.testing._internal.common_fsdp import MLP

from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)


def _scaler(impl, **kwargs):
    if impl.name == "torch":
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler  # noqa: PLC0415
    else:
        from flashfsdp import ShardedGradScaler  # noqa: PLC0415
    return ShardedGradScaler("cpu", **kwargs)


def _changed(before: dict, after) -> bool:
    """Whether an optimizer's state differs from the copy ``before``."""
    if set(before) != set(after):
        return True
    return any(not torch.equal(a, b) for p in after for a, b in zip(after[p].values(), before[p].values()))


def _gradient_scaler(rank, impl, has_inf: bool) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(2)])
    for layer in model:
        impl.fully_shard(layer)
    impl.fully_shard(model)
    inp = torch.randn([4, 4])
    scaler = _scaler(impl, init_scale=2.0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    out = {}
    for it in range(2):  # the second: flashfsdp's reduction unscales (the scaler knows the units)
        scaler.scale(model(inp).sum()).backward()
        first = opt.param_groups[0]["params"][0]
        if has_inf and rank == 1:
            impl.local(first.grad).view(-1)[0] = float("inf")
        initial_grad = impl.local(first.grad).clone()
        with impl.count_collectives() as counts:
            scaler.unscale_(opt)
        state = scaler._per_optimizer_states[id(opt)]
        found = [float(f) for f in state["found_inf_per_device"].values()]
        # > 0 on every rank iff some rank has an inf (torch's sum counts rank 1's inf twice here:
        # DTensor's dispatch of the unscale op already reduces the flag before the all-reduce)
        assert len(found) == 1 and (found[0] > 0) == has_inf, (it, has_inf, found)
        assert state["stage"].value == OptState.UNSCALED.value and counts.all_reduce == 1
        if it == 0:  # upstream's check; later flashfsdp's gradients are unscaled during backward
            torch.testing.assert_close(impl.local(first.grad), initial_grad * 0.5)
        initial_state = copy.deepcopy(opt.state)
        scaler.step(opt)
        assert _changed(initial_state, opt.state) != has_inf  # skipped exactly when an inf was found
        scale = scaler.get_scale()
        scaler.update()
        assert scaler.get_scale() == (scale * scaler.get_backoff_factor() if has_inf else scale)
        out[f"grads{it}"] = impl.full_grads(model)
        opt.zero_grad()
    out["params"] = impl.full_params(model)
    return out


@cases.case(world_size=2)
def gradient_scaler(rank, world_size, impl):
    """Upstream: test_fully_shard_grad_scaler.py::TestFullyShardGradientScaler::test_gradient_scaler
    (has_inf True/False, the 1-D subtests; 2-D needs tensor parallelism, not supported): an inf
    put into rank 1's gradient is found on every rank with one all-reduce, the step is skipped
    and the scale backs off; without it the step runs and the scale stays. Two iterations, the
    unscaled gradients and parameters compared with torch's."""
    return {str(has_inf): _gradient_scaler(rank, impl, has_inf) for has_inf in (False, True)}


def _fp16_training(rank, world_size, impl, grad_accum: int, sync_every_micro_batch: bool, offload: bool,
                   steps: int = 6, overflow_step: int = 2) -> dict:
    torch.manual_seed(42)
    model = nn.Sequential(*[MLP(16, torch.device("cpu")) for _ in range(2)])
    policy = impl.MixedPrecisionPolicy(param_dtype=torch.float16)
    kwargs = {"mp_policy": policy}
    if offload:
        kwargs["offload_policy"] = impl.CPUOffloadPolicy(pin_memory=False)
    for mlp in model:
        impl.fully_shard(mlp, **kwargs)
    impl.fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = _scaler(impl, init_scale=2.0**8, growth_interval=2)
    torch.manual_seed(1 + rank)
    losses, scales, norms, all_reduces = [], [], [], []
    for step in range(steps):
        total = torch.zeros(())
        for micro in range(grad_accum):
            if not sync_every_micro_batch:
                model.set_requires_gradient_sync(micro == grad_accum - 1)
            loss = (model(torch.rand(4, 16)).float() - 1.0).pow(2).mean() / grad_accum
            total += loss.detach()
            blow_up = 1e9 if (step == overflow_step and rank == 1) else 1.0  # overflows float16 gradients
            scaler.scale(loss * blow_up).backward()
        with impl.count_collectives() as counts:
            scaler.unscale_(opt)
        all_reduces.append(counts.all_reduce)
        norm = impl.clip_grad_norm_(model, 1.0)
        norms.append(float(norm) if torch.isfinite(norm) else -1.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        dist.all_reduce(total)
        losses.append(float(total))
        scales.append(scaler.get_scale())
    assert scales[overflow_step] == scales[overflow_step - 1] / 2, scales
    return {"losses": torch.tensor(losses), "scales": scales, "norms": torch.tensor(norms),
            "all_reduces_in_unscale": all_reduces, "params": impl.full_params(model)}


@cases.case(world_size=2, rtol=2e-3, atol=2e-4)
def fp16_training_with_overflow(rank, world_size, impl):
    """float16 compute and reduction with dynamic loss scaling (growth every 2 steps); at step 2
    rank 1's gradients overflow: both ranks skip the step and the scale halves. Losses, scales,
    clipped norms (after unscale_: the true norm), one all-reduce per unscale_, and the parameters
    match torch's — with one micro-batch, with 2 accumulated without sync, with 2 each reduced
    (the reduction accumulating into an unscaled gradient)."""
    return {f"{accum}-{sync}": _fp16_training(rank, world_size, impl, accum, sync, offload=False)
            for accum, sync in ((1, True), (2, False), (2, True))}


@cases.case(world_size=2, rtol=2e-3, atol=2e-4)
def fp16_training_cpu_offload(rank, world_size, impl):
    """As fp16_training_with_overflow with ``CPUOffloadPolicy``: gradients unscaled and flagged on the host."""
    return _fp16_training(rank, world_size, impl, 1, True, offload=True)


@cases.case(world_size=2, torch_reason="counts flashfsdp's own passes over the gradients")
def fused_unscale_reads_no_gradient(rank, world_size, impl):
    """After the first step no gradient is unscaled by a pass of its own: the reduction did it."""
    calls = []
    original = torch._amp_foreach_non_finite_check_and_unscale_

    def counted(grads, *args):
        calls.append(len(grads))
        return original(grads, *args)

    torch._amp_foreach_non_finite_check_and_unscale_ = counted
    try:
        out = _fp16_training(rank, world_size, impl, 1, True, offload=False, steps=4)
    finally:
        torch._amp_foreach_non_finite_check_and_unscale_ = original
    assert len(calls) == 1, calls  # step 0 only
    return out


test_case = cases.pytest_tests()
