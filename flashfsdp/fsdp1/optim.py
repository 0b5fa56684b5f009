"""FSDP1's ``optim_state_dict`` / ``optim_state_dict_to_load``: optimizer state keyed by the
unwrapped model's parameter names, full or sharded as the model's ``state_dict_type`` says.

Both go through torch's DSD keyed by ``model.named_parameters()`` names (each per-element state
tensor of a sharded parameter a DTensor of its placements, or full tensors with DSD's full
options); here the names lose their ``_fsdp_wrapped_module.`` segments, and loading maps them back
to the optimizer's parameters and turns every value into a DTensor of its parameter's placements
(``state_dict.sharded_value_of``: a full tensor's rows for this rank).
"""

from __future__ import annotations

import copy
from typing import Any, Mapping

import torch
import torch.nn as nn

from flashfsdp.bindings import get_optimizer_state_dict
from flashfsdp.runtime.agreement import broadcast_state, global_rank
from flashfsdp.runtime.full_values import sharded_value_of
from flashfsdp.runtime.param_tags import group_of

from .api import StateDictType
from .state_dict_type import clean_key


def _settings(model: nn.Module, wrapper_cls):
    wrappers = wrapper_cls.fsdp_modules(model)
    if not wrappers:
        raise ValueError(f"optim_state_dict: {type(model).__name__} holds no FullyShardedDataParallel module")
    return wrappers[0]._fsdp_state_dict_settings


def optim_state_dict(model: nn.Module, optim: torch.optim.Optimizer, wrapper_cls) -> dict[str, Any]:
    """The optimizer's state keyed by clean parameter names (collective).

    FULL_STATE_DICT: full tensors (only rank 0 keeps them with ``rank0_only``; on the CPU with
    ``offload_to_cpu``). SHARDED_STATE_DICT: DTensor values, as ``model.state_dict()``.
    """
    settings = _settings(model, wrapper_cls)
    if settings.state_dict_type is StateDictType.FULL_STATE_DICT:
        from torch.distributed.checkpoint import state_dict as dsd  # noqa: PLC0415

        config = settings.optim_state_dict_config
        osd = dsd.get_optimizer_state_dict(model, optim, options=dsd.StateDictOptions(full_state_dict=True))
        if config.rank0_only and global_rank() != 0:
            return {}
        if config.offload_to_cpu:
            osd = _to_cpu(osd)
    else:
        osd = get_optimizer_state_dict(model, optim)
    return {
        "state": {clean_key(name): entries for name, entries in osd["state"].items()},
        "param_groups": [{**g, "params": [clean_key(n) for n in g["params"]]} for g in osd["param_groups"]],
    }


def _to_cpu(tree):
    if isinstance(tree, torch.Tensor):
        return tree.cpu()
    if isinstance(tree, dict):
        return {k: _to_cpu(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_to_cpu(v) for v in tree]
    return tree


def optim_state_dict_to_load(model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: Mapping[str, Any],
                             wrapper_cls) -> dict[str, Any]:
    """``optim_state_dict`` (keyed by clean names, full or sharded) as ``optim.load_state_dict``
    takes it: keyed by the optimizer's parameter positions, each per-element state a DTensor of its
    parameter's placements. Under FULL_STATE_DICT with ``rank0_only`` rank 0's dict is broadcast first.

    Raises:
        ValueError: not a mapping with "state" and "param_groups"; param_groups that do not match
            the optimizer's; a state for a parameter the model does not have.
    """
    settings = _settings(model, wrapper_cls)
    if settings.state_dict_type is StateDictType.FULL_STATE_DICT and settings.optim_state_dict_config.rank0_only:
        optim_state_dict = broadcast_state(optim_state_dict if global_rank() == 0 else None, src=0)
    if not isinstance(optim_state_dict, Mapping) or not {"state", "param_groups"} <= set(optim_state_dict):
        raise ValueError("optim_state_dict_to_load: optim_state_dict must have 'state' and 'param_groups' (as "
                         "FullyShardedDataParallel.optim_state_dict returns)")
    names = {id(p): clean_key(n) for n, p in model.named_parameters()}
    saved_groups = optim_state_dict["param_groups"]
    if len(saved_groups) != len(optim.param_groups):
        raise ValueError(f"optim_state_dict_to_load: {len(saved_groups)} param_groups saved, the optimizer has "
                         f"{len(optim.param_groups)}")
    position, groups, state = 0, [], {}
    for saved, own in zip(saved_groups, optim.param_groups):
        ids = []
        for param in own["params"]:
            name = names.get(id(param))
            if name is None:
                raise ValueError("optim_state_dict_to_load: the optimizer steps a parameter that is not the model's")
            if name in optim_state_dict["state"]:
                state[position] = {k: _local(v, param, f"{name}.{k}")
                                   for k, v in optim_state_dict["state"][name].items()}
            ids.append(position)
            position += 1
        groups.append({**copy.copy(saved), "params": ids})
    return {"state": state, "param_groups": groups}


def _local(value, param: nn.Parameter, name: str):
    """A per-element state value of a sharded parameter as a DTensor of its placements, in memory
    of its own (a loaded ``step`` must not alias the saved optimizer's, which steps it in place)."""
    if not isinstance(value, torch.Tensor):
        return value
    if value.dim() == 0 or group_of(param) is None:
        return value.clone()
    sharded = sharded_value_of(value, param, name)
    return sharded.clone() if sharded is value else sharded
