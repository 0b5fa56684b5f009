"""Port of upstream ``test/distributed/fsdp/test_fsdp_summon_full_params.py``: inside
``summon_full_params`` every parameter is full (clean names, the unwrapped shapes), ``writeback``
persists changes (or drops them), ``rank0_only`` / ``offload_to_cpu`` / ``recurse=False`` /
``with_grads``, nesting, and mixed precision (the full parameters are in full precision)."""

from __future__ import annotations

import torch
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

from tests.fsdp1_suite.common import FP32, FSDP, Block, api, batch, full_params, make_net, reference_step, wrap
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)


def _nested(impl, **kwargs):
    return wrap(impl, make_net(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, **kwargs)


def _shifted(impl, fsdp_model, writeback: bool):
    """Add 1 to every parameter inside the summon; returns the full parameters afterwards."""
    with FSDP(impl).summon_full_params(fsdp_model, writeback=writeback):
        with torch.no_grad():
            for p in fsdp_model.parameters():
                p.add_(1.0)
    return full_params(impl, fsdp_model)


@cases.case()
def writeback_true_and_false(rank, world_size, impl):
    """test_summon_full_param_writeback: changes persist with writeback=True only."""
    fsdp_model = _nested(impl)
    start = full_params(impl, fsdp_model)
    dropped = _shifted(impl, fsdp_model, writeback=False)
    kept = _shifted(impl, fsdp_model, writeback=True)
    for name, value in start.items():
        torch.testing.assert_close(dropped[name], value, rtol=0, atol=0)
        torch.testing.assert_close(kept[name], value + 1, rtol=0, atol=0)
    return kept


@cases.case()
def full_shapes_and_names(rank, world_size, impl):
    """test_summon_full_params_equivalence / named_parameters: the unwrapped model's names, shapes
    and values inside; the sharded parameters again after."""
    fsdp_model = _nested(impl, sharding_strategy=api(impl).ShardingStrategy.SHARD_GRAD_OP)
    expected = dict(make_net().named_parameters())
    sharded = [tuple(p.shape) for p in fsdp_model.parameters()]
    with FSDP(impl).summon_full_params(fsdp_model):
        inside = dict(fsdp_model.named_parameters())
        assert list(inside) == list(expected), list(inside)
        for name, value in inside.items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0)
    assert [tuple(p.shape) for p in fsdp_model.parameters()] == sharded
    return {}


@cases.case()
def rank0_only_and_offload(rank, world_size, impl):
    """test_summon_full_params_rank0_only / offload_to_cpu: only rank 0 holds full parameters (on
    the CPU); the others keep their shards."""
    fsdp_model = _nested(impl)
    sharded = [tuple(p.shape) for p in fsdp_model.parameters()]
    with FSDP(impl).summon_full_params(fsdp_model, writeback=False, rank0_only=True, offload_to_cpu=True):
        shapes = [tuple(p.shape) for p in fsdp_model.parameters()]
        devices = {p.device.type for p in fsdp_model.parameters()}
    assert devices == {"cpu"}
    if rank == 0:
        assert shapes == [tuple(p.shape) for p in make_net().parameters()], shapes
    else:
        assert shapes == sharded, shapes
    return {}


@cases.case()
def recurse_false(rank, world_size, impl):
    """test_summon_full_params_recurse: ``recurse=False`` summons the given wrapper only."""
    fsdp_model = _nested(impl)
    with FSDP(impl).summon_full_params(fsdp_model, recurse=False, writeback=False):
        root_shapes = [tuple(p.shape) for p in fsdp_model.module.inp.parameters()]
        # what this rank holds of the block: a DTensor's local chunk (FSDP1's flat parameter is local)
        block_numel = sum((p.to_local() if isinstance(p, DTensor) else p).numel()
                          for p in fsdp_model.module.blocks[0].parameters())
    assert root_shapes == [(16, 8), (16,)], root_shapes
    assert block_numel < sum(p.numel() for p in Block(16).parameters())  # still sharded
    return {}


@cases.case()
def with_grads(rank, world_size, impl):
    """test_summon_full_params_with_grads: the full gradients are the reference's."""
    model = make_net()
    ref = make_net()
    fsdp_model = wrap(impl, model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True)
    local, whole = batch(0, rank, world_size)
    fsdp_model(local).sum().backward()
    reference_step(ref, whole, world_size)
    grads = {}
    with FSDP(impl).summon_full_params(fsdp_model, with_grads=True):
        for name, param in fsdp_model.named_parameters():
            grads[name] = param.grad.clone()
    for name, param in ref.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, **FP32)
    return grads


@cases.case()
def mixed_precision_full_precision(rank, world_size, impl):
    """test_summon_full_params with mixed precision: the summoned parameters are the fp32 ones,
    written back in fp32 (not param_dtype)."""
    mp = api(impl).MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32, buffer_dtype=torch.float16)
    fsdp_model = _nested(impl, mixed_precision=mp)
    fsdp_model(batch(0, 0, 1)[0]).sum().backward()
    with FSDP(impl).summon_full_params(fsdp_model, writeback=True):
        dtypes = {p.dtype for p in fsdp_model.parameters()}
        with torch.no_grad():
            for p in fsdp_model.parameters():
                p.add_(1e-4)
    assert dtypes == {torch.float32}, dtypes
    return full_params(impl, fsdp_model)


test_case = cases.pytest_tests()
