"""Port of upstream ``test/distributed/fsdp/test_fsdp_hybrid_shard.py`` at W = 4 (2 replicas of 2
shards, CPU gloo): HYBRID_SHARD and _HYBRID_SHARD_ZERO2 on a 2-D device mesh and on an
(intra-node, inter-node) pair of process groups train like the replicated reference, and like
torch's FSDP1 on the same mesh. flashfsdp builds them on ``fully_shard``'s 2-D (replicate, shard)
meshes."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

from tests.fsdp1_suite.common import Block, api, make_net, replicate, train_against_reference, wrap
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)
W = 4


def _train(rank, world_size, impl, **kwargs):
    model = make_net()
    ref = replicate(model)
    fsdp_model = wrap(impl, model, auto_wrap_policy=ModuleWrapPolicy({Block}), **kwargs)
    # what this rank holds: a DTensor parameter's local chunk (FSDP1's flat parameters are local)
    shard_numel = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in fsdp_model.parameters())
    assert shard_numel < sum(p.numel() for p in ref.parameters())  # sharded (over 2 ranks), not replicated
    losses, _, params = train_against_reference(rank, world_size, impl, model, fsdp_model, ref, steps=2)
    return {"losses": losses, "params": params}


@cases.case(world_size=W)
def hybrid_shard_device_mesh(rank, world_size, impl):
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    return _train(rank, world_size, impl, sharding_strategy=api(impl).ShardingStrategy.HYBRID_SHARD, device_mesh=mesh)


@cases.case(world_size=W)
def hybrid_zero2_group_pair(rank, world_size, impl):
    """``process_group=(intra_node_group, inter_node_group)``: shard groups {0,1} {2,3}, replica
    groups {0,2} {1,3}."""
    intra, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    inter, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
    return _train(rank, world_size, impl, sharding_strategy=api(impl).ShardingStrategy._HYBRID_SHARD_ZERO2,
                  process_group=(intra, inter))


test_case = cases.pytest_tests()
