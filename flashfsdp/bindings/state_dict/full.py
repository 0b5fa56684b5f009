"""Full state dicts of fully_shard'ed models: gathered to (or broadcast from) rank 0, unit by unit.

:func:`get_full_state_dict` / :func:`set_full_state_dict` give and take exactly the keys, order and
shapes of ``nn.Module.state_dict()`` of the unwrapped model, one unit at a time through the unit's
own communicator and one reused buffer, so that peak memory is one unit (see the package's
docstring for which state-dict calls to use when).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch
import torch.nn as nn

from flashfsdp.kernels import flatten, unflatten
from flashfsdp.runtime.agreement import agree, agree_from_rank0, agree_in_group, global_rank
from flashfsdp.runtime.comm_factory import communicator_in_use, default_group
from flashfsdp.runtime.dim_chunks import chunks_to_full, full_to_chunks
from flashfsdp.runtime.extensions import refuse_subclass_params
from flashfsdp.runtime.flat_param import FlatParam, shards_written
from flashfsdp.runtime.full_values import gather_flat, subclass_full_values
from flashfsdp.runtime.init_window import close_init_windows
from flashfsdp.runtime.sharding_spec import is_dtensor
from flashfsdp.runtime.tensor_parallel import TensorParallelSpec

from ..state import FSDPState, TrainingState
from ..concurrency import refuse_reader_thread
from ..structure import check_same_structure


def units_of(model: Any, where: str) -> list[tuple[str, FSDPState]]:
    """(path, state) of every fully_shard'ed unit of ``model``, outermost first (each unit once,
    at the path of its first module).

    Raises (the message starting with ``where``):
        TypeError: ``model`` is not a module.
        ValueError: it has no fully_shard'ed module.
        RuntimeError: a unit is inside forward/backward.
        NotImplementedError: a unit holds a tensor-parallel parameter (named).
    """
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
        _refuse_tensor_parallel(state, where)
    return states


def _refuse_tensor_parallel(state: FSDPState, where: str) -> None:
    """The full values here are gathered over each unit's data-parallel ranks only."""
    for group in state.unit.groups:
        for pos, param in enumerate(group.sharded_params):
            if isinstance(group.specs[pos], TensorParallelSpec):
                raise NotImplementedError(
                    f"{where}: parameter '{group.fqns[pos]}' is tensor-parallel (placements {tuple(param.placements)}), "
                    f"which this gathers over the data-parallel ranks only; use torch.distributed.checkpoint."
                    f"state_dict.get_model_state_dict / set_model_state_dict (full_state_dict=True) or DCP instead")


def param_owners(model: nn.Module) -> dict[str, tuple[FSDPState, int]]:
    """State-dict key -> (state, unit parameter index) for every unit parameter of the model.

    Found by identity: ``state_dict(keep_vars=True)`` holds the sharded parameters themselves,
    whatever the keys became on the way (``checkpoint_wrapper`` strips its
    ``_checkpoint_wrapped_module.`` prefix in a state-dict hook, for one)."""
    by_id = {}
    for module in model.modules():
        state = module.__dict__.get("_flashfsdp_state")
        if state is not None:
            for i in range(len(state.registrations)):
                by_id[id(state.unit.sharded_param(i))] = (state, i)
    return {key: by_id[id(value)] for key, value in model.state_dict(keep_vars=True).items() if id(value) in by_id}


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
    """A getter of a W·S-element (gathered-layout) buffer for a group, reusing one buffer per (dtype, device) for all units.

    The buffer is as large as the largest group, allocated here (so that an allocation failure
    comes before the ranks agree, not between two collectives) and freed with the getter: one
    allocation instead of one per unit keeps the peak at one unit without leaving the host
    allocator a trail of freed unit-sized blocks. Safe to reuse: the collectives and copies of one
    unit are issued on the current stream before the next unit's.
    """
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    for _, state in states:
        for group in state.unit.groups:
            key = (group.dtype, state.unit.device)
            sizes[key] = max(sizes.get(key, 0), group.layout.gathered_size)
    buffers = {key: torch.empty(n, dtype=key[0], device=key[1]) for key, n in sizes.items()}

    def get(group: FlatParam, device: torch.device) -> torch.Tensor:
        return buffers[(group.dtype, device)][: group.layout.gathered_size]

    return get


