"""Port of upstream ``test/distributed/fsdp/test_wrap.py``: torch's auto-wrap policies pick the same
modules under torch's FSDP1 and flashfsdp's, and the wrapped models train like the reference.

Upstream's ``TestAutoWrap`` checks which modules each policy wraps (``ModuleWrapPolicy``,
``transformer_auto_wrap_policy``, ``size_based_auto_wrap_policy`` with its numel bookkeeping,
``lambda_auto_wrap_policy``, ``CustomPolicy`` with per-module overrides, ``always_wrap_policy``)
and that mixed precision wraps ``_BatchNorm`` separately; here each case returns the wrapped
paths (compared with torch's) and, where it trains, the losses and parameters. The bad inputs of
auto-wrapping are in ``test_bad_input.py``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.distributed.fsdp import wrap as policies

from tests.fsdp1_suite.common import (
    Block, api, make_net, replicate, train_against_reference, wrap, wrapped_paths,
)
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)


def _wrap_and_train(rank, world_size, impl, policy, steps: int = 2, **kwargs):
    model = make_net()
    ref = replicate(model)
    fsdp_model = wrap(impl, model, auto_wrap_policy=policy, **kwargs)
    paths = wrapped_paths(impl, fsdp_model)
    losses, _, params = train_against_reference(rank, world_size, impl, model, fsdp_model, ref, steps=steps)
    return {"paths": {p: torch.ones(()) for p in paths}, "losses": losses, "params": params}


@cases.case()
def module_wrap_policy(rank, world_size, impl):
    return _wrap_and_train(rank, world_size, impl, policies.ModuleWrapPolicy({Block, nn.LayerNorm}))


@cases.case()
def transformer_policy(rank, world_size, impl):
    return _wrap_and_train(rank, world_size, impl,
                           functools.partial(policies.transformer_auto_wrap_policy, transformer_layer_cls={Block}))


@cases.case()
def size_based_policy(rank, world_size, impl):
    """``min_num_params=200``: each Block's remainder (after its linears) and the head qualify."""
    policy = functools.partial(policies.size_based_auto_wrap_policy, min_num_params=200)
    return _wrap_and_train(rank, world_size, impl, policy)


@cases.case()
def lambda_policy(rank, world_size, impl):
    return _wrap_and_train(rank, world_size, impl, functools.partial(
        policies.lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear) and m.out_features == 4))


@cases.case()
def custom_policy_overrides(rank, world_size, impl):
    """``policies.CustomPolicy``: Blocks with the root's arguments, the head with SHARD_GRAD_OP."""
    strategy = api(impl).ShardingStrategy

    def choose(module):
        if isinstance(module, Block):
            return True
        return {"sharding_strategy": strategy.SHARD_GRAD_OP} if getattr(module, "out_features", 0) == 4 else False

    return _wrap_and_train(rank, world_size, impl, policies.CustomPolicy(choose))


@cases.case()
def always_wrap(rank, world_size, impl):
    return _wrap_and_train(rank, world_size, impl, policies.always_wrap_policy)


@cases.case(torch_reason="torch's FSDP1 takes a set of classes only in its composable API")
def set_of_classes(rank, world_size, impl):
    """The set-of-classes shorthand wraps what ``policies.ModuleWrapPolicy`` of the same classes wraps."""
    out = _wrap_and_train(rank, world_size, impl, {Block})
    assert sorted(out["paths"]) == ["", "blocks.0", "blocks.1"], sorted(out["paths"])
    return out


@cases.case()
def mixed_precision_wraps_norms_apart(rank, world_size, impl):
    """``MixedPrecision._module_classes_to_ignore`` (here LayerNorm) is wrapped apart, without
    mixed precision, as FSDP1's ``_auto_wrap`` does (no training: only the choice)."""
    mp = api(impl).MixedPrecision(param_dtype=torch.float16, _module_classes_to_ignore=(nn.LayerNorm,))
    fsdp_model = wrap(impl, make_net(), auto_wrap_policy=policies.ModuleWrapPolicy({Block}), mixed_precision=mp)
    return {p: torch.ones(()) for p in wrapped_paths(impl, fsdp_model)}


@cases.case()
def nested_wrappers_share_arguments(rank, world_size, impl):
    """Nested wrappers get the root's arguments (here NO_SHARD): every rank holds every element."""
    strategy = api(impl).ShardingStrategy.NO_SHARD
    model = make_net()
    fsdp_model = wrap(impl, model, auto_wrap_policy=policies.ModuleWrapPolicy({Block}), sharding_strategy=strategy)
    assert sum(p.numel() for p in fsdp_model.parameters()) == sum(p.numel() for p in make_net().parameters())
    return {p: torch.ones(()) for p in wrapped_paths(impl, fsdp_model)}


test_case = cases.pytest_tests()
