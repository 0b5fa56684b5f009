"""Sharded and full state dicts of fully_shard'ed modules; torch.distributed.checkpoint integration.

Which calls to use (every one collective unless said otherwise)
----------------------------------------------------------------
============================================  =====================================================
sharded checkpoint, model + optimizer          ``flashfsdp.checkpoint.save`` / ``load`` (atomic), or
(reshardable to any world size)                ``dcp.save`` / ``dcp.load`` of ``model.state_dict()``
                                               and :func:`get_optimizer_state_dict`, then
                                               ``model.load_state_dict`` and
                                               :func:`set_optimizer_state_dict`; the stock
                                               ``torch.distributed.checkpoint.state_dict``
                                               ``get_state_dict`` / ``set_state_dict`` (and the
                                               model/optimizer variants) with the default
                                               options work too
full model state dict (plain tensors)          :func:`get_full_state_dict` / :func:`set_full_state_dict`
full state dict *into* a flashfsdp model       also ``set_model_state_dict`` /
                                               ``set_optimizer_state_dict`` with
                                               ``StateDictOptions(full_state_dict=True)``
                                               (``broadcast_from_rank0`` too), or
                                               ``model.load_state_dict(full_sd)`` on every rank
============================================  =====================================================

Not supported: ``StateDictOptions(full_state_dict=True)`` in the *getters* of
``torch.distributed.checkpoint.state_dict`` (``get_state_dict``, ``get_model_state_dict``,
``get_optimizer_state_dict``). DSD gathers only DTensor and ShardedTensor values; a flashfsdp piece
is neither (its range of the flattened parameter is not a DTensor placement), so DSD would hand
back this rank's pieces as if they were full tensors. flashfsdp sees the call (the state-dict hooks
below look for DSD's full-state-dict getter on the call stack) and raises ``NotImplementedError``
pointing here instead. A full optimizer state dict: save it sharded and convert the checkpoint
offline with ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save``.

Sharded (the default, what ``module.state_dict()`` returns): every parameter of a unit appears under
its original fully-qualified name as a :class:`~flashfsdp.bindings.sharded_tensor.ShardedPiece`,
the parameter's full shape around this rank's 1-D piece, which ``torch.distributed.checkpoint``
(DCP) saves without gathering and loads back at any world size (the piece is described to DCP as
rectangular boxes of the N-D tensor, see [Note: the range as N-D boxes] in ``sharded_tensor.py``).
Buffers and parameters outside any unit stay plain tensors (replicated; DCP writes them once).
``module.load_state_dict`` takes what DCP loaded (the same ShardedPieces) or plain full-shape
tensors and writes this rank's elements into the sharded master storage in place. Both go through
the state-dict hooks that :func:`install_state_dict_hooks` registers on every fully_shard'ed module,
so ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` / ``set_model_state_dict`` work
unchanged (they call ``state_dict`` / ``load_state_dict``). The keys are the module hierarchy's
(``nn.Module.state_dict``'s), never a name stored on a parameter.

Optimizer state ([Note: optimizer state-dict hooks]): an optimizer's state of a sharded parameter
(``exp_avg``, ``momentum_buffer``, ...) is a 1-D tensor shaped like this rank's piece, which DCP
would take for a replicated tensor (and keep one rank's, silently losing the others'). So every
optimizer over flashfsdp parameters gets two hooks of its own: ``optimizer.state_dict()`` returns
each per-element state tensor as a ShardedPiece of the parameter's full shape (what DCP saves and
reshards like the parameter), and ``optimizer.load_state_dict`` turns ShardedPieces (what
``dcp.load`` filled) and full-shape tensors (a full optimizer state dict) back into this rank's
piece. The hooks are installed on an optimizer the first time it steps (a global optimizer
step-pre-hook, registered by the first ``fully_shard``; DSD's getters and setters step a fresh
optimizer once with lr 0 to create its state, which installs them) and by
:func:`get_optimizer_state_dict` / :func:`set_optimizer_state_dict`. Scalars (``step``) and
``param_groups`` stay as they are (replicated). DSD keys the state by parameter name (it maps the
pieces through ``model.named_parameters()``).

Full state dicts (:func:`get_full_state_dict` / :func:`set_full_state_dict`): exactly the keys,
order and shapes of ``nn.Module.state_dict()`` of the unwrapped model, gathered (or broadcast from
rank 0) one unit at a time through the unit's own communicator, so that peak memory is one unit.
"""