@torch.no_grad()
def cut_params(group: FlatParam, full: torch.Tensor, positions: list[int], target: torch.device) -> dict[int, torch.Tensor]:
    """Parameters ``positions`` of ``group`` out of a gathered W·S-element ``full`` (local, no
    collective): each parameter's W chunks moved into one tensor of its full shape (``unflatten``).

    Returns:
        position -> tensor of the parameter's full shape and ``full``'s dtype on ``target`` (own memory).
    """
    outs = {pos: torch.empty(group.shapes[pos], dtype=full.dtype, device=full.device) for pos in positions}
    segments = [s for s in group.layout.segments if s.param_index in outs]
    if segments:
        unflatten(full, [s.gathered_offset for s in segments],
                  [outs[s.param_index].view(-1)[s.param_offset : s.param_offset + s.numel] for s in segments])
    for pos in (i for i in group.layout.strided if i in outs):  # Shard(k), k != 0: along k, torch ops
        chunks_to_full(full, group.layout, pos, outs[pos])
    return {pos: out if out.device == target else out.to(target) for pos, out in outs.items()}


@torch.no_grad()
def full_unit_params(state: FSDPState, target: torch.device, keep: bool = True) -> dict[int, torch.Tensor]:
    """Unit parameter index -> its full value on ``target`` (collective over the unit's ranks).

    With ``keep=False`` this rank takes part in the all-gathers but cuts nothing out and returns
    {} (the ranks that do not write a file in ``hf_save.py``). No rank is left waiting: the units'
    structure is checked (once), the buffer is allocated and the ranks agree (one 1-element
    all-reduce) before the all-gathers; a failure while cutting out the values (e.g. out of host
    memory) lets the rank finish the unit's all-gathers, and the ranks agree again at the end of
    the unit (raised on every rank).
    """
    unit = state.unit
    check_same_structure([state])
    by_group: dict[int, dict[int, int]] = {}
    for i, (group, pos) in enumerate(unit.param_slots):
        by_group.setdefault(id(group), {})[pos] = i
    flat_buffer, error = None, None
    try:
        flat_buffer = _flat_buffers([("", state)])
    except Exception as exc:  # noqa: BLE001 - agreed below
        error = exc
    agree_in_group(unit.comm, error, unit.device)
    out: dict[int, torch.Tensor] = {}
    for group in unit.groups:
        positions = by_group.get(id(group), {})
        full = flat_buffer(group, unit.device)
        gather_flat(unit, group, group.sharded_flat, full)
        if keep and error is None:
            try:
                for pos, tensor in cut_params(group, full, sorted(positions), target).items():
                    out[positions[pos]] = tensor
            except Exception as exc:  # noqa: BLE001 - the other ranks are still gathering
                error, out = exc, {}
        for pos, tensor in subclass_full_values(group, positions, target).items():  # collective
            if keep and error is None:
                out[positions[pos]] = tensor
    agree_in_group(unit.comm, error, unit.device)
    return out


@torch.no_grad()
def get_full_state_dict(model: nn.Module, cpu_offload: bool = True, rank0_only: bool = True) -> dict[str, Any]:
    """The unsharded state dict of a fully_shard'ed model: what the unwrapped model's ``state_dict()`` gives.

    Collective: every rank of every unit calls it. Unit by unit, each flat group's ``sharded_flat``
    is all-gathered into one W·S-element buffer in the parameters' original dtype (not
    ``param_dtype``), the parameters are cut out of it (``unflatten``, then copied to the CPU),
    and the next unit reuses the buffer, so the extra memory on the device is one (the largest) unit.
    A tensor-subclass parameter with FSDP2's all-gather extensions (kept outside the flat shard)
    gives ``DTensor.full_tensor()`` of it, a full tensor of its subclass (``full_values.py``).

    No rank is left waiting: the arguments and the model are checked on every rank and the ranks
    agree before the first all-gather (an error on one rank is raised on every rank, naming it);
    a failure while a rank keeps its copies (e.g. out of host memory on rank 0) lets that rank
    finish the remaining all-gathers without keeping anything, then is raised on every rank.

    Args:
        model: a module with at least one fully_shard'ed submodule (or itself fully_shard'ed).
        cpu_offload: put the tensors on the CPU (True) or leave them on the parameters' device.
        rank0_only: only rank 0 of the default group keeps tensors; the other ranks return {}.

    Returns:
        ``{key: tensor}`` with exactly the keys, order, shapes and dtypes of ``nn.Module.state_dict()``
        of the same model unwrapped: both names of a tied parameter (one tensor), persistent buffers.

    Raises:
        TypeError: ``model`` is not a module, or a flag is not a bool.
        ValueError: ``model`` has no fully_shard'ed module; the units differ across ranks.
        RuntimeError: called during forward/backward; a sharded entry that belongs to no unit;
            called from a thread other than the training thread (refused there, before any collective).
        Any error of one rank, on every rank (the rank named in the message).
    """
    refuse_reader_thread(model)  # (a thread's request: refused before any collective)
    plan, error = None, None
    try:
        plan = _plan_get(model, cpu_offload, rank0_only)
    except Exception as exc:  # noqa: BLE001 - agreed below: raised on every rank
        error = exc
    agree(error)
    states, template, owners, flat_buffer = plan
    check_same_structure([state for _, state in states])
    keep = not rank0_only or global_rank() == 0
    gathered: dict[str, torch.Tensor] = {}
    for _, state in states:
        target = torch.device("cpu") if cpu_offload else state.unit.device
        wanted = _wanted_by_group(state, owners, template.keys())
        error = _gather_unit(state.unit, wanted, target, flat_buffer, keep and error is None, gathered) or error
    del flat_buffer
    agree(error)
    if not keep:
        return {}
    return {key: gathered[key] if key in gathered else _plain_value(value, cpu_offload)
            for key, value in template.items()}


