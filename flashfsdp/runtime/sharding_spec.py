"""How a unit shows its local chunks to PyTorch: FSDP2's DTensors over views of the flat shard.

A sharded parameter is what ``module.parameters()`` yields outside forward/backward: an
``nn.Parameter`` holding a ``torch.distributed.tensor.DTensor`` on the unit's mesh, with FSDP2's
placements (``(Shard(0),)`` on a 1-D mesh, ``(Replicate(), Shard(0))`` on an HSDP mesh), the full
(global) shape and contiguous stride, and as its local tensor this rank's dim-0 chunk — a view into
the group's flat shard, so that an optimizer stepping the DTensor writes the shard the all-gather
reads. Gradients are DTensors of the same placements over views of the flat gradient shard.
A parameter that FSDP2's ``shard_placement_fn`` shards along another dim k shows ``Shard(k)``
instead of ``Shard(0)`` (:meth:`ShardingSpec.placements_for`), its local tensor this rank's chunk
along k (``layout.py``, [Note: Shard(k) parameters]).

Without ``torch.distributed`` initialised (one process, W = 1) there is no mesh to put a DTensor
on; the parameters are then plain full-shape tensors (the shard *is* the whole parameter).

The DTensors are built as FSDP2 builds them (``_fsdp_common._from_local_no_grad``): straight from a
``DTensorSpec``, not through ``DTensor.from_local``'s differentiable, argument-checking path.

[Note: DTensor wrapper storage offset]
torch's C++ DTensor constructor copies the local tensor's storage offset into the wrapper, whose
storage has no data: a wrapper over a view at a nonzero offset then reports a nonzero
``data_ptr()``, and ``torch.save`` takes it for a plain tensor and fails ("Attempted to access the
data pointer on an invalid python storage"). FSDP2 never meets it (each parameter has a tensor of
its own, its chunk at offset 0); here every chunk after a group's first lies inside the flat shard.
So the wrappers are made as DTensor made them before that constructor existed — a wrapper
subclass of the global shape and stride at offset 0, with ``_spec`` and ``_local_tensor`` set —
and the state dict holds such wrappers too (``bindings/state_dict/sharded.py``).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from flashfsdp._torch_private import DTensorSpec, TensorMeta, dtensor_local, make_wrapper_subclass

# Set (True) on every sharded parameter a unit makes, so that code outside the unit can tell
# flashfsdp's DTensor parameters from other DTensors (``bindings/optimizer_local_step.py``).
SHARDED_ATTR = "_flashfsdp_sharded"


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape`` (elements)."""
    strides, step = [], 1
    for d in reversed(tuple(shape)):
        strides.append(step)
        step *= max(int(d), 1)
    return tuple(reversed(strides))


