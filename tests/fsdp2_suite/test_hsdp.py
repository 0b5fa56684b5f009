"""Port of upstream's HSDP cases (``test_fully_shard_training.py``, ``test_fully_shard_init.py``).

HSDP is ``fully_shard(module, mesh=init_device_mesh(..., (R, S), mesh_dim_names=("replicate",
"shard")))``: each unit is sharded within its shard group of S ranks and its gradients are
all-reduced across the R replicas. Every case runs at W = 4 as a 2 x 2 mesh of gloo ranks on CPU,
against torch's ``fully_shard`` and flashfsdp's; both give each parameter as a DTensor on the
2-D mesh with placements ``(Replicate(), Shard(0))``, whose local tensor is this rank's dim-0
chunk within its shard group (the same on every replica).
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer, TransformerBlock

from tests.fsdp2_suite.common import FP32, average_grads, rank_seed
from tests.fsdp2_suite.runner import CaseSet
from tests.fsdp2_suite.test_init import assert_raises

cases = CaseSet(__name__)


def hsdp_mesh():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


# ============================================================================ TestFullyShardHSDPTraining
def _train_parity_hsdp(impl, reshard_after_forward: bool, use_activation_checkpointing: bool, mlp_dim: int,
                       sync_gradients_at_last_batch: bool) -> list:
    mesh = hsdp_mesh()
    torch.manual_seed(42)
    model = nn.Sequential(nn.LayerNorm(mlp_dim, bias=False), MLP(mlp_dim, dim_multiplier=3), MLP(mlp_dim),
                          MLP(mlp_dim, dim_multiplier=3))
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for mlp in model:
        if use_activation_checkpointing:
            checkpoint(mlp)
        impl.fully_shard(mlp, mesh=mesh, reshard_after_forward=reshard_after_forward)
    impl.fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    impl.check_sharded_parity(ref_model, model)
    rank_seed(dist.get_rank())
    losses = []
    for iter_idx in range(2):
        for microbatch_idx in range(2):
            if sync_gradients_at_last_batch:
                model.set_requires_gradient_sync(microbatch_idx == 1)
            inp = torch.randn((8, mlp_dim))
            ref_loss, loss = ref_model(inp).sum(), model(inp).sum()
            ref_loss.backward()
            loss.backward()
            torch.testing.assert_close(loss, ref_loss, **FP32)
            losses.append(loss.detach())
        average_grads(ref_model)  # upstream's replicate() all-reduces in every backward: the same sum
        impl.check_sharded_parity(ref_model, model)
        for _optim in (ref_optim, optim):
            _optim.step()
            _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
        impl.check_sharded_parity(ref_model, model)
    return losses


@cases.case(4)
def train_parity_hsdp(rank, world_size, impl):
    """Upstream: test_fully_shard_training.py::TestFullyShardHSDPTraining::test_train_parity_hsdp.

    A LayerNorm and three MLPs, each a unit, and the root on a 2 x 2 (replicate, shard) mesh, vs
    the replicated reference (gradients averaged over the 4 ranks) with Adam, micro-batches with
    ``set_requires_gradient_sync`` on the last only or on every one. Upstream's 24 subtests (5
    iterations of 3 micro-batches) become two opposite corners of its grid (2 iterations of 2
    micro-batches): no resharding, no activation checkpointing, mlp_dim 3, sync on the last
    micro-batch only; and resharding, composable ``checkpoint``, mlp_dim 17, sync on every one."""
    return (_train_parity_hsdp(impl, False, False, 3, True) +
            _train_parity_hsdp(impl, True, True, 17, False))


# ============================================================================ TestFullyShardMeshArg
@cases.case(4)
def hsdp_2d_mesh_without_mesh_dim_names(rank, world_size, impl):
    """Upstream: test_fully_shard_init.py::TestFullyShardMeshArg::test_2d_mesh_without_mesh_dim_names.

    A 2-D mesh without dim names is refused with the same words (FSDP2: AssertionError,
    flashfsdp: ValueError, as its other argument errors)."""
    mesh = init_device_mesh("cpu", (2, 2))
    assert_raises((AssertionError, ValueError), lambda: impl.fully_shard(MLP(8), mesh=mesh),
                  "Please init the 2D mesh for HSDP with mesh_dim_names specified")


# ============================================================================ TestFullyShardHSDPBroadcast
def _local_values(impl, tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor.detach()


def _replica_values(impl, model, group) -> list[list[torch.Tensor]]:
    """Per parameter and buffer, this rank's values as each replica holds them."""
    out = []
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        local = _local_values(impl, tensor)
        gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(gathered, local.contiguous(), group=group)
        out.append(gathered)
    return out


@cases.case(4)
def hsdp_broadcast_across_replicas(rank, world_size, impl):
    """Upstream: test_fully_shard_init.py::TestFullyShardHSDPBroadcast::test_hsdp_broadcast_across_replicas.

    A Transformer (and a buffer) on a 2 x 2 mesh whose second replica overwrote its states with
    1337: the replicas differ, a broadcast of every local shard from the replicate group's first
    rank makes them equal, and a forward/backward runs."""
    mesh = hsdp_mesh()
    model_args = ModelArgs()
    model = Transformer(model_args)
    model.buf = torch.nn.Buffer(torch.randn((model_args.dim,)))
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            impl.fully_shard(module, mesh=mesh)
    impl.fully_shard(model, mesh=mesh)
    if mesh.get_local_rank("replicate") > 0:
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            tensor.detach().fill_(1337)
    group = mesh.get_group("replicate")
    for gathered in _replica_values(impl, model, group):
        for other in gathered[1:]:
            assert other.shape == gathered[0].shape
            assert not torch.equal(other, gathered[0])
    src = dist.get_process_group_ranks(group)[0]
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        dist.broadcast(_local_values(impl, tensor), src=src, group=group)
    for gathered in _replica_values(impl, model, group):
        torch.testing.assert_close(gathered[1], gathered[0], rtol=0, atol=0)
    torch.manual_seed(0)
    inp = torch.randint(0, model_args.vocab_size, (2, 16))
    loss = model(inp).sum()
    loss.backward()
    return [loss.detach(), impl.full_params(model)]


# ============================================================================ TestHSDPWithCustomHook
@cases.case(4)
def custom_hook_custom_stream_hsdp(rank, world_size, impl):
    """Upstream: test_fully_shard_init.py::TestHSDPWithCustomHook::test_custom_hook_custom_stream (HSDP part).

    Under native HSDP ``set_all_reduce_hook(..., stream=...)`` is refused with ValueError (the hook
    runs where the all-reduce runs). Upstream's second half, a hook on a custom CUDA stream under
    1-D FSDP, needs CUDA; the stream here is a CPU stream object (only its presence matters)."""
    model = MLP(10, bias=False)
    impl.fully_shard(model, mesh=hsdp_mesh())
    assert_raises(ValueError, lambda: model.set_all_reduce_hook(lambda output: output, stream=torch.cpu.Stream()),
                  "stream cannot be set when using native HSDP")


test_case = cases.pytest_tests()
