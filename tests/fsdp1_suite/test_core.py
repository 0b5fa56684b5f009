"""Port of upstream ``test/distributed/fsdp/test_fsdp_core.py``, ``test_fsdp_comm.py`` and
``test_fsdp_misc.py`` (the cases that run on CPU gloo at W = 2).

Each case trains the wrapped model against the replicated reference (the model before wrapping,
gradients averaged over ranks) at fp32 1e-5, and the runner compares what it returns (losses,
gradient norms, final full parameters) between torch's ``FullyShardedDataParallel`` and flashfsdp's.
Upstream's ``test_fsdp_core.TestParityWithDDP`` runs every sharding strategy with and without
nesting, CPU offload, backward/forward prefetch; ``test_fsdp_comm`` the prefetch and no-sync
variants; ``test_fsdp_misc`` ``device_id``, ``sync_module_states``, ``param_init_fn`` on meta,
``fsdp_modules`` / ``.module`` / ``check_is_root``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from tests.fsdp1_suite.common import (
    FP32, FSDP, Block, Net, api, batch, full_params, make_net, reference_step, replicate, train_against_reference, wrap,
)
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)
SYNC_REASON = "torch's FSDP1 refuses sync_module_states for modules on the CPU (it broadcasts on GPUs)"


def _parity(rank, world_size, impl, **kwargs):
    model = make_net()
    ref = replicate(model)
    fsdp_model = wrap(impl, model, **kwargs)
    losses, _, params = train_against_reference(rank, world_size, impl, model, fsdp_model, ref)
    return {"losses": losses, "params": params}


def _policy(impl):
    """Each Block a unit (flashfsdp: FSDP1's set-of-classes shorthand for the same policy)."""
    return ModuleWrapPolicy({Block}) if impl.name == "torch" else {Block}


def _strategy_case(strategy: str):
    """``<strategy>_nested``: each Block a unit, under ShardingStrategy.<strategy>."""

    def case(rank, world_size, impl):
        return _parity(rank, world_size, impl, sharding_strategy=getattr(api(impl).ShardingStrategy, strategy),
                       auto_wrap_policy=_policy(impl))

    case.__name__ = case.__qualname__ = f"{strategy.lower()}_nested"
    return cases.case()(case)


for _strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
    _strategy_case(_strategy)


@cases.case()
def full_shard_one_unit(rank, world_size, impl):
    return _parity(rank, world_size, impl)


@cases.case()
def prefetch_variants(rank, world_size, impl):
    """test_fsdp_comm: forward_prefetch, BACKWARD_POST / None, limit_all_gathers=False."""
    out = []
    for forward, backward, limit in ((True, api(impl).BackwardPrefetch.BACKWARD_POST, False), (False, None, True)):
        out.append(_parity(rank, world_size, impl, auto_wrap_policy=_policy(impl), forward_prefetch=forward,
                           backward_prefetch=backward, limit_all_gathers=limit, use_orig_params=True))
    return out


@cases.case(torch_reason="torch's FSDP1 CPU offload needs an accelerator (its flat parameters' lazy init)")
def cpu_offload(rank, world_size, impl):
    return _parity(rank, world_size, impl, cpu_offload=api(impl).CPUOffload(offload_params=True),
                   auto_wrap_policy=_policy(impl))


@cases.case()
def no_sync_accumulation(rank, world_size, impl):
    """test_fsdp_core/test_fsdp_misc: two micro-batches under ``no_sync`` and one with sync equal
    the reference's three accumulated backwards; no reduce-scatter happens inside."""
    model = make_net()
    ref = replicate(model)
    fsdp_model = wrap(impl, model, auto_wrap_policy=_policy(impl), use_orig_params=True)
    for micro in range(3):
        local, whole = batch(micro, rank, world_size)
        if micro < 2:
            with impl.count_collectives() as counts, fsdp_model.no_sync():
                fsdp_model(local).sum().backward()
            assert counts.reduce_scatter == 0, f"{counts.reduce_scatter} reduce-scatters inside no_sync"
        else:
            fsdp_model(local).sum().backward()
        reference_step(ref, whole, world_size)
    grads = {}
    with FSDP(impl).summon_full_params(fsdp_model, writeback=False, with_grads=True):
        for name, param in fsdp_model.named_parameters():
            grads[name] = param.grad.detach().clone()
    for name, param in ref.named_parameters():
        torch.testing.assert_close(grads[name], param.grad, **FP32, msg=lambda m, n=name: f"{n}.grad: {m}")
    return grads


@cases.case()
def clip_grad_norm(rank, world_size, impl):
    """test_fsdp_clip_grad_norm: the root's ``clip_grad_norm_`` is the global norm and clips like
    the reference's (a norm of 0.5 clips every step here)."""
    model = make_net()
    ref = replicate(model)
    fsdp_model = wrap(impl, model, auto_wrap_policy=_policy(impl), use_orig_params=True)
    losses, norms, params = train_against_reference(rank, world_size, impl, model, fsdp_model, ref, clip=0.5)
    assert all(n > 0.5 for n in norms), norms
    return {"norms": norms, "params": params}


@cases.case(torch_reason=SYNC_REASON)
def sync_module_states(rank, world_size, impl):
    """test_fsdp_misc test_fsdp_sync_module_states: rank-dependent weights become rank 0's."""
    model = make_net(seed=rank)
    fsdp_model = wrap(impl, model, auto_wrap_policy=_policy(impl), sync_module_states=True)
    params = full_params(impl, fsdp_model)
    expected = dict(make_net(seed=0).named_parameters())
    for name, value in params.items():
        torch.testing.assert_close(value, expected[name].detach(), rtol=0, atol=0)
    return params


def _meta_net_on_rank0(rank):
    if rank == 0:
        return make_net()
    with torch.device("meta"):
        return Net()


@cases.case(torch_reason=SYNC_REASON)
def meta_param_init_fn_sync(rank, world_size, impl):
    """test_fsdp_misc: rank 0 holds the real model, the others build it on meta; ``param_init_fn``
    materialises, ``sync_module_states`` broadcasts rank 0's values."""
    model = _meta_net_on_rank0(rank)
    fsdp_model = wrap(impl, model, auto_wrap_policy=_policy(impl), sync_module_states=True,
                      param_init_fn=lambda m: m.to_empty(device=torch.device("cpu"), recurse=False))
    params = full_params(impl, fsdp_model)
    for name, value in dict(make_net().named_parameters()).items():
        torch.testing.assert_close(params[name], value.detach(), rtol=0, atol=0)
    return params


@cases.case()
def meta_reset_parameters(rank, world_size, impl):
    """test_fsdp_meta: a meta module without ``param_init_fn`` is materialised with
    ``reset_parameters()``, unit by unit (the values are compared with torch's)."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Net()
    fsdp_model = wrap(impl, model, auto_wrap_policy=_policy(impl))
    params = full_params(impl, fsdp_model)
    assert all(not p.is_meta for p in params.values())
    return params


@cases.case()
def apply_sees_full_params(rank, world_size, impl):
    """test_fsdp_apply: ``apply(fn)`` runs on the full parameters and its changes persist."""
    fsdp_model = wrap(impl, make_net(), auto_wrap_policy=_policy(impl))
    shapes = []

    def init(m):
        if isinstance(m, nn.Linear):
            shapes.append(tuple(m.weight.shape))
            with torch.no_grad():
                m.weight.fill_(0.25)

    fsdp_model.apply(init)
    assert sorted(shapes) == sorted([(16, 8), (16, 16), (16, 16), (16, 16), (16, 16), (4, 16)]), shapes
    params = full_params(impl, fsdp_model)
    assert all(bool((v == 0.25).all()) for n, v in params.items() if n.endswith("weight") and "norm" not in n)
    return params


@cases.case()
def module_tree_and_names(rank, world_size, impl):
    """test_fsdp_misc: ``.module``, ``fsdp_modules`` (root_only), ``check_is_root``, and FSDP1's
    names with ``use_orig_params=True``."""
    model = make_net()
    fsdp_model = wrap(impl, model, auto_wrap_policy=_policy(impl), use_orig_params=True)
    cls = FSDP(impl)
    assert fsdp_model.module is model
    assert len(cls.fsdp_modules(fsdp_model)) == 3 and cls.fsdp_modules(fsdp_model, root_only=True) == [fsdp_model]
    local, _ = batch(0, rank, world_size)
    fsdp_model(local).sum().backward()
    assert fsdp_model.check_is_root() and not cls.fsdp_modules(fsdp_model)[1].check_is_root()
    block = ["lin1.weight", "lin1.bias", "norm.weight", "norm.bias", "lin2.weight", "lin2.bias"]
    expected = (["_fsdp_wrapped_module.inp.weight", "_fsdp_wrapped_module.inp.bias"]
                + [f"_fsdp_wrapped_module.blocks.{i}._fsdp_wrapped_module.{n}" for i in range(2) for n in block]
                + ["_fsdp_wrapped_module.head.weight"])
    assert [n for n, _ in fsdp_model.named_parameters()] == expected, list(fsdp_model.named_parameters())
    with cls.summon_full_params(fsdp_model):
        clean = [n for n, _ in fsdp_model.named_parameters()]
    assert clean == [n for n, _ in make_net().named_parameters()], clean
    return {}


@cases.case()
def manual_nesting(rank, world_size, impl):
    """test_fsdp_core's manually wrapped variant: wrappers built by hand, inner first."""
    model = make_net()
    ref = replicate(model)
    model.blocks[0] = wrap(impl, model.blocks[0])
    model.head = wrap(impl, model.head, sharding_strategy=api(impl).ShardingStrategy.SHARD_GRAD_OP)
    fsdp_model = wrap(impl, model)
    losses, _, params = train_against_reference(rank, world_size, impl, model, fsdp_model, ref)
    return {"losses": losses, "params": params}


test_case = cases.pytest_tests()