class ShardingSpec:
    """The mesh and placements a unit's local chunks are shown with (one per unit).

    Args:
        mesh: the unit's ``DeviceMesh`` (1-D, or 2-D ``(replicate, shard)`` for HSDP), or None
            for a single process without ``torch.distributed`` (plain tensors).
        placements: the DTensor placements on ``mesh`` (``(Shard(0),)``, or
            ``(Replicate(), Shard(0))``); ignored without a mesh.

    Raises:
        ValueError: a mesh without placements, or placements whose count is not the mesh's ndim.
    """

    def __init__(self, mesh, placements: Sequence = ()):
        self.mesh = mesh
        self.placements = tuple(placements)
        self._specs: dict[tuple, object] = {}  # (shape, dtype, dim) -> DTensorSpec, built once
        if mesh is not None and len(self.placements) != mesh.ndim:
            raise ValueError(f"ShardingSpec: {len(self.placements)} placements for a {mesh.ndim}-D mesh")

    @property
    def is_dtensor(self) -> bool:
        """Whether the sharded parameters are DTensors (False: plain tensors, no mesh)."""
        return self.mesh is not None

    def placements_for(self, dim: int = 0) -> tuple:
        """The placements of a parameter sharded along ``dim`` (>= 0): :attr:`placements` with the
        last (the shard mesh dim's) ``Shard(0)`` replaced by ``Shard(dim)``; () without a mesh."""
        if self.mesh is None or dim == 0:
            return self.placements
        from torch.distributed.tensor import Shard  # noqa: PLC0415

        return self.placements[:-1] + (Shard(dim),)

    def wrap(self, local: torch.Tensor, shape: Sequence[int], dim: int = 0) -> torch.Tensor:
        """``local`` (this rank's chunk along ``dim``, any dtype) as a DTensor of global ``shape``
        and :meth:`placements_for` ``dim``; without a mesh, ``local`` itself (which then has the
        full shape). Not differentiable: the result shares ``local``'s memory and has
        ``requires_grad=False``."""
        if self.mesh is None:
            return local
        key = (tuple(shape), local.dtype, dim)
        spec = self._specs.get(key)
        if spec is None:  # (a DTensorSpec is immutable and costly to build: one per shape, dtype, dim)
            shape = torch.Size(shape)
            spec = DTensorSpec(self.mesh, self.placements_for(dim),
                               tensor_meta=TensorMeta(shape, contiguous_strides(shape), local.dtype))
            self._specs[key] = spec
        return _wrapper(spec, local)

    def parameter(self, local: torch.Tensor, shape: Sequence[int], requires_grad: bool, dim: int = 0) -> nn.Parameter:
        """An ``nn.Parameter`` over :meth:`wrap` of ``local`` (sharded along ``dim``). A DTensor is made a parameter as
        ``nn.Parameter`` makes a tensor subclass one, but without its ``detach()``, which would
        rebuild the wrapper through torch's constructor (see [Note: DTensor wrapper storage offset])."""
        if self.mesh is None:
            param = nn.Parameter(local, requires_grad=requires_grad)
            setattr(param, SHARDED_ATTR, True)
            return param
        param = self.wrap(local, shape, dim)
        param.requires_grad_(requires_grad)
        param._is_param = True  # what nn.Parameter.__new__ marks a tensor subclass with
        setattr(param, SHARDED_ATTR, True)
        return param

    # The hooks below are the identity here; ``tensor_parallel.TensorParallelSpec`` overrides them.
    def global_shape_of(self, shape: Sequence[int]) -> tuple[int, ...]:
        """The global shape of a parameter whose unit shards a tensor of ``shape``: ``shape``."""
        return tuple(shape)

    def unsharded_parameter(self, local: torch.Tensor, requires_grad: bool) -> nn.Parameter:
        """The unsharded parameter (forward/backward) over ``local``, a view of the unsharded buffer."""
        return nn.Parameter(local, requires_grad=requires_grad)

    def local_grad(self, grad: torch.Tensor | None) -> torch.Tensor | None:
        """The tensor to reduce of an unsharded parameter's gradient: ``grad``."""
        return grad

    def local_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """The tensor the unit shards, of a value of the global shape: ``full``."""
        return full

    def __repr__(self) -> str:
        if self.mesh is None:
            return "ShardingSpec(plain tensors)"
        return f"ShardingSpec({self.mesh}, {self.placements})"


def wrap_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` (a tensor of ``param``'s local shape, any dtype, e.g. an optimizer state) as a DTensor
    of the DTensor ``param``'s mesh, placements, global shape and stride, as
    ``torch.zeros_like(param)`` would make it on FSDP2. Not differentiable; no copy, no collective."""
    spec = param._spec
    if local.dtype != param.dtype:
        spec = DTensorSpec(spec.mesh, spec.placements,
                           tensor_meta=TensorMeta(spec.tensor_meta.shape, spec.tensor_meta.stride, local.dtype))
    return _wrapper(spec, local)


def _wrapper(spec, local: torch.Tensor) -> torch.Tensor:
    """A DTensor of ``spec`` over ``local``, made as [Note: DTensor wrapper storage offset] says."""
    meta = spec.tensor_meta
    out = make_wrapper_subclass(DTensor, meta.shape, strides=meta.stride, storage_offset=0, dtype=local.dtype,
                                device=local.device, layout=local.layout, requires_grad=False)
    out._spec, out._local_tensor = spec, local
    return out


def local_of(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (the tensor itself otherwise); no copy, no collective."""
    return dtensor_local(tensor) if is_dtensor(tensor) else tensor


def is_dtensor(tensor: object) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor``."""
    return isinstance(tensor, DTensor)
