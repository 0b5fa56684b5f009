"""Full state dicts of fully_shard'ed models: gathered to (or broadcast from) rank 0, unit by unit.

:func:`get_full_state_dict` / :func:`set_full_state_dict` give and take exactly the keys, order and
shapes of ``nn.Module.state_dict()`` of the unwrapped model, one unit at a time through the unit's
own communicator and one reused buffer, so that peak memory is one unit (see ``state_dict.py`` for
which state-dict calls to use when).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from flashfsdp.kernels import flatten, unflatten
from flashfsdp.runtime.flat_param import FlatParam, shards_written

from .agreement import error_payload, from_rank0, global_rank, raise_agreed
from .init_window import close_init_windows
from .sharded_tensor import ShardedPiece
from .state import FSDPState, TrainingState
from .state_dict import unit_param_keys


def _check_model(model: Any, where: str) -> list[tuple[str, FSDPState]]:
    """(path, state) of every fully_shard'ed unit of ``model``, outermost first (each unit once,
    at the path of its first module)."""
    close_init_windows()
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be an nn.Module, got {type(model).__name__}")
    states = []
    for path, m in model.named_modules():
        state = m.__dict__.get("_flashfsdp_state")
        if state is not None and all(state is not s for _, s in states):
            states.append((path, state))
    if not states:
        raise ValueError(
            f"{where}: model ({type(model).__name__}) has no fully_shard'ed module; call flashfsdp.fully_shard "
            f"on it first (a plain module's own state_dict()/load_state_dict() already give full tensors)"
        )
    for _, state in states:
        if state.training_state is not TrainingState.IDLE:
            raise RuntimeError(f"{where}: unit '{state.unit.name}' is in {state.training_state.value}; "
                               f"call it outside forward/backward")
    return states


def _owners(model: nn.Module) -> dict[str, tuple[FSDPState, int]]:
    """State-dict key -> (state, unit parameter index) for every unit parameter of the model (a
    grouped unit's parameters under each of its modules' paths)."""
    owners = {}
    for path, module in model.named_modules():
        state = module.__dict__.get("_flashfsdp_state")
        if state is None:
            continue
        prefix = f"{path}." if path else ""
        for rel, i in unit_param_keys(state, module):
            owners[prefix + rel] = (state, i)
    return owners


def _wanted_by_group(state: FSDPState, owners: dict, keys) -> dict[int, dict[int, list[str]]]:
    """id(group) -> {position in group: [keys]} for the keys that ``state``'s unit owns."""
    out: dict[int, dict[int, list[str]]] = {}
    for key in keys:
        owner = owners.get(key)
        if owner is None or owner[0] is not state:
            continue
        group, pos = state.unit.param_slots[owner[1]]
        out.setdefault(id(group), {}).setdefault(pos, []).append(key)
    return out


def _flat_buffers(states: list[tuple[str, FSDPState]]) -> Callable[[FlatParam, torch.device], torch.Tensor]:
    """A getter of a T-element buffer for a group, reusing one buffer per (dtype, device) for all units.

    The buffer is as large as the largest group, allocated at first use and freed with the getter:
    one allocation instead of one per unit keeps the peak at one unit without leaving the host
    allocator a trail of freed unit-sized blocks. Safe to reuse: the collectives and copies of one
    unit are issued on the current stream before the next unit's.
    """
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for _, state in states:
        for group in state.unit.groups:
            key = (group.dtype, state.unit.device)
            sizes[key] = max(sizes.get(key, 0), group.layout.total)
    buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def get(group: FlatParam, device: torch.device) -> torch.Tensor:
        key = (group.dtype, device)
        if key not in buffers:
            buffers[key] = torch.empty(sizes[key], dtype=group.dtype, device=device)
        return buffers[key][: group.layout.total]

    return get


@torch.no_grad()
def gather_group(unit, group: FlatParam, shard: torch.Tensor, positions: list[int], target: torch.device | None,
                 full: torch.Tensor | None = None) -> dict[int, torch.Tensor]:
    """The full values of parameters ``positions`` of ``group`` from every rank's ``shard``.

    Collective over the unit's communicator: each rank passes its S-element shard laid out like
    ``group.sharded_flat`` (the master weights, or per-element optimizer state placed at the pieces'
    offsets); one all-gather into ``full`` (a T-element buffer of ``shard``'s dtype, allocated if
    None). ``target``: where the results go (None: gather only, for ranks that keep nothing).

    Returns:
        position -> tensor of the parameter's full shape on ``target`` (own memory).
    """
    if full is None:
        full = torch.empty(group.layout.total, dtype=shard.dtype, device=unit.device)
    unit.comm.all_gather_into_tensor(full, shard.to(full.device)).wait()  # (a CPU-offloaded shard moves)
    if target is None:
        return {}
    outs = [torch.empty(group.shapes[pos], dtype=shard.dtype, device=target) for pos in positions]
    offsets = [group.layout.offsets[pos] for pos in positions]
    if target == full.device:
        unflatten(full, offsets, outs)
    else:
        for out, pos, off in zip(outs, positions, offsets):
            out.copy_(full[off : off + group.layout.numels[pos]].view(group.shapes[pos]))
    return dict(zip(positions, outs))


