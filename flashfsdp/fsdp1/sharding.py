"""FSDP1's ``sharding_strategy`` / ``process_group`` / ``device_mesh`` as ``fully_shard`` meshes.

=======================  ==========================================================================
FULL_SHARD               a unit over the group (1-D mesh), ``reshard_after_forward=True``
SHARD_GRAD_OP            the same, ``reshard_after_forward=False``
NO_SHARD                 a unit on the (W, 1) mesh, see [Note: NO_SHARD]
HYBRID_SHARD             a unit over a 2-D mesh (replicate, shard): sharded within each shard
                         group, gradients all-reduced across the replicas (``fully_shard``'s HSDP)
_HYBRID_SHARD_ZERO2      the same, ``reshard_after_forward=False``
=======================  ==========================================================================

[Note: NO_SHARD]
FSDP1's NO_SHARD keeps every parameter whole on every rank and all-reduces the gradients (DDP).
That is HSDP with shard groups of one rank: each NO_SHARD unit is built on the 2-D mesh of shape
(W, 1) with dims (replicate, shard) over the group, so its "shard" is the whole flat buffer (its
all-gather and reduce-scatter are local) and the runtime all-reduces each reduced gradient across
the W replicas, divided by W as FSDP1 does (pre- and post-divided for low-precision reductions,
``runtime/reduce.py``); ``no_sync`` skips the all-reduce with the rest of the reduction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from flashfsdp.runtime.agreement import all_gather_values
from flashfsdp.runtime.comm_factory import default_group

from .api import HYBRID_STRATEGIES, ShardingStrategy

HSDP_DIM_NAMES = ("replicate", "shard")


@dataclass(frozen=True)
class Sharding:
    """How a wrapper's units are built.

    Attributes:
        mesh: ``fully_shard``'s mesh (None: the default group).
        sync_groups: the groups ``sync_module_states`` broadcasts over, in order (their rank 0s).
    """

    mesh: DeviceMesh | None
    sync_groups: tuple


def resolve(strategy: ShardingStrategy, process_group, device_mesh, device_type: str) -> Sharding:
    """The :class:`Sharding` of a wrapper (see the module's table).

    Raises:
        ValueError: both ``process_group`` and ``device_mesh``; a hybrid strategy without a 2-D
            mesh or an (intra-node, inter-node) pair of groups; a 2-D mesh or a pair of groups
            for a strategy that is not hybrid; a mesh of more than 2 dims.
        TypeError: ``device_mesh`` is not a DeviceMesh.
    """
    if process_group is not None and device_mesh is not None:
        raise ValueError("FullyShardedDataParallel: pass either process_group or device_mesh, not both")
    if device_mesh is not None and not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"FullyShardedDataParallel: device_mesh must be a DeviceMesh, got {type(device_mesh).__name__}")
    two_d = isinstance(process_group, tuple) or (device_mesh is not None and device_mesh.ndim == 2)
    if strategy in HYBRID_STRATEGIES:
        if not two_d:
            raise ValueError(
                f"FullyShardedDataParallel: sharding_strategy={strategy} shards within a group and replicates "
                f"across groups, so it needs a 2-D device_mesh of dims ('replicate', 'shard'), e.g. "
                f"init_device_mesh('{device_type}', (num_replicas, shard_size), mesh_dim_names=('replicate', "
                f"'shard')), or process_group=(intra_node_group, inter_node_group); got "
                f"{'a 1-D device_mesh' if device_mesh is not None else 'one process group'}")
        mesh = _hybrid_mesh(process_group, device_mesh, device_type)
        return Sharding(mesh, (mesh.get_group(1), mesh.get_group(0)))
    if two_d:
        raise ValueError(
            f"FullyShardedDataParallel: a 2-D device_mesh or a pair of process groups is for HYBRID_SHARD / "
            f"_HYBRID_SHARD_ZERO2, but sharding_strategy is {strategy}; pass a 1-D mesh or one process group")
    if device_mesh is not None and device_mesh.ndim != 1:
        raise ValueError(f"FullyShardedDataParallel: device_mesh must be 1-D or 2-D, got {device_mesh.ndim} dims")
    group = device_mesh.get_group() if device_mesh is not None else (process_group or default_group())
    if strategy is ShardingStrategy.NO_SHARD and group is not None and dist.get_world_size(group) > 1:
        return Sharding(_replicated_mesh(group, device_type), (group,))
    mesh = device_mesh if device_mesh is not None else (
        DeviceMesh.from_group(process_group, device_type) if process_group is not None else None)
    return Sharding(mesh, (group,) if group is not None else ())


def _hybrid_mesh(process_group, device_mesh, device_type: str) -> DeviceMesh:
    """The 2-D (replicate, shard) mesh of FSDP1's hybrid arguments: a 2-D ``device_mesh`` (named
    as ``fully_shard`` wants it, dim 0 replicating) or ``(intra_node_group, inter_node_group)``."""
    if device_mesh is not None:
        if device_mesh.mesh_dim_names is not None:
            return device_mesh
        return DeviceMesh(device_mesh.device_type, device_mesh.mesh, mesh_dim_names=HSDP_DIM_NAMES)
    if len(process_group) != 2:
        raise ValueError(f"FullyShardedDataParallel: process_group for hybrid sharding must be the pair "
                         f"(intra_node_group, inter_node_group), got {len(process_group)} groups")
    intra, inter = process_group
    rows = all_gather_values(dist.get_process_group_ranks(intra))  # every rank's shard group
    mesh = [next(row for row in rows if r in row) for r in dist.get_process_group_ranks(inter)]
    return DeviceMesh.from_group([inter, intra], device_type, mesh=torch.tensor(mesh),
                                 mesh_dim_names=HSDP_DIM_NAMES)


_replicated_meshes: dict[int, DeviceMesh] = {}


def _replicated_mesh(group, device_type: str) -> DeviceMesh:
    """The (W, 1) (replicate, shard) mesh over ``group``'s ranks (see [Note: NO_SHARD]); built
    once per group (collective the first time: every rank builds its subgroups)."""
    key = id(group)
    if key not in _replicated_meshes:
        ranks = torch.tensor(dist.get_process_group_ranks(group)).reshape(-1, 1)
        _replicated_meshes[key] = DeviceMesh(device_type, ranks, mesh_dim_names=HSDP_DIM_NAMES)
    return _replicated_meshes[key]
