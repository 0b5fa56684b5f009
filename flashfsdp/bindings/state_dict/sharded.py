"""Sharded state dicts of fully_shard'ed modules: FSDP2's, plain DTensors.

Sharded (the default, what ``module.state_dict()`` returns): every parameter of a unit appears under
its original fully-qualified name as its sharded DTensor (FSDP2's placements and global shape,
detached unless ``keep_vars``), also while the module holds its unsharded parameters inside a
forward; ``torch.distributed.checkpoint`` saves and reshards it natively, ``torch.load(...,
weights_only=True)`` reads a ``torch.save``'d one without flashfsdp, and DSD's full-state-dict
options gather it with ``full_tensor()``. Buffers and parameters outside any unit stay plain tensors
(replicated). ``module.load_state_dict`` takes DTensors of the unit's placements (copied into the
shard in place), DTensors of other placements (redistributed first) or plain full-shape tensors
(this rank's rows taken): the hooks below, registered on every fully_shard'ed module by
:func:`install_state_dict_hooks`, replace each value by a DTensor of the unit's placements, which
``nn.Module``'s loader copies into the sharded parameter. The keys are the module hierarchy's
(``nn.Module.state_dict``'s), never a name stored on a parameter.

Optimizer state of stock optimizers is per parameter and so DTensors too (``torch.optim`` creates
it with ``zeros_like`` of the DTensor parameter); ``flashfsdp.optim`` keeps the same layout.
Full state dicts are in ``full.py``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn

from flashfsdp.runtime.extensions import defines_extension
from flashfsdp.runtime.flat_param import shards_written
from flashfsdp.runtime.full_values import sharded_value_of
from flashfsdp.runtime.init_window import close_init_windows
from flashfsdp.runtime.sharding_spec import is_dtensor, local_of

from ..state import FSDPState


# ---------------------------------------------------------------------------- hooks
def install_state_dict_hooks(module: nn.Module, state: FSDPState) -> None:
    """Make ``module.state_dict()`` / ``module.load_state_dict()`` sharded-aware (called by fully_shard).

    Each hook handles only the parameters of ``state``'s unit; nested fully_shard'ed modules run
    their own hooks, as ``nn.Module.state_dict`` visits every submodule.
    """
    # the init windows close before nn.Module reads the parameters (inside one, a parameter's
    # detach() is its full-shape stand-in)
    module.register_state_dict_pre_hook(lambda *_: close_init_windows())
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


def _post_state_dict(state: FSDPState, module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    close_init_windows()
    # The entries are found by what they hold, not by their keys: a hook registered earlier may
    # have renamed them (checkpoint_wrapper strips "_checkpoint_wrapped_module."). Inside
    # forward/backward the registrations hold the unsharded views: keys then (the views are not
    # the sharded parameters). Detached values are built over the local chunk here, not by
    # ``param.detach()`` (see [Note: DTensor wrapper storage offset] in runtime/sharding_spec.py).
    params = [state.unit.sharded_param(i) for i in range(len(state.registrations))]
    # A tensor subclass (all-gather extensions) has no storage of its own: every one's data_ptr()
    # is 0, so it is found by identity only, never by memory (that would match another parameter).
    by_param = {id(p): i for i, p in enumerate(params)}
    by_local = {_local_key(p): i for i, p in enumerate(params) if _has_storage(p)}
    if state.holds_unsharded:  # (a detached unsharded view: same memory and shape as the parameter)
        by_unsharded = {_local_key(u): i for i, u in enumerate(map(state.unit.unsharded_param, range(len(params))))
                        if _has_storage(u)}
    replaced = set()
    for key, value in list(state_dict.items()):
        if not key.startswith(prefix) or not isinstance(value, torch.Tensor):
            continue
        i = by_param.get(id(value))
        if i is None and is_dtensor(value) and _has_storage(value):
            i = by_local.get(_local_key(value))
        if i is None and state.holds_unsharded and not is_dtensor(value) and _has_storage(value):
            i = by_unsharded.get(_local_key(value))
        if i is not None:
            state_dict[key] = _sharded_entry(state, params[i], i, value)
            replaced.add(key)
    _replace_unsharded_leftovers(state, module, state_dict, prefix, params, replaced)


def _sharded_entry(state: FSDPState, param: torch.Tensor, i: int, value: torch.Tensor) -> torch.Tensor:
    """The state dict's value of unit parameter ``i`` (``value``: what ``nn.Module`` put there)."""
    if isinstance(value, nn.Parameter):
        return param
    group, pos = state.unit.param_slots[i]
    return group.wrap_local(local_of(param).detach(), pos)


def _replace_unsharded_leftovers(state: FSDPState, module: nn.Module, state_dict: dict, prefix: str, params: list,
                                 replaced: set) -> None:
    """[Note: state dict from a reader thread] ``state_dict()`` called from another thread while the
    training thread runs a step reads ``module._parameters`` when they hold the unsharded views,
    and the training thread may reshard (free those views' memory, ``holds_unsharded`` False) before
    this hook runs: the values are then not found by memory, and would stay plain full tensors over
    freed memory beside the other units' DTensors (FSDP2: "mixed torch.Tensor and DTensor"; a later
    read of that memory can crash the process). So every registration's key that still holds a
    plain tensor gets its sharded DTensor: the state dict always holds the units' shards."""
    for key, i in unit_param_keys(state, module):
        key = prefix + key
        value = state_dict.get(key)
        if key not in replaced and isinstance(value, torch.Tensor) and not is_dtensor(value):
            state_dict[key] = _sharded_entry(state, params[i], i, value)


def _has_storage(tensor: torch.Tensor) -> bool:
    local = local_of(tensor)
    return type(local) in (torch.Tensor, nn.Parameter) or not defines_extension(local)


def _local_key(tensor: torch.Tensor) -> tuple:
    local = local_of(tensor)
    return (local.data_ptr(), tuple(local.shape), local.dtype, tuple(tensor.shape))


def _pre_load_state_dict(state: FSDPState, module: nn.Module, state_dict: dict, prefix: str, local_metadata,
                         strict, missing_keys, unexpected_keys, error_msgs) -> None:
    close_init_windows()
    shards_written()
    state.reshard_idle("load_state_dict")  # (kept unsharded after a forward: the load writes the shards)
    # Replace each value by a DTensor of the unit's placements; the default loader then copies it
    # into the sharded parameter (DTensor.copy_: its local tensor, this rank's chunk of the shard).
    for rel, i in unit_param_keys(state, module):
        key = prefix + rel
        if key in state_dict:
            state_dict[key] = sharded_value_of(state_dict[key], state.unit.sharded_param(i), key)


def _post_load_state_dict(state: FSDPState, module: nn.Module, incompatible_keys) -> None:
    """After ``load_state_dict(assign=True)``: the module holds the loaded values as new parameters;
    take them back into the flat storage (on their device: a meta-device unit is materialised)."""
    if any(mod._parameters.get(name) is not state.unit.sharded_param(i)
           for i, regs in enumerate(state.registrations) for mod, name in regs):
        state.adopt_module_params()
        close_init_windows([p for g in state.unit.groups for p in g.sharded_params])  # loaded, not to initialise