@torch.no_grad()
def get_full_state_dict(model: nn.Module, cpu_offload: bool = True, rank0_only: bool = True) -> dict[str, Any]:
    """The unsharded state dict of a fully_shard'ed model: what the unwrapped model's ``state_dict()`` gives.

    Collective: every rank of every unit calls it. Unit by unit, each flat group's ``sharded_flat``
    is all-gathered into one T-element buffer in the parameters' original dtype (not
    ``param_dtype``), the parameters are cut out of it (``unflatten``, or views copied to the CPU),
    and the next unit reuses the buffer, so the extra memory on the device is one (the largest) unit.

    Args:
        model: a module with at least one fully_shard'ed submodule (or itself fully_shard'ed).
        cpu_offload: put the tensors on the CPU (True) or leave them on the parameters' device.
        rank0_only: only rank 0 of the default group keeps tensors; the other ranks return {}.

    Returns:
        ``{key: tensor}`` with exactly the keys, order, shapes and dtypes of ``nn.Module.state_dict()``
        of the same model unwrapped: both names of a tied parameter (one tensor), persistent buffers.

    Raises:
        TypeError: ``model`` is not a module, or a flag is not a bool.
        ValueError: ``model`` has no fully_shard'ed module.
        RuntimeError: called during forward/backward.
    """
    states = _check_model(model, "get_full_state_dict")
    for name, flag in (("cpu_offload", cpu_offload), ("rank0_only", rank0_only)):
        if not isinstance(flag, bool):
            raise TypeError(f"get_full_state_dict: {name} must be a bool, got {flag!r}")
    keep = not rank0_only or global_rank() == 0
    template = model.state_dict()
    owners = _owners(model)
    gathered: dict[str, torch.Tensor] = {}
    flat_buffer = _flat_buffers(states)
    for _, state in states:
        unit = state.unit
        wanted = _wanted_by_group(state, owners, template.keys())
        for group in unit.groups:
            positions = wanted.get(id(group))
            if not positions:
                continue
            target = torch.device("cpu") if cpu_offload else unit.device
            outs = gather_group(unit, group, group.sharded_flat, sorted(positions), target if keep else None,
                                flat_buffer(group, unit.device))
            for pos, out in outs.items():
                for key in positions[pos]:
                    gathered[key] = out
    del flat_buffer
    if not keep:
        return {}
    result: dict[str, Any] = {}
    for key, value in template.items():
        if key in gathered:
            result[key] = gathered[key]
        elif isinstance(value, ShardedPiece):
            raise RuntimeError(f"get_full_state_dict: '{key}' is sharded but belongs to no unit of the model")
        elif isinstance(value, torch.Tensor):
            result[key] = value.detach().to("cpu") if cpu_offload else value.detach()
        else:
            result[key] = value
    return result