from __future__ import annotations

import builtins
import functools
import inspect
import sys
import weakref
from itertools import chain
from typing import Any, Callable, Mapping

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from flashfsdp.kernels import flatten, unflatten
from flashfsdp.runtime.flat_param import FlatParam

from .sharded_tensor import ShardedPiece
from .state import FSDPState, TrainingState


# ---------------------------------------------------------------------------- hooks
def install_state_dict_hooks(module: nn.Module, state: FSDPState) -> None:
    """Make ``module.state_dict()`` / ``module.load_state_dict()`` sharded-aware (called by fully_shard).

    Each hook handles only the parameters of ``state``'s unit; nested fully_shard'ed modules run
    their own hooks, as ``nn.Module.state_dict`` visits every submodule. The first call also
    registers the global optimizer step-pre-hook that gives optimizers over flashfsdp parameters
    their state-dict hooks (see [Note: optimizer state-dict hooks]).
    """
    module.register_state_dict_post_hook(functools.partial(_post_state_dict, state))
    module.register_load_state_dict_pre_hook(functools.partial(_pre_load_state_dict, state))
    _register_optimizer_step_hook()


_DSD_MODULE = "torch.distributed.checkpoint.state_dict"


def _dsd_full_state_dict_getter() -> str | None:
    """The DSD getter gathering a full state dict that called us (from the call stack), or None.

    DSD's ``_get_model_state_dict`` / ``_get_optim_state_dict`` take their options as ``info``;
    when ``info.full_state_dict`` is set they gather DTensors and ShardedTensors only. Nothing is
    on the stack unless DSD has been imported. Should torch rename these internals, the check finds
    nothing and the call is silent again (``tests/bindings/test_state_dict.py`` would fail).
    """
    dsd = sys.modules.get(_DSD_MODULE)
    if dsd is None:
        return None
    getters = {}
    for name in ("_get_model_state_dict", "_get_optim_state_dict"):
        fn = getattr(dsd, name, None)
        if fn is not None:
            getters[inspect.unwrap(fn).__code__] = name
    frame = sys._getframe(1)
    while frame is not None:
        name = getters.get(frame.f_code)
        if name is not None:
            info = frame.f_locals.get("info")
            return name if getattr(info, "full_state_dict", False) is True else None
        frame = frame.f_back
    return None


def _refuse_dsd_full_state_dict(what: str) -> None:
    """Raise if DSD is gathering a full state dict of ``what`` (it would return pieces as full tensors)."""
    getter = _dsd_full_state_dict_getter()
    if getter is None:
        return
    raise NotImplementedError(
        f"torch.distributed.checkpoint.state_dict cannot gather a full state dict "
        f"(StateDictOptions(full_state_dict=True)) of {what}: it gathers only DTensor/ShardedTensor values and "
        f"would return this rank's pieces as if they were full tensors. For the model's full state dict call "
        f"flashfsdp.get_full_state_dict(model); for the optimizer, save it sharded (flashfsdp.checkpoint.save, "
        f"or dcp.save of flashfsdp.get_optimizer_state_dict(model, optimizer)) and convert the checkpoint with "
        f"torch.distributed.checkpoint.format_utils.dcp_to_torch_save. Sharded get_state_dict (the default "
        f"options) and full_state_dict=True in set_*_state_dict work"
    )


def unit_param_keys(state: FSDPState) -> list[tuple[str, int]]:
    """(state-dict key relative to ``state.module``, unit parameter index) of every registration.

    Walks the module tree the way ``nn.Module.state_dict`` does (every path, shared submodules
    included) and stops at nested fully_shard'ed modules, whose parameters are not this unit's. A
    shared parameter (tied embeddings) yields one key per name.
    """
    slots = {(id(mod), name): i for i, regs in enumerate(state.registrations) for mod, name in regs}
    keys: list[tuple[str, int]] = []
    stack = [("", state.module)]
    while stack:
        prefix, mod = stack.pop()
        for name in mod._parameters:
            i = slots.get((id(mod), name))
            if i is not None:
                keys.append((prefix + name, i))
        for name, child in reversed(list(mod._modules.items())):
            if child is not None and not hasattr(child, "_flashfsdp_state"):
                stack.append((f"{prefix}{name}.", child))
    return keys


