"""Between a flat group's shard and its parameters' full values, without ``nn.Module``.

:func:`gather_flat` (collective): every rank's shard of a group into one buffer of the gathered
layout, from which the full parameters are cut out (the full state dicts, ``summon_full_params``):
:func:`gathered_to_unsharded` lays such a buffer out as the unsharded one, and
:func:`unsharded_to_local` writes this rank's rows of an unsharded buffer back into a shard.
:func:`sharded_value_of` (local): a full-shape tensor or a DTensor of any placements as a tensor of
a sharded parameter's kind, this rank's rows of it (loading state dicts, FSDP1's optimizer state).
:func:`subclass_full_values` (collective): the full values of the parameters kept outside the flat
shard, tensor subclasses with FSDP2's all-gather extensions (``extensions.py``), whose slots in the
gathered buffer are zero: ``DTensor.full_tensor()`` of each, as FSDP2's full state dict gives it (a
tensor of the subclass), not the extension's all-gather, which may be lossy (a bf16 all-gather).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

from flashfsdp.kernels import unflatten

from .dim_chunks import chunks_to_full
from .flat_param import FlatParam
from .param_tags import tag_of
from .sharding_spec import is_dtensor


@torch.no_grad()
def gather_flat(unit, group: FlatParam, shard: torch.Tensor, full: torch.Tensor) -> None:
    """Collective over the unit's communicator: every rank's S-element ``shard`` into ``full``.

    ``shard`` is laid out like ``group.sharded_flat``; ``full`` is a W·S-element buffer of its dtype
    on the unit's device (the gathered layout: rank r's shard at r·S). This rank's shard is copied
    into its own slice of ``full`` and gathered in place, so nothing is allocated between the
    ranks' agreement and the collective.
    """
    S = group.layout.shard_size
    own = full[group.rank * S : (group.rank + 1) * S]
    own.copy_(shard)  # (a CPU-offloaded shard moves to the device)
    unit.comm.all_gather_into_tensor(full, own).wait()


@torch.no_grad()
def gathered_to_unsharded(group: FlatParam, gathered: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Copy-out of any W·S-element buffer in ``group``'s gathered layout (e.g. master weights
    all-gathered in their own dtype): a buffer in the unsharded layout (``out``, or new, of
    ``gathered``'s dtype and device; one ``unflatten`` launch, and torch ops for the ``Shard(k)``
    parameters, k != 0, as ``FlatParam.copy_out``)."""
    lay = group.layout
    if out is None:
        out = torch.empty(lay.unsharded_size, dtype=gathered.dtype, device=gathered.device)
    if lay.zero_copy:
        out.copy_(gathered[: lay.unsharded_size])
        return out
    targets = [out[lay.unsharded_offsets[s.param_index] + s.param_offset:][: s.numel] for s in lay.segments]
    if targets:
        unflatten(gathered, [s.gathered_offset for s in lay.segments], targets)
    views = group.unsharded_views(out) if lay.strided else []
    for i in lay.strided:
        chunks_to_full(gathered, lay, i, views[i])
    return out


@torch.no_grad()
def unsharded_to_local(group: FlatParam, unsharded: torch.Tensor, shard: torch.Tensor, positions=None) -> None:
    """Write this rank's rows of each parameter of ``group`` (``positions``: those only) from a
    buffer in the unsharded layout into a buffer in the shard layout (``summon_full_params``'
    write-back)."""
    lay = group.layout
    for i in range(len(group.shapes)) if positions is None else positions:
        full = unsharded[lay.unsharded_offsets[i]:][: lay.numels[i]].view(group.shapes[i])
        group.local_view(shard, i).copy_(group.chunk_of(full, i))


def sharded_value_of(value: Any, param: torch.Tensor, name: str) -> torch.Tensor:
    """``value`` as a tensor of the sharded parameter ``param``'s kind: a DTensor of its mesh and
    placements (this rank's rows of a full-shape tensor; another DTensor redistributed), or a
    plain full-shape tensor where ``param`` is plain (no mesh).

    Raises:
        TypeError: ``value`` is not a tensor.
        ValueError: a shape other than the parameter's full shape.
    """
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"'{name}' must be a tensor, got {type(value).__name__}")
    if value.shape != param.shape:
        raise ValueError(
            f"'{name}' has shape {tuple(value.shape)}, but the parameter's full shape is {tuple(param.shape)}: "
            f"pass the state dict of the same model"
        )
    if not is_dtensor(param):
        return value.full_tensor() if is_dtensor(value) else value
    if is_dtensor(value):
        if value.device_mesh == param.device_mesh and tuple(value.placements) == tuple(param.placements):
            return value
        return value.redistribute(param.device_mesh, param.placements)
    tag = tag_of(param)
    group = tag.group
    full = group.specs[tag.index].local_of_full(value.detach())  # (a tensor-parallel one: its TP-local part)
    local = group.chunk_of(full, tag.index).to(device=param.device).contiguous()
    return group.wrap_local(local, tag.index)


@torch.no_grad()
def subclass_full_values(group, positions: Iterable[int], target: torch.device) -> dict[int, torch.Tensor]:
    """Position -> full value on ``target`` of each tensor-subclass parameter of ``group`` (a
    ``FlatParam``) among ``positions``, full shape, the parameter's dtype and subclass.

    Collective over the parameter's device mesh: every rank calls it for the same groups, in the
    same order (also the ranks that keep nothing).

    Raises:
        RuntimeError: the subclass cannot be all-gathered by ``DTensor.full_tensor()``, naming the
            parameter (the same on every rank: the subclass's code is).
    """
    out = {}
    for pos in sorted(set(positions) & set(getattr(group, "subclass_positions", ()))):
        param = group.sharded_params[pos]
        try:
            full = param.full_tensor() if is_dtensor(param) else param  # W = 1: the parameter is full
        except Exception as exc:
            raise RuntimeError(
                f"full state dict: parameter '{group.fqns[pos]}' is a tensor subclass "
                f"({type(param.to_local()).__name__}) with fsdp_pre_all_gather / fsdp_post_all_gather, and "
                f"DTensor.full_tensor() of it failed ({type(exc).__name__}: {exc}); save it as a sharded state "
                f"dict (model.state_dict(), DCP) instead") from exc
        out[pos] = full.detach().to(target)
    return out