def _gather_unit(unit, wanted: dict, target: torch.device, flat_buffer, keep: bool,
                 gathered: dict[str, torch.Tensor]) -> BaseException | None:
    """:func:`get_full_state_dict` of one unit (collective): each wanted group all-gathered and, if
    ``keep``, its parameters cut out into ``gathered`` under their keys (tensor subclasses with
    all-gather extensions: ``full_tensor()``). A failure while cutting empties ``gathered`` and is
    returned after the unit's collectives (the other ranks are still gathering)."""
    error = None
    for group in unit.groups:
        positions = wanted.get(id(group))
        if not positions:
            continue
        full = flat_buffer(group, unit.device)
        gather_flat(unit, group, group.sharded_flat, full)
        if keep and error is None:
            try:
                for pos, out in cut_params(group, full, sorted(positions), target).items():
                    gathered.update(dict.fromkeys(positions[pos], out))
            except Exception as exc:  # noqa: BLE001 - the other ranks are still gathering
                error = exc
                gathered.clear()
        for pos, out in subclass_full_values(group, positions, target).items():  # collective
            if keep and error is None:
                gathered.update(dict.fromkeys(positions[pos], out))
    return error


def _plan_get(model: Any, cpu_offload: Any, rank0_only: Any) -> tuple:
    """The local checks and preparation of :func:`get_full_state_dict` (every rank, before agreeing):
    ``(states, template, owners, flat buffer getter)``."""
    states = units_of(model, "get_full_state_dict")
    for name, flag in (("cpu_offload", cpu_offload), ("rank0_only", rank0_only)):
        if not isinstance(flag, bool):
            raise TypeError(f"get_full_state_dict: {name} must be a bool, got {flag!r}")
    template = model.state_dict()
    owners = param_owners(model)
    for key, value in template.items():
        if is_dtensor(value) and key not in owners:
            raise RuntimeError(f"get_full_state_dict: '{key}' is a DTensor but belongs to no unit of the model "
                               f"(tensor parallelism?); gather it with value.full_tensor()")
    return states, template, owners, _flat_buffers(states)


