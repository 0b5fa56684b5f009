"""Optimizer state dicts over fully_shard'ed parameters, sharded like the parameters (for DCP).

See [Note: optimizer state-dict hooks] below and ``state_dict.py`` for which calls to use when.
"""

from __future__ import annotations

import weakref
from itertools import chain
from typing import Any, Mapping

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from flashfsdp.runtime.flat_param import shards_written

from .init_window import close_init_windows
from .sharded_tensor import ShardedPiece
from .dsd_full import dsd_full_request, full_optimizer_state
from .state_dict import local_piece_of

# [Note: optimizer state-dict hooks]
# Optimizer.state_dict() keys the state by parameter position (an int, in param_groups order);
# load_state_dict matches the saved param_groups' ids with the optimizer's parameters in the same
# order. DSD calls both with parameter names in place of the ints. The hooks below pair ids and
# parameters that way and touch only parameters that carry a flashfsdp piece (``_flashfsdp_piece``).

_HOOKED = "_flashfsdp_state_dict_hooks"  # set on an optimizer once its hooks are registered
_scanned: "weakref.WeakKeyDictionary[torch.optim.Optimizer, int]" = weakref.WeakKeyDictionary()
_step_hook = None


def register_optimizer_step_hook() -> None:
    """Register (once per process) the global step-pre-hook that installs the optimizer hooks."""
    global _step_hook
    if _step_hook is None:
        _step_hook = (register_optimizer_step_pre_hook(_install_on_step),
                      register_optimizer_step_post_hook(_after_step))


def _install_on_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    close_init_windows()
    # Every optimizer's step passes here: scan an optimizer's parameters again only when their
    # number changed (add_param_group).
    if getattr(optimizer, _HOOKED, False):
        return
    count = sum(len(g["params"]) for g in optimizer.param_groups)
    if _scanned.get(optimizer) != count:
        _scanned[optimizer] = count
        install_optimizer_hooks(optimizer)


def _after_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if getattr(optimizer, _HOOKED, False):
        shards_written()  # unsharded copies kept across the step are stale now


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
    params = _params_by_id(optimizer, state_dict["param_groups"]) or {}
    info = dsd_full_request()
    if info is not None:  # DSD's full-state-dict getter: full tensors (see dsd_full.py)
        return {**state_dict, "state": full_optimizer_state(state_dict["state"], params, _is_piece_state, info)}
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