def _sharded_piece(param: nn.Parameter, key: str, keep_vars: bool) -> ShardedPiece:
    local = param if keep_vars else param.detach()
    return ShardedPiece(local, param._flashfsdp_full_shape, param._flashfsdp_piece.param_start, fqn=key)


def _post_state_dict(state: FSDPState, module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    _refuse_dsd_full_state_dict(f"fully_shard'ed module '{state.unit.name}'")
    # The registrations hold the sharded pieces outside forward/backward and the unsharded views
    # inside; either way the master values are the pieces.
    for rel, i in unit_param_keys(state):
        key = prefix + rel
        if key in state_dict:
            keep_vars = isinstance(state_dict[key], nn.Parameter)
            state_dict[key] = _sharded_piece(state.unit.sharded_param(i), key, keep_vars)


def _pre_load_state_dict(state: FSDPState, module: nn.Module, state_dict: dict, prefix: str, local_metadata,
                         strict, missing_keys, unexpected_keys, error_msgs) -> None:
    if local_metadata.get("assign_to_params_buffers", False):
        raise ValueError(
            f"load_state_dict(assign=True) is not supported on fully_shard'ed module '{state.unit.name}': its "
            f"parameters are views into the sharded flat storage; call load_state_dict(state_dict) without assign"
        )
    if state.holds_unsharded:
        raise RuntimeError(
            f"load_state_dict on fully_shard'ed module '{state.unit.name}' while its parameters are unsharded: "
            f"call it outside forward/backward, after module.reshard()"
        )
    # Replace each value by this rank's piece; the default loader then copies it into the piece.
    for rel, i in unit_param_keys(state):
        key = prefix + rel
        if key in state_dict:
            state_dict[key] = local_piece_of(state_dict[key], state.unit.sharded_param(i), key)


def local_piece_of(value: Any, param: nn.Parameter, name: str) -> torch.Tensor:
    """This rank's elements of ``value`` for the sharded parameter piece ``param`` (1-D).

    Args:
        value: a :class:`ShardedPiece` of this rank's range (what ``state_dict()`` and ``dcp.load``
            give), a ``DTensor`` or plain tensor of the parameter's full shape, or a 1-D tensor already
            shaped like the piece (an optimizer's own state).
        param: the piece (carries ``_flashfsdp_full_shape`` and ``_flashfsdp_piece``).
        name: the key, for errors.

    Raises:
        TypeError: ``value`` is not a tensor.
        ValueError: a ShardedPiece of another range (taken at another world size) or a wrong shape.
    """
    full_shape = param._flashfsdp_full_shape
    start, n = param._flashfsdp_piece.param_start, param.numel()
    if isinstance(value, ShardedPiece):
        if not value.describes_same_range(full_shape, start, n):
            raise ValueError(
                f"'{name}' is a ShardedPiece of elements [{value.start}, {value.start + value.local().numel()}) of "
                f"shape {tuple(value.shape)}, but this rank owns elements [{start}, {start + n}) of shape "
                f"{tuple(full_shape)}: it comes from another world size or model; load checkpoints with "
                f"torch.distributed.checkpoint into model.state_dict() (dcp.load), or pass full tensors"
            )
        return value.local()
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"'{name}' must be a tensor, got {type(value).__name__}")
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    if isinstance(value, DTensor):
        value = value.full_tensor()
    if value.shape == full_shape:
        return value.reshape(-1)[start : start + n]
    if value.dim() == 1 and value.shape == param.shape:
        return value
    raise ValueError(
        f"'{name}' has shape {tuple(value.shape)}, but the parameter's full shape is {tuple(full_shape)}: "
        f"pass the state dict of the same model"
    )


# ---------------------------------------------------------------------------- agreement across ranks
def global_rank() -> int:
    """This process's rank in the default group (0 when torch.distributed is not initialised)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def global_world_size() -> int:
    """The default group's size (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def error_payload(exc: BaseException | None) -> tuple[str, str] | None:
    """(class name, message) of an exception, or None, to send to the other ranks."""
    return None if exc is None else (type(exc).__name__, str(exc))


def raise_agreed(payloads: list[tuple[str, str] | None]) -> None:
    """Raise the first error of any rank, on every rank (of the same class if a builtin one)."""
    for rank, payload in enumerate(payloads):
        if payload is not None:
            kind, message = payload
            cls = getattr(builtins, kind, None)
            if not (isinstance(cls, type) and issubclass(cls, Exception)):
                cls = RuntimeError
            suffix = "" if len(payloads) == 1 else f" (rank {rank})"
            raise cls(message + suffix)


