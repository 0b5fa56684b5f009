"""Sharded and full state dicts of fully_shard'ed modules; torch.distributed.checkpoint integration.

Which calls to use (every one collective unless said otherwise)
----------------------------------------------------------------
============================================  =====================================================
sharded checkpoint, model + optimizer          ``flashfsdp.checkpoint.save`` / ``load`` (atomic), or
(reshardable to any world size)                ``dcp.save`` / ``dcp.load`` of ``model.state_dict()``
                                               and ``flashfsdp.get_optimizer_state_dict``, then
                                               ``model.load_state_dict`` and
                                               ``flashfsdp.set_optimizer_state_dict``; the stock
                                               ``torch.distributed.checkpoint.state_dict``
                                               ``get_state_dict`` / ``set_state_dict`` (and the
                                               model/optimizer variants) with the default
                                               options work too
full model state dict (plain tensors)          ``flashfsdp.get_full_state_dict`` / ``set_full_state_dict``
full state dict *into* a flashfsdp model       also ``set_model_state_dict`` /
                                               ``set_optimizer_state_dict`` with
                                               ``StateDictOptions(full_state_dict=True)``
                                               (``broadcast_from_rank0`` too), or
                                               ``model.load_state_dict(full_sd)`` on every rank
============================================  =====================================================

``StateDictOptions(full_state_dict=True)`` in the *getters* of
``torch.distributed.checkpoint.state_dict`` (``get_state_dict``, ``get_model_state_dict``,
``get_optimizer_state_dict``) works too: DSD gathers only DTensor and ShardedTensor values, so the
hooks below recognise its full getter on the call stack and hand it full tensors, gathered unit by
unit (``dsd_full.py``).

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

Optimizer state ([Note: optimizer state-dict hooks] in ``optim_state_dict.py``): an optimizer's
state of a sharded parameter (``exp_avg``, ``momentum_buffer``, ...) is a 1-D tensor shaped like
this rank's piece, which DCP would take for a replicated tensor (and keep one rank's, silently
losing the others'). So every optimizer over flashfsdp parameters gets two hooks of its own:
``optimizer.state_dict()`` returns each per-element state tensor as a ShardedPiece of the
parameter's full shape (what DCP saves and reshards like the parameter), and
``optimizer.load_state_dict`` turns ShardedPieces (what ``dcp.load`` filled) and full-shape tensors
(a full optimizer state dict) back into this rank's piece. The hooks are installed on an optimizer
the first time it steps (a global optimizer step-pre-hook, registered by the first ``fully_shard``;
DSD's getters and setters step a fresh optimizer once with lr 0 to create its state, which installs
them) and by :func:`~flashfsdp.bindings.optim_state_dict.get_optimizer_state_dict` /
:func:`~flashfsdp.bindings.optim_state_dict.set_optimizer_state_dict`. Scalars (``step``) and
``param_groups`` stay as they are (replicated). DSD keys the state by parameter name (it maps the
pieces through ``model.named_parameters()``).

Full state dicts (:func:`~flashfsdp.bindings.full_state_dict.get_full_state_dict` /
:func:`~flashfsdp.bindings.full_state_dict.set_full_state_dict`): exactly the keys, order and
shapes of ``nn.Module.state_dict()`` of the unwrapped model, gathered (or broadcast from rank 0) one
unit at a time through the unit's own communicator, so that peak memory is one unit.

This module holds the sharded model state dict (the hooks) and the refusal of DSD's full-state-dict
getters; ``full_state_dict.py`` the full state dicts, ``optim_state_dict.py`` the optimizer's, and
``agreement.py`` the cross-rank error agreement they share.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn

from flashfsdp.runtime.flat_param import shards_written

from .dsd_full import dsd_full_request, full_unit_params
from .init_window import close_init_windows
from .sharded_tensor import ShardedPiece
from .state import FSDPState


# ---------------------------------------------------------------------------- hooks
def install_state_dict_hooks(module: nn.Module, state: FSDPState) -> None:
    """Make ``module.state_dict()`` / ``module.load_state_dict()`` sharded-aware (called by fully_shard).

    Each hook handles only the parameters of ``state``'s unit; nested fully_shard'ed modules run
    their own hooks, as ``nn.Module.state_dict`` visits every submodule. (``fully_shard`` also
    registers the optimizer step-pre-hook of ``optim_state_dict.py``.)
    """
    module.register_state_dict_post_hook(functools.partial(_post_state_dict, state))
    module.register_load_state_dict_pre_hook(functools.partial(_pre_load_state_dict, state))
    module.register_load_state_dict_post_hook(functools.partial(_post_load_state_dict, state))


def unit_param_keys(state: FSDPState, module: nn.Module | None = None) -> list[tuple[str, int]]:
    """(state-dict key relative to ``module``, unit parameter index) of every registration under
    ``module`` (default: the state's first module; a grouped unit has one per module).

    Walks the module tree the way ``nn.Module.state_dict`` does (every path, shared submodules
    included) and stops at nested fully_shard'ed modules, whose parameters are not this unit's. A
    shared parameter (tied embeddings) yields one key per name.
    """
    slots = {(id(mod), name): i for i, regs in enumerate(state.registrations) for mod, name in regs}
    keys: list[tuple[str, int]] = []
    stack = [("", state.module if module is None else module)]
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
    close_init_windows()
    info = dsd_full_request()
    if info is not None:  # DSD's full-state-dict getter: full tensors (see dsd_full.py)
        fulls = full_unit_params(state, info)
        for rel, i in unit_param_keys(state, module):
            if prefix + rel in state_dict:
                state_dict[prefix + rel] = fulls[i]
        return
    # The registrations hold the sharded pieces outside forward/backward and the unsharded views
    # inside; either way the master values are the pieces.
    for rel, i in unit_param_keys(state, module):
        key = prefix + rel
        if key in state_dict:
            keep_vars = isinstance(state_dict[key], nn.Parameter)
            state_dict[key] = _sharded_piece(state.unit.sharded_param(i), key, keep_vars)


def _pre_load_state_dict(state: FSDPState, module: nn.Module, state_dict: dict, prefix: str, local_metadata,
                         strict, missing_keys, unexpected_keys, error_msgs) -> None:
    close_init_windows()
    shards_written()
    if state.holds_unsharded:
        raise RuntimeError(
            f"load_state_dict on fully_shard'ed module '{state.unit.name}' while its parameters are unsharded: "
            f"call it outside forward/backward, after module.reshard()"
        )
    # Replace each value by this rank's piece; the default loader then copies it into the piece.
    for rel, i in unit_param_keys(state, module):
        key = prefix + rel
        if key in state_dict:
            state_dict[key] = local_piece_of(state_dict[key], state.unit.sharded_param(i), key)


def _post_load_state_dict(state: FSDPState, module: nn.Module, incompatible_keys) -> None:
    """After ``load_state_dict(assign=True)``: the module holds the loaded pieces as new parameters;
    take them back into the flat storage (on their device: a meta-device unit is materialised)."""
    if any(getattr(mod._parameters.get(name), "_flashfsdp_piece", None) is None
           for regs in state.registrations for mod, name in regs):
        state.adopt_module_params()
        close_init_windows([p for g in state.unit.groups for p in g.sharded_params])  # loaded, not to initialise


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
