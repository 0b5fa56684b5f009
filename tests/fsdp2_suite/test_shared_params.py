"""Port of upstream ``test/distributed/_composable/fsdp/test_fully_shard_shared_params.py``.

Shared (tied) parameters: ``TransformerWithSharedParams`` ties its embedding to its output
projection, both in the root's unit, with each encoder/decoder layer its own unit; training
matches the replicated reference with and without resharding after forward and with
activation checkpointing (``torch.distributed._composable.checkpoint``). Upstream runs 10
iterations at W = min(4, #GPUs); here 6 at W = 2 (the four subtests are ~4/5 of the file's
runtime). The reference is upstream's
``replicate(ref_model)``: a copy whose gradients are averaged over the ranks.

``extra_*`` cases have no upstream test in this file: a parameter shared by two units that are
fully_shard'ed separately must raise (torch checks it at lazy init: "is shared with a parameter
already managed by another FSDP group"), and the fix FSDP2 recommends, ``fully_shard([module_a,
module_b])`` (one unit of both modules), must train correctly.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.common_fsdp import MLP, DEVICEInitMode, FSDPInitMode, TransformerWithSharedParams

from tests.fsdp2_suite.common import FP32, average_grads, rank_seed, train_parity
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)

UPSTREAM = "test/distributed/_composable/fsdp/test_fully_shard_shared_params.py"


# ============================================================================ TestFullyShardSharedParams
def _train_shared_params(rank, impl, reshard_after_forward: bool, use_activation_checkpointing: bool):
    from torch.distributed._composable import checkpoint  # noqa: PLC0415

    torch.manual_seed(42)
    model = TransformerWithSharedParams.init(dist.group.WORLD, FSDPInitMode.NO_FSDP, DEVICEInitMode.DEVICE_NEVER, {},
                                             deterministic=True)
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for module in [*model.transformer.encoder.layers, *model.transformer.decoder.layers]:
        if use_activation_checkpointing:
            checkpoint(module)
        impl.fully_shard(module, reshard_after_forward=reshard_after_forward)
    impl.fully_shard(model, reshard_after_forward=reshard_after_forward)
    assert model.output_proj.weight is model.embed_tokens.weight and impl.is_sharded(model.embed_tokens.weight)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)

    rank_seed(rank)
    losses = []
    for iter_idx in range(6):
        inp = ref_model.get_input(torch.device("cpu"))
        step_losses = []
        for _model, _optim in ((ref_model, ref_optim), (model, optim)):
            _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            step_losses.append(_model(*inp).sum())
            step_losses[-1].backward()
            if _model is ref_model:
                average_grads(ref_model)
            _optim.step()
        torch.testing.assert_close(step_losses[1], step_losses[0], **FP32)
        losses.append(step_losses[1].detach())
    impl.check_sharded_parity(ref_model, model)
    return losses


@cases.case()
def train_shared_params(rank, world_size, impl):
    """Upstream: test_fully_shard_shared_params.py::TestFullyShardSharedParams::test_train_shared_params.

    reshard_after_forward=True, no activation checkpointing: 6 Adam steps (``zero_grad``
    alternating ``set_to_none``) with the tied embedding/output projection in the root's unit;
    losses match the replicated reference each step, parameters at the end."""
    return _train_shared_params(rank, impl, reshard_after_forward=True, use_activation_checkpointing=False)


@cases.case()
def train_shared_params_no_reshard(rank, world_size, impl):
    """Upstream: test_fully_shard_shared_params.py::TestFullyShardSharedParams::test_train_shared_params.

    Subtest reshard_after_forward=False, no activation checkpointing."""
    return _train_shared_params(rank, impl, reshard_after_forward=False, use_activation_checkpointing=False)


@cases.case()
def train_shared_params_ac(rank, world_size, impl):
    """Upstream: test_fully_shard_shared_params.py::TestFullyShardSharedParams::test_train_shared_params.

    Subtest reshard_after_forward=True with activation checkpointing (composable ``checkpoint``
    on each layer before fully_shard)."""
    return _train_shared_params(rank, impl, reshard_after_forward=True, use_activation_checkpointing=True)


@cases.case()
def train_shared_params_no_reshard_ac(rank, world_size, impl):
    """Upstream: test_fully_shard_shared_params.py::TestFullyShardSharedParams::test_train_shared_params.

    Subtest reshard_after_forward=False with activation checkpointing."""
    return _train_shared_params(rank, impl, reshard_after_forward=False, use_activation_checkpointing=True)


# ============================================================================ extras (no upstream test)
def _tied_mlps(n: int = 2) -> nn.Sequential:
    model = nn.Sequential(*[MLP(8) for _ in range(n)])
    model[0].in_proj.weight = model[1].in_proj.weight
    return model


def _sharding_raises(impl, model: nn.Module, units: list) -> None:
    """fully_shard each of ``units`` on its own, then ``model``, and run a forward: ValueError
    (a parameter shared by two units) must be raised on the way."""
    try:
        for unit in units:
            impl.fully_shard(unit)
        impl.fully_shard(model)
        model(torch.randn(2, 8))
    except ValueError:
        return
    raise AssertionError("expected ValueError (a parameter shared by two units)")


@cases.case()
def extra_shared_params_across_sibling_units_raise(rank, world_size, impl):
    """Upstream: none (FSDP2's ``_validate_no_duplicate_params``, raised at lazy init).

    model[0] and model[1] share in_proj.weight and are fully_shard'ed separately (then the root):
    the parameter would be sharded twice, as two copies trained apart. ValueError must be raised,
    by fully_shard or at the latest by the first forward (torch: at lazy init)."""
    model = _tied_mlps()
    _sharding_raises(impl, model, [model[0], model[1]])


@cases.case()
def extra_shared_params_nested_unit_and_root_raise(rank, world_size, impl):
    """Upstream: none (FSDP2's ``_validate_no_duplicate_params``, raised at lazy init).

    model[0] and model[1] share in_proj.weight; model[0] is fully_shard'ed, then the root (which
    gets model[1]'s registration of the same parameter). ValueError must be raised, by fully_shard
    or at the latest by the first forward."""
    model = _tied_mlps()
    _sharding_raises(impl, model, [model[0]])


@cases.case()
def extra_train_shared_params_grouped_unit(rank, world_size, impl):
    """Upstream: none (the fix FSDP2's error message recommends: ``fully_shard([module_a,
    module_b])`` for shared parameters).

    model[0] and model[1] share in_proj.weight and form one unit (``fully_shard([model[0],
    model[1]])``), the root gets model[2]: both registrations hold one sharded parameter, and 3
    Adam steps match the replicated reference (losses, sharded parameters and gradients)."""
    model = _tied_mlps(3)
    ref = copy.deepcopy(model)
    impl.fully_shard([model[0], model[1]])
    impl.fully_shard(model)
    assert model[0].in_proj.weight is model[1].in_proj.weight and impl.is_sharded(model[0].in_proj.weight)
    assert len(list(model.parameters())) == 11
    rank_seed(rank)
    return train_parity(impl, ref, model, lambda step: torch.randn(4, 8), steps=3)


test_case = cases.pytest_tests()
