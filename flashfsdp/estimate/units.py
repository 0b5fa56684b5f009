"""The units of a model as the runtime would build them, from parameter shapes alone.

``fully_shard`` groups a unit's parameters by (dtype, requires_grad) into flat groups and lays each
out with ``runtime/layout.py`` (FSDP2's dim-0 chunks of every parameter, or dim-k chunks of one that
``shard_placement_fn`` places ``Shard(k)``, packed per rank at offsets
aligned for every dtype the group uses, see ``runtime/unit.py``). Here the same layout code is applied to the shapes of a model
that may live on the meta device: nothing is allocated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import nn

from flashfsdp.models.tp_plan import tp_local_shape
from flashfsdp.runtime.layout import ShardLayout, align_elements
from flashfsdp.runtime.quantized_gather import group_all_gather_nbytes
from flashfsdp.runtime.reduce import segment_numel
from flashfsdp.runtime.sharding_spec import local_of


@dataclass(frozen=True)
class GroupSpec:
    """One flat group of a unit (what a ``FlatParam`` holds), in elements and bytes per element.

    Attributes:
        layout: the group's layout over the shard group (S elements per rank, W·S gathered).
        dtype_bytes: bytes per element of the original dtype (master shard and gradient shard).
        param_bytes: bytes per element of ``param_dtype`` (the unsharded buffer).
        reduce_bytes: bytes per element of ``reduce_dtype`` (gradient pack and reduce-scatter).
        trainable: whether the group's parameters require gradients.
        floating: whether ``param_dtype`` is floating (only such groups are all-gathered in int8).
        param_dtype, reduce_dtype: the dtypes themselves, where known (which units share a
            bucket's collective depends on them: ``runtime/bucket.py``); None: only their bytes
            per element are known.
    """

    layout: ShardLayout
    dtype_bytes: int
    param_bytes: int
    reduce_bytes: int
    trainable: bool
    floating: bool = True
    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def busiest_rank_elements(self) -> int:
        """Parameter elements (padding excluded) of the rank that holds the most: the size of its
        local chunks, which is what a stock optimizer keeps state for (rank 0: FSDP2's chunks
        are full up to the last rank that holds rows)."""
        return sum(self.layout.local_numel(0, i) for i in range(len(self.layout.shapes)))

    @property
    def reduce_segment(self) -> int:
        """R, the elements of one rank's reduce-scatter segment as the runtime packs the group's
        gradients (``runtime/reduce.py``: the shard's S elements and one flag per parameter,
        padded to the alignment); the reduce-scatter's input is W of them."""
        return segment_numel(self.layout, len(self.layout.shapes))

    @property
    def gathered_bytes(self) -> int:
        """The gathered buffer an all-gather lands in before copy-out (0 where the layout is
        zero-copy and it is the unsharded buffer itself)."""
        return 0 if self.layout.zero_copy else self.layout.gathered_size * self.param_bytes


@dataclass(frozen=True)
class UnitSpec:
    """One unit: a name and its flat groups. Sizes are bytes on one rank."""

    name: str
    groups: tuple[GroupSpec, ...]

    def _sum(self, fn, trainable_only: bool = False) -> int:
        return sum(fn(g) for g in self.groups if g.trainable or not trainable_only)

    @property
    def numel(self) -> int:
        """Parameter elements of the unit (no padding)."""
        return self._sum(lambda g: sum(g.layout.numels))

    def unsharded_bytes(self) -> int:
        """The unsharded buffers: the unsharded layout's elements in ``param_dtype`` per group."""
        return self._sum(lambda g: g.layout.unsharded_size * g.param_bytes)

    def gathered_bytes(self) -> int:
        """The gathered buffers alive besides the unsharded ones from an all-gather's issue to its
        copy-out (``GroupSpec.gathered_bytes``)."""
        return self._sum(lambda g: g.gathered_bytes)

    def secondary_bytes(self, parts: int) -> int:
        """The slice a rank keeps after forward when it reshards to groups of ``parts`` ranks:
        1/parts of the gathered layout per group."""
        return self._sum(lambda g: g.layout.gathered_size // parts * g.param_bytes)

    def all_gather_bytes(self, all_gather_dtype: torch.dtype | None) -> int:
        """Bytes one all-gather of the unit writes over its shard group: the unsharded buffers, or
        with ``all_gather_dtype=torch.int8`` W packed int8 chunks (values and a scale per 256) for
        each floating group (``flashfsdp.runtime.quantized_gather.group_all_gather_nbytes``)."""
        return self._sum(lambda g: group_all_gather_nbytes(g.layout, g.param_bytes,
                                                           all_gather_dtype is not None and g.floating))

    def master_bytes(self) -> int:
        """The master shard: S elements in the original dtype per group."""
        return self._sum(lambda g: g.layout.shard_size * g.dtype_bytes)

    def grad_shard_bytes(self) -> int:
        """The gradient shard: S elements in the original dtype per trainable group."""
        return self._sum(lambda g: g.layout.shard_size * g.dtype_bytes, trainable_only=True)

    def unsharded_grad_bytes(self) -> int:
        """Autograd's gradients of the unsharded parameters (``param_dtype``, no padding)."""
        return self._sum(lambda g: sum(g.layout.numels) * g.param_bytes, trainable_only=True)

    def reduce_scatter_numel(self) -> int:
        """Elements of the reduce-scatter's inputs: W segments of ``GroupSpec.reduce_segment``
        (shard and flags) per trainable group, as the runtime packs them."""
        return self._sum(lambda g: g.layout.world_size * g.reduce_segment, trainable_only=True)

    def reduce_buffer_bytes(self) -> int:
        """One reduction's buffers: the packed input (W·R) and the reduced segment (R) in
        ``reduce_dtype`` (R: ``GroupSpec.reduce_segment``)."""
        return self._sum(lambda g: (g.layout.world_size + 1) * g.reduce_segment * g.reduce_bytes,
                         trainable_only=True)

    def reduce_scatter_bytes(self) -> int:
        """The reduce-scatter's input (W·R elements in ``reduce_dtype`` per trainable group)."""
        return self._sum(lambda g: g.layout.world_size * g.reduce_segment * g.reduce_bytes, trainable_only=True)

    def reduced_shard_bytes(self) -> int:
        """The reduce-scatter's output (R elements in ``reduce_dtype`` per trainable group, the
        shard and its flags): what HSDP all-reduces across replicas."""
        return self._sum(lambda g: g.reduce_segment * g.reduce_bytes, trainable_only=True)

    def optimizer_state_bytes(self, buffers: int) -> int:
        """``buffers`` tensors of the size and dtype of the busiest rank's trainable local chunks
        (Adam's two moments, SGD's momentum)."""
        return self._sum(lambda g: buffers * g.busiest_rank_elements() * g.dtype_bytes, trainable_only=True)

    def trainable_params(self) -> int:
        """Number of trainable parameters (each has one local chunk, maybe empty, on every rank)."""
        return self._sum(lambda g: len(g.layout.numels), trainable_only=True)


def default_units(model: nn.Module) -> list[nn.Module]:
    """The units of the usual wrapping: each block of ``model.layers`` (torchtitan's and this
    project's Llama), or none (the whole model one unit) when there is no ``layers`` list."""
    layers = getattr(model, "layers", None)
    return list(layers) if isinstance(layers, (nn.ModuleList, nn.Sequential)) else []


def resolve_units(model: nn.Module, units: Sequence[nn.Module | str] | None) -> list[tuple[str, nn.Module]]:
    """(name, module) of every non-root unit, in forward order.

    Raises:
        ValueError: a name that is not a submodule of ``model`` or a module that is not one of
            its submodules (the message names it), or the model itself.
    """
    names = {id(m): n for n, m in model.named_modules()}
    chosen = default_units(model) if units is None else list(units)
    resolved = []
    for item in chosen:
        if isinstance(item, str):
            try:
                item = model.get_submodule(item)
            except AttributeError:
                raise ValueError(f"estimate: units: {item!r} is not a submodule of the model; pass "
                                 f"qualified names such as {next(iter(names.values()), '')!r} or modules") from None
        if not isinstance(item, nn.Module) or id(item) not in names or item is model:
            raise ValueError(f"estimate: units: {type(item).__name__} is not a proper submodule of the model "
                             f"(the model itself is the root unit)")
        resolved.append((names[id(item)], item))
    return resolved


def build_units(model: nn.Module, units: Sequence[nn.Module | str] | None, world_size: int,
                param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None,
                placement: Callable[[torch.Tensor], tuple[tuple[int, ...], int]] | None = None) -> list[UnitSpec]:
    """The root unit first, then the others in forward order, laid out over ``world_size`` ranks.

    Each parameter belongs to the first unit (from the innermost) whose module contains it, the
    others to the root, as bottom-up ``fully_shard`` calls assign them; a tied weight counts once.
    ``placement(param)`` gives the shape the unit shards (a TP-local piece under tensor
    parallelism) and the dim it shards it along (``shard_placement_fn``'s ``Shard(k)``); None:
    the parameter's own shape along dim 0.

    Raises:
        ValueError: see :func:`resolve_units`; a parameter shared by two units (``fully_shard``
            refuses it too: group them into one unit).
    """
    return [unit_spec(name, params, world_size, param_dtype, reduce_dtype, placement)
            for name, params in assign_params(model, units)]


def assign_params(model: nn.Module, units: Sequence[nn.Module | str] | None) -> list[tuple[str, list[torch.Tensor]]]:
    """(unit name, its parameters) of every unit, the root ("<root>") first, then the others in
    forward order: the assignment of :func:`build_units`.

    Raises:
        ValueError: as :func:`build_units`.
    """
    owner: dict[int, str] = {}
    per_unit: dict[str, list[torch.Tensor]] = {}
    for name, module in resolve_units(model, units):
        params = per_unit.setdefault(name, [])
        for p in module.parameters():
            if id(p) in owner and owner[id(p)] != name:
                raise ValueError(f"estimate: a parameter is shared by units '{owner[id(p)]}' and '{name}'; "
                                 f"make them one unit (as fully_shard([a, b]) would)")
            if id(p) not in owner:
                owner[id(p)] = name
                params.append(p)
    root = [p for p in dict.fromkeys(model.parameters()) if id(p) not in owner]
    return [("<root>", root), *per_unit.items()]


def unit_members(model: nn.Module, units: Sequence[nn.Module | str] | None) -> dict[str, tuple[str, ...]]:
    """The qualified names of the modules that directly hold each unit's parameters, by unit name
    (the root's of a Llama: its embedding, final norm and output projection), in the model's order.

    Raises:
        ValueError: as :func:`build_units`.
    """
    holder = {id(p): name.rpartition(".")[0] or name for name, p in model.named_parameters()}
    return {unit: tuple(dict.fromkeys(holder[id(p)] for p in params)) for unit, params in assign_params(model, units)}


def unit_spec(name: str, params: Sequence[torch.Tensor], world_size: int, param_dtype: torch.dtype | None,
              reduce_dtype: torch.dtype | None,
              placement: Callable[[torch.Tensor], tuple[tuple[int, ...], int]] | None = None) -> UnitSpec:
    """The flat groups ``ShardedUnit`` makes of ``params`` (see ``runtime/unit.py``; ``placement``
    as in :func:`build_units`)."""
    keys: dict[tuple[torch.dtype, bool], list[tuple[tuple[int, ...], int]]] = {}
    for p in params:
        # (a tensor-parallel DTensor without ``placement``: the unit shards its TP-local tensor,
        # ``runtime/tensor_parallel.py``)
        keys.setdefault((p.dtype, p.requires_grad), []).append(
            placement(p) if placement is not None else (tuple(local_of(p).shape) or (1,), 0))
    groups = []
    for (dtype, trainable), placed in keys.items():
        pdt = param_dtype if (param_dtype is not None and dtype.is_floating_point) else dtype
        rdt = reduce_dtype or pdt
        align = align_elements([dtype.itemsize, pdt.itemsize, rdt.itemsize])
        shapes, dims = [shape for shape, _ in placed], [dim for _, dim in placed]
        groups.append(GroupSpec(ShardLayout.build(shapes, world_size, align, dims), dtype.itemsize, pdt.itemsize,
                                rdt.itemsize, trainable, pdt.is_floating_point, pdt, rdt))
    return UnitSpec(name, tuple(groups))


def param_placement(model: nn.Module, tp: int = 1, shard_placement_fn=None
                    ) -> Callable[[torch.Tensor], tuple[tuple[int, ...], int]] | None:
    """The ``placement`` of :func:`build_units` for ``model``: under ``tp`` > 1 the piece of each
    parameter one TP rank holds under the Llama TP plan (``flashfsdp.models.tp_plan``, by the
    parameter's name; ceil(d / tp) along the split dim, the busiest rank's), and the dim
    ``shard_placement_fn(param)`` shards it along (its ``Shard(k)``; None: dim 0, FSDP2's).
    None when neither applies (every parameter whole, along dim 0).
    """
    if tp == 1 and shard_placement_fn is None:
        return None
    names = {id(p): n for n, p in model.named_parameters()}

    def placement(param: torch.Tensor) -> tuple[tuple[int, ...], int]:
        shape = tuple(param.shape) or (1,)
        if tp > 1:
            shape = tp_local_shape(names[id(param)], shape, tp)[0]
        placed = shard_placement_fn(param) if shard_placement_fn is not None else None
        dim = 0 if placed is None else placed.dim % len(shape)
        return shape, dim

    return placement