def agree(exc: BaseException | None) -> None:
    """Collective: every rank passes its error or None; if any rank failed, every rank raises.

    Keeps the ranks together where one rank alone could fail (file checks, input only rank 0 sees),
    so that no rank waits forever in a later collective. No communication without a process group.
    """
    payload = error_payload(exc)
    if global_world_size() == 1:
        raise_agreed([payload])
        return
    payloads: list = [None] * global_world_size()
    dist.all_gather_object(payloads, payload)
    raise_agreed(payloads)


def from_rank0(obj: Any) -> Any:
    """Collective: rank 0's ``obj`` on every rank (``obj`` itself without a process group)."""
    if global_world_size() == 1:
        return obj
    box = [obj if global_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------------------- full state dicts
def _check_model(model: Any, where: str) -> list[tuple[str, FSDPState]]:
    """(path, state) of every fully_shard'ed module of ``model``, outermost first."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be an nn.Module, got {type(model).__name__}")
    states = [(path, m._flashfsdp_state) for path, m in model.named_modules() if hasattr(m, "_flashfsdp_state")]
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


def _owners(states: list[tuple[str, FSDPState]]) -> dict[str, tuple[FSDPState, int]]:
    """State-dict key -> (state, unit parameter index) for every unit parameter of the model."""
    owners = {}
    for path, state in states:
        prefix = f"{path}." if path else ""
        for rel, i in unit_param_keys(state):
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
    owners = _owners(states)
    gathered: dict[str, torch.Tensor] = {}
    flat_buffer = _flat_buffers(states)
    for _, state in states:
        unit = state.unit
        wanted = _wanted_by_group(state, owners, template.keys())
        for group in unit.groups:
            positions = wanted.get(id(group))
            if not positions:
                continue
            full = flat_buffer(group, unit.device)
            unit.comm.all_gather_into_tensor(full, group.sharded_flat).wait()
            if keep:
                target = torch.device("cpu") if cpu_offload else unit.device
                order = sorted(positions)
                outs = [torch.empty(group.shapes[pos], dtype=group.dtype, device=target) for pos in order]
                offsets = [group.layout.offsets[pos] for pos in order]
                if target == full.device:
                    unflatten(full, offsets, outs)
                else:
                    for out, pos, off in zip(outs, order, offsets):
                        out.copy_(full[off : off + group.layout.numels[pos]].view(group.shapes[pos]))
                for pos, out in zip(order, outs):
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
    owners = _owners(states)
    verdict: Any
    if global_rank() == 0:
        try:
            verdict = ("ok", _validate_full_state_dict(state_dict, template, strict))
        except (TypeError, ValueError, NotImplementedError) as exc:
            verdict = ("error", error_payload(exc))
    else:
        verdict = None
    verdict = from_rank0(verdict)
    if verdict[0] == "error":
        raise_agreed([verdict[1]])
    present = verdict[1]
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
    del flat_buffer
    comm = states[0][1].unit.comm
    for key in present:
        if key in owners:
            continue
        target = template[key]
        buf = state_dict[key].detach().to(target.device, target.dtype) if is_root else torch.empty_like(target)
        comm.broadcast(buf, 0).wait()
        target.copy_(buf)


# ---------------------------------------------------------------------------- optimizer state
# [Note: optimizer state-dict hooks]
# Optimizer.state_dict() keys the state by parameter position (an int, in param_groups order);
# load_state_dict matches the saved param_groups' ids with the optimizer's parameters in the same
# order. DSD calls both with parameter names in place of the ints. The hooks below pair ids and
# parameters that way and touch only parameters that carry a flashfsdp piece (``_flashfsdp_piece``).

_HOOKED = "_flashfsdp_state_dict_hooks"  # set on an optimizer once its hooks are registered
_scanned: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()
_step_hook = None


def _register_optimizer_step_hook() -> None:
    """Register (once per process) the global step-pre-hook that installs the optimizer hooks."""
    global _step_hook
    if _step_hook is None:
        _step_hook = register_optimizer_step_pre_hook(_install_on_step)


def _install_on_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    # Every optimizer's step passes here: scan an optimizer's parameters again only when their
    # number changed (add_param_group).
    if getattr(optimizer, _HOOKED, False):
        return
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if _scanned.get(optimizer) != count:
        _scanned[optimizer] = count
        install_optimizer_hooks(optimizer)


def install_optimizer_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Give ``optimizer`` the state-dict hooks of [Note: optimizer state-dict hooks] (idempotent).

    Returns whether it has them, i.e. whether any of its parameters is a flashfsdp piece (an
    optimizer over plain parameters is left alone). The hooks are the optimizer's own: a copy or
    an unpickled optimizer gets them again at its first step. ShardedPieces that an earlier
    ``load_state_dict`` (without the hooks: before the optimizer's first step) put into its state
    become this rank's pieces now, before any step runs on them.

    Raises:
        ValueError: such a ShardedPiece is of another range than this rank's (another world size).
    """
    if getattr(optimizer, _HOOKED, False):
        return True
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not any(hasattr(p, "_flashfsdp_piece") for p in params):
        return False
    for i, param in enumerate(params):
        entries = optimizer.state.get(param)  # .get: no entry is created
        if hasattr(param, "_flashfsdp_piece") and isinstance(entries, dict):
            for key, value in entries.items():
                if isinstance(value, ShardedPiece):
                    entries[key] = local_piece_of(value, param, f"{_param_label(i)}.{key}")
    optimizer.register_state_dict_post_hook(_optimizer_state_dict_post_hook)
    optimizer.register_load_state_dict_pre_hook(_optimizer_load_state_dict_pre_hook)
    setattr(optimizer, _HOOKED, True)
    return True


def _params_by_id(optimizer: torch.optim.Optimizer, groups: Any) -> dict[Any, nn.Parameter] | None:
    """Saved parameter id (int or name) -> the optimizer's parameter, or None if the groups differ."""
    if not isinstance(groups, (list, tuple)) or len(groups) != len(optimizer.param_groups):
        return None
    for saved, own in zip(groups, optimizer.param_groups):
        if not isinstance(saved, Mapping) or len(saved.get("params", ())) != len(own["params"]):
            return None
    return dict(zip(chain.from_iterable(g["params"] for g in groups),
                    chain.from_iterable(g["params"] for g in optimizer.param_groups)))


def _param_label(param_id: Any) -> str:
    return param_id if isinstance(param_id, str) else f"optimizer parameter #{param_id}"


def _is_piece_state(value: Any, param: nn.Parameter) -> bool:
    """Whether ``value`` is per-element optimizer state of the piece ``param`` (shaped like it, 1-D)."""
    return (isinstance(value, torch.Tensor) and not isinstance(value, ShardedPiece) and value.dim() == 1
            and value.shape == param.shape)


def _optimizer_state_dict_post_hook(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict:
    """Per-element state of flashfsdp parameters as ShardedPieces (new dicts; the state is shared)."""
    _refuse_dsd_full_state_dict(f"{type(optimizer).__name__} over fully_shard'ed parameters")
    params = _params_by_id(optimizer, state_dict["param_groups"]) or {}
    state = {}
    for param_id, entries in state_dict["state"].items():
        param = params.get(param_id)
        if param is not None and hasattr(param, "_flashfsdp_piece") and isinstance(entries, Mapping):
            entries = {
                key: ShardedPiece(value, param._flashfsdp_full_shape, param._flashfsdp_piece.param_start,
                                  fqn=f"{_param_label(param_id)}.{key}") if _is_piece_state(value, param) else value
                for key, value in entries.items()
            }
        state[param_id] = entries
    return {**state_dict, "state": state}


def _optimizer_load_state_dict_pre_hook(optimizer: torch.optim.Optimizer, state_dict: dict) -> dict | None:
    """This rank's pieces of ShardedPieces / full-shape tensors in ``state_dict`` (new dicts).

    Raises ValueError (naming the parameter and key) for a ShardedPiece of another range or a
    tensor of another shape; a state dict whose param_groups do not match is left to
    ``Optimizer.load_state_dict``'s own error.
    """
    if not isinstance(state_dict.get("state"), Mapping):
        return None
    params = _params_by_id(optimizer, state_dict.get("param_groups"))
    if params is None:
        return None
    state = {}
    for param_id, entries in state_dict["state"].items():
        param = params.get(param_id)
        if param is not None and hasattr(param, "_flashfsdp_piece") and isinstance(entries, Mapping):
            local = {}
            for key, value in entries.items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    piece = local_piece_of(value, param, f"{_param_label(param_id)}.{key}")
                    # a slice of a full tensor: own copy, so that the full tensor can be freed
                    value = piece if isinstance(value, ShardedPiece) or piece is value else piece.clone()
                local[key] = value
            entries = local
        state[param_id] = entries
    return {**state_dict, "state": state}


def _check_optimizer(model: Any, optimizer: Any, where: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{where}: optimizer must be a torch.optim.Optimizer over the model's parameters, "
                        f"got {type(optimizer).__name__}")


def get_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, sharded like the parameters (for DCP).

    Use this (or ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` /
    ``get_state_dict`` with the default options, which give the same once the optimizer has its
    hooks) with ``dcp.save`` / ``dcp.load``, and :func:`set_optimizer_state_dict` to load; or
    ``flashfsdp.checkpoint.save`` / ``load``, which do all of it. Not with
    ``StateDictOptions(full_state_dict=True)``: DSD cannot gather flashfsdp pieces and raises
    (see the module docstring).

    Installs the optimizer's state-dict hooks ([Note: optimizer state-dict hooks]), then calls
    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` (which keys the state by
    the names ``model.named_parameters()`` gives, and initialises a fresh optimizer's state with a
    zero-lr step). Every state tensor shaped like a sharded parameter's 1-D piece (Adam's
    ``exp_avg``/``exp_avg_sq``, SGD's ``momentum_buffer``) is a :class:`ShardedPiece` of the
    parameter's full shape, so DCP saves and reshards it like the parameter; scalars (``step``)
    and ``param_groups`` stay as they are (replicated).

    Args:
        model: the (fully_shard'ed) model whose parameters ``optimizer`` steps.
        optimizer: a torch optimizer (Adam, AdamW, SGD, ... any element-wise one).

    Returns:
        ``{"state": {name: {key: value}}, "param_groups": [...]}``; the tensors share storage with
        the optimizer's state (``dcp.load`` into it loads in place).

    Raises:
        TypeError: ``model`` or ``optimizer`` of the wrong type.
    """
    from torch.distributed.checkpoint import state_dict as dsd  # noqa: PLC0415

    _check_optimizer(model, optimizer, "get_optimizer_state_dict")
    install_optimizer_hooks(optimizer)
    osd = dsd.get_optimizer_state_dict(model, optimizer)
    for name, entries in osd["state"].items():
        for key, value in entries.items():
            if isinstance(value, ShardedPiece):
                value._fqn = f"{name}.{key}"  # the hook knew positions only; DSD gave the names
    return osd


def set_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                             optim_state_dict: Mapping[str, Any]) -> None:
    """Load an optimizer state dict of :func:`get_optimizer_state_dict`'s form into ``optimizer``.

    Use it after ``dcp.load`` into :func:`get_optimizer_state_dict`'s dict (or call
    ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` / ``set_state_dict``,
    which do the same, ``full_state_dict=True`` included); ``flashfsdp.checkpoint.load`` does
    it all.

    Installs the optimizer's state-dict hooks ([Note: optimizer state-dict hooks]) and calls
    ``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict`` (names to parameters,
    ``Optimizer.load_state_dict``; hyperparameters such as ``lr`` come from the state dict), whose
    ``load_state_dict`` hook turns every ShardedPiece (what ``dcp.load`` filled) into its local
    piece and cuts every plain tensor of a parameter's full shape (a full optimizer state dict) to
    this rank's piece. ``optim_state_dict`` itself is not modified.

    Raises:
        TypeError: wrong ``model``/``optimizer`` type, or ``optim_state_dict`` not a mapping.
        ValueError: ``optim_state_dict`` lacks "state"/"param_groups"; a ShardedPiece of another range;
            a state tensor of a wrong shape (the message names the parameter).
    """
    from torch.distributed.checkpoint import state_dict as dsd  # noqa: PLC0415

    _check_optimizer(model, optimizer, "set_optimizer_state_dict")
    if not isinstance(optim_state_dict, Mapping):
        raise TypeError(f"set_optimizer_state_dict: optim_state_dict must be a mapping, got "
                        f"{type(optim_state_dict).__name__}")
    if "state" not in optim_state_dict or "param_groups" not in optim_state_dict:
        raise ValueError("set_optimizer_state_dict: optim_state_dict must have 'state' and 'param_groups' "
                         "(as get_optimizer_state_dict returns)")
    install_optimizer_hooks(optimizer)
    dsd.set_optimizer_state_dict(model, optimizer, dict(optim_state_dict))