def _plain_value(value: Any, cpu_offload: bool) -> Any:
    """A state-dict entry outside the units (a buffer, an ignored parameter, extra state) as it is."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu") if cpu_offload else value.detach()
    return value


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
        if not isinstance(value, torch.Tensor) or is_dtensor(value):
            raise TypeError(f"set_full_state_dict: '{key}' must be a full (unsharded) tensor, got "
                            f"{type(value).__name__}; use flashfsdp.get_full_state_dict or the unwrapped model's state_dict()")
        if value.shape != expected.shape:
            raise ValueError(f"set_full_state_dict: '{key}' has shape {tuple(value.shape)} in state_dict but "
                             f"{tuple(expected.shape)} in the model; load a state dict of the same model")
        if value.is_meta:
            raise ValueError(f"set_full_state_dict: '{key}' is on the meta device (it has no values)")
        _check_dtype_kind(key, value, expected)
        present.append(key)
    if strict:
        unexpected = [k for k in state_dict if k not in template]
        if unexpected:
            raise ValueError(f"set_full_state_dict: state_dict has unexpected key(s) {unexpected[:5]}"
                             f"{' ...' if len(unexpected) > 5 else ''} that the model does not have; "
                             f"remove them or pass strict=False")
    return present


def _check_dtype_kind(key: str, value: torch.Tensor, expected: torch.Tensor) -> None:
    """A floating value for a floating entry (any floating dtype: cast to the entry's), an integer
    or bool value for an integer or bool entry (cast too); anything else is refused."""
    def kind(dtype: torch.dtype) -> str:
        return "complex" if dtype.is_complex else "floating" if dtype.is_floating_point else "integer/bool"

    if kind(value.dtype) != kind(expected.dtype):
        raise TypeError(
            f"set_full_state_dict: '{key}' has dtype {value.dtype} in state_dict but {expected.dtype} in the model; "
            f"{kind(value.dtype)} values are not cast to {kind(expected.dtype)} ones (any floating dtype loads "
            f"into a floating parameter): pass the state dict of the same model, or convert that entry first"
        )


def loading_failed(exc: BaseException, where: str) -> RuntimeError:
    """The error to agree on when loading failed after the ranks agreed (chained to ``exc``)."""
    error = RuntimeError(f"set_full_state_dict: {type(exc).__name__}: {exc} (loading {where}); the model is "
                         f"partly loaded now: remove the cause and load again")
    error.__cause__ = exc
    return error


@torch.no_grad()
def _broadcast_into_units(states, owners: dict, present: list[str], state_dict, flat_buffer) -> BaseException | None:
    """Unit by unit: rank 0 packs a group's parameters into one W·S-element buffer in the gathered
    layout (cast to the group's dtype), the default group broadcasts it, every rank copies its
    chunks into its shard. A failure on a rank does not stop it: it keeps issuing every broadcast (rank 0 sends
    zeros for a group it could not pack) and returns its first error, for the ranks to agree on."""
    is_root, error = global_rank() == 0, None
    for _, state in states:
        unit = state.unit
        wanted = _wanted_by_group(state, owners, present)
        for group in unit.groups:
            positions = wanted.get(id(group))
            if not positions:
                continue
            flat = flat_buffer(group, unit.device)
            if is_root:
                try:
                    _pack(group, positions, state_dict, flat, unit.device)
                except Exception as exc:  # noqa: BLE001 - agreed by the caller
                    error = error or loading_failed(exc, f"unit '{unit.name}'")
                    flat.zero_()
            _world(unit.device).broadcast(flat, 0).wait()
            try:
                mine = flat[group.rank * group.layout.shard_size :][: group.layout.shard_size]
                for pos in positions:
                    group.local_view(group.sharded_flat, pos).copy_(group.local_view(mine, pos))
            except Exception as exc:  # noqa: BLE001 - agreed by the caller
                error = error or loading_failed(exc, f"unit '{unit.name}'")
    return error


def _pack(group: FlatParam, positions: dict[int, list[str]], state_dict, flat: torch.Tensor, device) -> None:
    """Rank 0: the group's parameters from ``state_dict`` into ``flat`` in the gathered layout (each
    parameter's chunk r in rank r's shard; gaps zeroed), in the group's dtype."""
    sources = [None] * len(group.shapes)
    for pos, keys in positions.items():
        sources[pos] = state_dict[keys[0]].detach().reshape(-1).to(device=device, dtype=group.dtype)
    segments = group.layout.segments
    flatten([None if sources[s.param_index] is None else sources[s.param_index][s.param_offset :][: s.numel]
             for s in segments], [s.gathered_offset for s in segments], flat, numels=[s.numel for s in segments])
    for pos in group.layout.strided:  # Shard(k), k != 0: along k, torch ops
        if sources[pos] is not None:
            full_to_chunks(sources[pos], group.layout, pos, flat)


def _world(device: torch.device):
    """The communicator over the default group on ``device``: rank 0 of the default group is the
    source, and every rank needs the values — with a 2-D (HSDP) mesh a unit's own group holds only
    its replica's ranks, and its rank 0 is not rank 0 everywhere."""
    return communicator_in_use(default_group(), device)


@torch.no_grad()
def _broadcast_plain(comm, template: Mapping[str, Any], keys: list[str], state_dict) -> BaseException | None:
    """Buffers and parameters outside units, broadcast from rank 0 one by one and copied in place
    (cast to each entry's dtype); failures as in :func:`_broadcast_into_units`."""
    error = None
    for key in keys:
        target = template[key]
        buf = torch.zeros_like(target)
        if global_rank() == 0:
            try:
                buf.copy_(state_dict[key].detach())
            except Exception as exc:  # noqa: BLE001 - agreed by the caller
                error, buf = error or loading_failed(exc, f"'{key}'"), buf.zero_()
        comm.broadcast(buf, 0).wait()
        target.copy_(buf)
    return error


def set_full_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor] | None, *,
                        strict: bool = True) -> None:
    """Load a plain (unsharded) state dict into a fully_shard'ed model, from rank 0.

    Collective. Rank 0's ``state_dict`` is the source (other ranks may pass None, or the same dict:
    theirs is not read). Every rank checks the model and arguments and rank 0 checks the dict, and
    the ranks agree before any broadcast: an error on any rank is raised on every rank (naming the
    rank), so none is left waiting. Then unit by unit rank 0 packs the group's parameters into one
    W·S-element buffer (the gathered layout) in the parameters' original dtype (a value of another floating dtype, e.g. of
    ``model.double().state_dict()``, is cast; ``flatten``: gaps zeroed), the default group's
    communicator broadcasts it, and each rank copies its elements into the sharded master storage in place; the
    next unit reuses the buffer. Buffers and parameters outside units are broadcast the same way
    and copied in place. A failure during the broadcasts (e.g. out of memory on rank 0) is raised on
    every rank after the last broadcast; the model is then partly loaded: load again.

    Args:
        model: a module with at least one fully_shard'ed submodule.
        state_dict: on rank 0, ``{key: tensor}`` as the unwrapped model's ``state_dict()`` gives
            (full shapes, any device; any floating dtype for a floating entry, any integer/bool
            dtype for an integer/bool buffer: cast); of a tied parameter the first name is read.
        strict: require exactly the model's keys (True), or load what is there and keep the rest.

    Raises:
        TypeError: ``model`` is not a module, ``state_dict`` is not a mapping on rank 0 or holds a
            non-tensor / sharded value, or a value of another kind than its entry (an integer
            tensor for a floating parameter: refused rather than silently made a float).
        ValueError: no fully_shard'ed module; a missing or unexpected key (strict), a wrong shape —
            each message names the key; the units differ across ranks.
        NotImplementedError: the model has extra state (``get_extra_state``), which is not broadcast;
            a tensor-subclass parameter with FSDP2's all-gather extensions (its values are not the
            flat shard's this broadcasts into: load a sharded state dict).
        RuntimeError: called from a thread other than the training thread (refused there, before
            any collective).
        Any error of one rank, on every rank (the rank named in the message).
    """
    refuse_reader_thread(model)  # (a thread's request: refused before any collective)
    plan, present, error = None, None, None
    try:
        plan = _plan_set(model, strict)
        if global_rank() == 0:
            present = _validate_full_state_dict(state_dict, plan[1], strict)
    except Exception as exc:  # noqa: BLE001 - agreed below: raised on every rank
        error = exc
    present = agree_from_rank0(error, present)
    states, template, owners, flat_buffer = plan
    check_same_structure([state for _, state in states])
    shards_written()  # unsharded copies kept meanwhile are stale after this
    error = _broadcast_into_units(states, owners, present, state_dict, flat_buffer)
    del flat_buffer
    plain = [key for key in present if key not in owners]
    error = _broadcast_plain(_world(states[0][1].unit.device), template, plain, state_dict) or error
    agree(error)


def _plan_set(model: Any, strict: Any) -> tuple:
    """The local checks and preparation of :func:`set_full_state_dict` (every rank, before agreeing):
    ``(states, template, owners, flat buffer getter)``."""
    states = units_of(model, "set_full_state_dict")
    if not isinstance(strict, bool):
        raise TypeError(f"set_full_state_dict: strict must be a bool, got {strict!r}")
    refuse_subclass_params([g for _, state in states for g in state.unit.groups], "set_full_state_dict",
                           "load a sharded state dict instead (model.load_state_dict of DTensors, or DCP)")
    return states, model.state_dict(), param_owners(model), _flat_buffers(states)