def _validate_full_state_dict(state_dict: Any, template: Mapping[str, Any], strict: bool) -> list[str]:
    """The template keys ``state_dict`` provides; raises on a missing/unexpected key or a bad value."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"set_full_state_dict: state_dict must be a mapping of names to tensors on rank 0, "
                        f"got {type(state_dict).__name__}")
    present = []
    for key, expected in template.items():
        if not isinstance(expected, torch.Tensor):
            raise NotImplementedError(
                f"set_full_state_dict: '{key}' is module extra state ({type(expected).__name__}), which is not "
                f"broadcast; load it with model.load_state_dict(state_dict, strict=False) on every rank"
            )
        if key not in state_dict:
            if strict:
                raise ValueError(
                    f"set_full_state_dict: state_dict has no entry for '{key}' (shape {tuple(expected.shape)}); "
                    f"pass the full state dict of the same model (nn.Module.state_dict() of the unwrapped model), "
                    f"or strict=False to keep the current value"
                )
            continue
        value = state_dict[key]
        if not isinstance(value, torch.Tensor) or isinstance(value, ShardedPiece):
            raise TypeError(f"set_full_state_dict: '{key}' must be a full (unsharded) tensor, got "
                            f"{type(value).__name__}; use flashfsdp.get_full_state_dict or the unwrapped model's state_dict()")
        if value.shape != expected.shape:
            raise ValueError(f"set_full_state_dict: '{key}' has shape {tuple(value.shape)} in state_dict but "
                             f"{tuple(expected.shape)} in the model; load a state dict of the same model")
        if value.is_meta:
            raise ValueError(f"set_full_state_dict: '{key}' is on the meta device (it has no values)")
        present.append(key)
    if strict:
        unexpected = [k for k in state_dict if k not in template]
        if unexpected:
            raise ValueError(f"set_full_state_dict: state_dict has unexpected key(s) {unexpected[:5]}"
                             f"{' ...' if len(unexpected) > 5 else ''} that the model does not have; "
                             f"remove them or pass strict=False")
    return present


@torch.no_grad()
def _agreed_keys(state_dict, template: Mapping[str, Any], strict: bool) -> list[str]:
    """The keys rank 0's ``state_dict`` provides, checked on rank 0 and agreed by every rank (an
    error on rank 0 is raised on every rank, so none is left waiting in a broadcast)."""
    verdict: Any = None
    if global_rank() == 0:
        try:
            verdict = ("ok", _validate_full_state_dict(state_dict, template, strict))
        except (TypeError, ValueError, NotImplementedError) as exc:
            verdict = ("error", error_payload(exc))
    verdict = from_rank0(verdict)
    if verdict[0] == "error":
        raise_agreed([verdict[1]])
    return verdict[1]


@torch.no_grad()
def _broadcast_into_units(states, owners: dict, present: list[str], state_dict) -> None:
    """Unit by unit: rank 0 packs a group's parameters into one T-element buffer, the unit's
    communicator broadcasts it, every rank copies its elements into its shard."""
    is_root = global_rank() == 0
    flat_buffer = _flat_buffers(states)
    for _, state in states:
        unit = state.unit
        if (unit.comm.rank == 0) != is_root:
            raise NotImplementedError(f"set_full_state_dict: unit '{unit.name}' broadcasts from its group's rank 0, "
                                      f"which is not rank 0 of the default group")
        wanted = _wanted_by_group(state, owners, present)
        for group in unit.groups:
            positions = wanted.get(id(group))
            if not positions:
                continue
            flat = flat_buffer(group, unit.device)
            if is_root:
                sources = [None] * len(group.shapes)
                for pos, keys in positions.items():
                    sources[pos] = state_dict[keys[0]].detach().reshape(-1).to(unit.device)
                flatten(sources, list(group.layout.offsets), flat, numels=list(group.layout.numels))
            unit.comm.broadcast(flat, 0).wait()
            for pos in positions:
                pc = group.pieces[pos]
                group.sharded_flat[pc.shard_start : pc.shard_end].copy_(flat[pc.flat_start : pc.flat_end])


def set_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None, *,
                        strict: bool = True) -> None:
    """Load a plain (unsharded) state dict into a fully_shard'ed model, from rank 0.

    Collective. Rank 0's ``state_dict`` is the source (other ranks may pass None, or the same dict:
    theirs is not read). Rank 0 checks it first (every rank raises its error, so none hangs), then
    unit by unit rank 0 packs the group's parameters into one T-element buffer in the original dtype
    (``flatten``: cast, gaps zeroed), the unit's communicator broadcasts it, and each rank copies its
    elements into the sharded master storage in place; the next unit reuses the buffer.
    Buffers and parameters outside units are broadcast the same way and copied in place.

    Args:
        model: a module with at least one fully_shard'ed submodule.
        state_dict: on rank 0, ``{key: tensor}`` as the unwrapped model's ``state_dict()`` gives
            (full shapes, any floating dtype, any device); of a tied parameter the first name is read.
        strict: require exactly the model's keys (True), or load what is there and keep the rest.

    Raises:
        TypeError: ``model`` is not a module, ``state_dict`` is not a mapping on rank 0 or holds a
            non-tensor / sharded value.
        ValueError: no fully_shard'ed module; a missing or unexpected key (strict), a wrong shape —
            each message names the key.
        NotImplementedError: the model has extra state (``get_extra_state``), which is not broadcast.
    """
    states = _check_model(model, "set_full_state_dict")
    if not isinstance(strict, bool):
        raise TypeError(f"set_full_state_dict: strict must be a bool, got {strict!r}")
    template = model.state_dict()
    owners = _owners(model)
    present = _agreed_keys(state_dict, template, strict)
    shards_written()  # unsharded copies kept meanwhile are stale after this
    _broadcast_into_units(states, owners, present, state_dict)
    comm = states[0][1].unit.comm
    for key in present:
        if key in owners:
            continue
        target = template[key]
        buf = state_dict[key].detach().to(target.device, target.dtype) if global_rank() == 0 else torch.empty_like(target)
        comm.broadcast(buf, 0).wait()
        target.copy_(buf)