"""Tensor-parallel parameters in a unit: FSDP over the TP-local tensors (FSDP2's 2-D and 3-D meshes).

A parameter that tensor parallelism (``parallelize_module``) made a DTensor on a 1-D TP mesh, with
``Shard(d)`` or ``Replicate()`` there, is sharded as FSDP2 shards it
(``_fsdp_param.FSDPParam._init_sharding_spec_tp``): its unit takes the **TP-local tensor** as the
parameter, so the flat layout, the all-gather and the reduce-scatter run over the data-parallel
ranks on TP-local tensors and never talk to the TP ranks. What changes is only how the pieces
are shown (:class:`TensorParallelSpec`):

- the sharded parameter is a DTensor on the DP mesh and the TP mesh joined (FSDP2's
  ``_spmd_mesh``: ``(dp, tp)``, HSDP ``(dp_replicate, dp_shard, tp)``) of the TP DTensor's global
  shape, placed ``(Shard(k), *tp_placements)`` (HSDP ``(Replicate(), Shard(k), *tp)``), where
  ``Shard(k)`` becomes ``_StridedShard(k, split_factor=n)`` when TP shards dim k over n ranks
  too (e.g. a colwise weight: ``(_StridedShard(0, split_factor=tp), Shard(0))``; a rowwise one:
  ``(Shard(0), Shard(1))``); its local tensor is this rank's DP chunk of its TP-local tensor;
  gradients are DTensors of the same placements;
- the unsharded parameter (forward/backward) is a DTensor on the TP mesh with the TP placements
  over the all-gathered TP-local tensor, so TP's modules run on it as without FSDP;
- its gradient, a DTensor on the TP mesh, is redistributed to the TP placements first (e.g. a
  ``Partial`` gradient of a replicated norm weight under sequence parallelism is all-reduced over
  TP) and its local tensor is reduce-scattered (FSDP2's ``_get_grad_inner_tensor``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from flashfsdp._torch_private import StridedShard, concatenate_meshes, dtensor_local

from .sharding_spec import ShardingSpec, is_dtensor


class TensorParallelSpec(ShardingSpec):
    """How one tensor-parallel parameter's DP chunk, unsharded value and gradients are shown.

    Args:
        dp: the unit's spec (its DP mesh, 1-D or HSDP 2-D, and placements).
        tp: the parameter's ``DTensorSpec`` before ``fully_shard`` (its TP mesh, placements and
            global shape).
        fqn: the parameter's name, for errors.

    Raises:
        ValueError: the parameter is a DTensor but the unit has no DP mesh, or the TP mesh and the
            DP mesh cannot be joined (not dims of one mesh, or overlapping: the TP mesh must be a
            sibling dim of the DP mesh's root mesh).
        NotImplementedError: a TP mesh of more than 1 dim, a TP placement other than ``Shard`` or
            ``Replicate`` (e.g. ``Partial``, ``_StridedShard``), or a torch without
            ``DeviceMesh._concatenate``.
    """

    def __init__(self, dp: ShardingSpec, tp, fqn: str):
        from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415

        if dp.mesh is None:
            raise ValueError(
                f"fully_shard: parameter '{fqn}' is a DTensor on {tp.mesh} (tensor parallelism) but the unit has no "
                f"DeviceMesh; pass the data-parallel mesh, e.g. fully_shard(module, mesh=mesh['dp'])")
        if tp.mesh.ndim != 1:
            raise NotImplementedError(
                f"fully_shard: parameter '{fqn}' is a DTensor on a {tp.mesh.ndim}-D mesh {tp.mesh}: only a 1-D tensor-"
                f"parallel mesh is supported")
        for p in tp.placements:
            if type(p) not in (Shard, Replicate):
                raise NotImplementedError(
                    f"fully_shard: parameter '{fqn}' is placed {tuple(tp.placements)} on its TP mesh: only Shard(dim) "
                    f"or Replicate() tensor-parallel parameters are supported")
        if concatenate_meshes is None or StridedShard is None:
            raise NotImplementedError(
                f"fully_shard: parameter '{fqn}' is a tensor-parallel DTensor, which needs DeviceMesh._concatenate "
                f"and _StridedShard (torch >= 2.9)")
        try:
            if tp.mesh.mesh_dim_names is None or dp.mesh.mesh_dim_names is None:
                raise ValueError("both must be named dims of one DeviceMesh")
            mesh = concatenate_meshes([dp.mesh, tp.mesh])
        except Exception as exc:
            raise ValueError(
                f"fully_shard: parameter '{fqn}' is a DTensor on the mesh {tp.mesh} (dims "
                f"{tp.mesh.mesh_dim_names}), which cannot be joined with the fully_shard mesh {dp.mesh} (dims "
                f"{dp.mesh.mesh_dim_names}): {exc}. Build both from one mesh, e.g. mesh = init_device_mesh(device, "
                f"(dp, tp), mesh_dim_names=('dp', 'tp')); parallelize_module(..., mesh['tp']); "
                f"fully_shard(..., mesh=mesh['dp'])") from exc
        if mesh.device_type != dp.mesh.device_type:
            raise ValueError(f"fully_shard: parameter '{fqn}' lives on a '{tp.mesh.device_type}' mesh, the fully_shard "
                             f"mesh is '{dp.mesh.device_type}'; build both from one mesh")
        super().__init__(mesh, tuple(dp.placements) + tuple(tp.placements))
        self.dp, self.tp = dp, tp
        self.global_shape = tuple(tp.tensor_meta.shape)
        self._unsharded = ShardingSpec(tp.mesh, tp.placements)

    def placements_for(self, dim: int = 0) -> tuple:
        """FSDP2's placements of this parameter sharded along ``dim`` of its TP-local tensor."""
        from torch.distributed.tensor import Shard  # noqa: PLC0415

        split = self.tp.num_shards_map[dim]
        fsdp = StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)
        return tuple(self.dp.placements[:-1]) + (fsdp,) + tuple(self.tp.placements)

    def wrap(self, local: torch.Tensor, shape: Sequence[int], dim: int = 0) -> torch.Tensor:
        """``local`` (this rank's DP chunk of the TP-local tensor, of TP-local ``shape``) as a
        DTensor of the TP global shape on the joined mesh."""
        return super().wrap(local, self.global_shape, dim)

    def global_shape_of(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The TP global shape (``shape`` is the TP-local one)."""
        return self.global_shape

    def unsharded_parameter(self, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """The unsharded parameter over ``local`` (the all-gathered TP-local tensor): a DTensor on
        the TP mesh with the TP placements, as the module had it before ``fully_shard``."""
        return self._unsharded.parameter(local, self.global_shape, requires_grad)

    def local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The TP-local gradient to reduce over DP: a DTensor gradient redistributed to the TP
        placements first (``Partial`` all-reduced, collective over the TP mesh)."""
        if grad is None or not is_dtensor(grad):
            return grad
        if tuple(grad.placements) != tuple(self.tp.placements):
            grad = grad.redistribute(placements=self.tp.placements)
        return dtensor_local(grad)

    def local_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP-local part of a tensor of the TP global shape (``torch.chunk``'s, as
        DTensor's ``Shard`` cuts it; no communication)."""
        coordinate = self.tp.mesh.get_coordinate()[0]
        n = self.tp.mesh.size()
        for p in self.tp.placements:
            if p.is_shard():
                d = full.shape[p.dim]
                rows = -(-d // n)
                start = min(coordinate * rows, d)
                full = full.narrow(p.dim, start, max(0, min(rows, d - start)))
        return full

    def full_of_local(self, local_full: torch.Tensor) -> torch.Tensor:
        """The TP global value of the TP-local tensor ``local_full`` (collective over the TP mesh)."""
        return self._unsharded.wrap(local_full.contiguous(), self.global_shape).full_tensor()


def tensor_parallel_specs(dp: ShardingSpec, params: Sequence[torch.Tensor], fqns: Sequence[str]
                          ) -> list[TensorParallelSpec | None]:
    """Per parameter, its :class:`TensorParallelSpec` if it is a DTensor, else None.

    Raises:
        see :class:`TensorParallelSpec`; NotImplementedError also for a DTensor whose local tensor
        defines FSDP2's all-gather extensions (``fsdp_pre_all_gather``).
    """
    out = []
    for p, fqn in zip(params, fqns):
        if not is_dtensor(p):
            out.append(None)
            continue
        if hasattr(dtensor_local(p), "fsdp_pre_all_gather"):
            raise NotImplementedError(
                f"fully_shard: parameter '{fqn}' is a tensor-parallel DTensor whose local tensor defines "
                f"fsdp_pre_all_gather / fsdp_post_all_gather: all-gather extensions are not supported with tensor "
                f"parallelism")
        out.append(TensorParallelSpec(dp, p._spec, fqn))
    return out


def tp_local_param(param: torch.Tensor) -> torch.Tensor:
    """What the unit shards of ``param``: its TP-local tensor (a leaf of ``param``'s
    ``requires_grad``) for a DTensor, ``param`` itself otherwise."""
    if not is_dtensor(param):
        return param
    local = dtensor_local(param).detach()
    local.requires_grad_(param.requires_grad)
    return local
