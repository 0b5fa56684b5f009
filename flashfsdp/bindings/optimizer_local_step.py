"""Stock element-wise ``torch.optim`` optimizers step the local tensors of flashfsdp's DTensor parameters.

A sharded parameter is a DTensor (``runtime/sharding_spec.py``), as on FSDP2, so a stock optimizer
would run every one of its operations through DTensor's dispatch: per parameter and per operation
on CPU (the single-tensor loop, torch's default there), per operation and list on GPU (foreach).
On a model of many small parameters that dispatch costs more than the arithmetic. For the
optimizers whose update is element-wise — ``SGD``, ``Adam``, ``AdamW``, ``Adamax``, ``Adagrad``,
``Adadelta``, ``RMSprop``, ``NAdam``, ``RAdam``, ``ASGD``, exactly these classes, not subclasses,
which may override ``step`` — an update of a sharded parameter is the same update of
each rank's local chunk: DTensor itself runs the same aten operation on the local tensors. So a
global optimizer step-pre-hook hands such an optimizer, for the step, the local tensors of the
flashfsdp parameters in place of the DTensors (their local gradients as ``.grad``, their states'
local tensors as states), and a step-post-hook puts the DTensors back, wrapping any state tensor
the step created (``exp_avg`` at the first step, SGD's momentum buffer) as a DTensor of the
parameter's placements. (``Rprop`` is element-wise too, but it raises on FSDP2's DTensors — DTensor
has no sharding rule for its masked writes —, and a drop-in raises where FSDP2 raises.) The results are the same bits as the DTensor step: the same kernels run on
the same tensors, and foreach or fused is chosen as for the DTensors (same device, same dtype).
Outside ``step`` nothing changes: ``param_groups`` hold the parameters, ``state`` is keyed by them
and holds DTensors, so ``state_dict()``, DCP and DSD see FSDP2's types.

A group is handed over only if every DTensor in it is a flashfsdp sharded parameter with a plain
local tensor whose gradient and state DTensors have the parameter's placements and local shape
(a gradient left ``Partial`` by tensor parallelism, say, needs DTensor's redistribution); otherwise
that group steps the DTensors. Not inside ``torch.compile`` (a compiled step traces the DTensors).

A step that raises leaves the local tensors in ``param_groups`` (torch runs no post-hook then);
they are put back at the start of that optimizer's next step. Cost: per handed-over parameter and
step, a few attribute reads and dictionary entries (a few microseconds).
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from flashfsdp.runtime.sharding_spec import SHARDED_ATTR, wrap_like

# The optimizer classes whose update of a tensor is element-wise (see the module docstring).
_ELEMENTWISE = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adagrad,
    torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD,
})
# optimizer -> the groups handed over in the step in progress (see _Group)
_handed: "weakref.WeakKeyDictionary[torch.optim.Optimizer, list]" = weakref.WeakKeyDictionary()
_handles: tuple = ()


class _Group:
    """One param group handed over for a step: its parameter list and what replaced it."""

    __slots__ = ("group", "params", "entries")

    def __init__(self, group: dict, params: list, entries: list):
        self.group, self.params, self.entries = group, params, entries  # entries: (param, local, state)


def register_optimizer_local_step() -> None:
    """Register (once per process) the step pre- and post-hooks described in the module docstring."""
    global _handles
    if not _handles:
        _handles = (register_optimizer_step_pre_hook(_pre_step), register_optimizer_step_post_hook(_post_step))


def _pre_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if optimizer in _handed:  # its last step raised: put its parameters back first
        _put_back(optimizer, _handed.pop(optimizer))
    if type(optimizer) not in _ELEMENTWISE or torch.compiler.is_compiling():
        return
    handed = []
    for group in optimizer.param_groups:
        entries = _entries(group["params"], optimizer.state)
        if entries:
            handed.append(_Group(group, group["params"], entries))
    if not handed:
        return
    state = optimizer.state
    for g in handed:
        params = list(g.params)
        for i, (param, local, grad, local_state) in g.entries:
            params[i] = local
            local.grad = grad
            if local_state is not None:
                state[local] = local_state
        g.group["params"] = params
    _handed[optimizer] = handed


def _entries(params: list, state) -> list | None:
    """``(index, (param, local, local grad, local state or None))`` for each flashfsdp parameter of
    one group, or None where the group must step its DTensors (module docstring)."""
    entries = []
    for i, param in enumerate(params):
        if not isinstance(param, DTensor):
            continue
        if not getattr(param, SHARDED_ATTR, False):
            return None
        local = param._local_tensor
        if type(local) is not torch.Tensor:
            return None
        spec = param._spec
        grad = param.grad
        if grad is not None:
            grad = _local_like(grad, spec, local)
            if grad is None:
                return None
        local_state = None
        param_state = state.get(param)
        if param_state:
            local_state = {}
            for key, value in param_state.items():
                if isinstance(value, DTensor):
                    value = _local_like(value, spec, local)
                    if value is None:
                        return None
                local_state[key] = value
        entries.append((i, (param, local, grad, local_state)))
    return entries


def _local_like(tensor: torch.Tensor, spec, local: torch.Tensor) -> torch.Tensor | None:
    """The plain local tensor of ``tensor`` if it is a DTensor placed as ``spec`` says with the
    local shape of ``local``, else None. Most often its spec is ``spec`` itself (a unit's gradients
    and the states made here share their parameter's): then placements and shapes agree as they are."""
    if not isinstance(tensor, DTensor):
        return None
    other, mine = tensor._spec, tensor._local_tensor
    if other is spec:
        return mine if type(mine) is torch.Tensor else None
    if other.placements != spec.placements or type(mine) is not torch.Tensor or mine.shape != local.shape:
        return None
    return mine


def _post_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    handed = _handed.pop(optimizer, None)
    if handed is not None:
        _put_back(optimizer, handed)


def _put_back(optimizer: torch.optim.Optimizer, handed: list) -> None:
    """Restore each handed-over group's parameter list, clear the local tensors' ``.grad`` and move
    their states back under the parameters (new state tensors wrapped as DTensors)."""
    state = optimizer.state
    for g in handed:
        g.group["params"] = g.params
        for _, (param, local, _, _) in g.entries:
            local.grad = None
            local_state = state.pop(local, None)
            if local_state is None:
                continue
            param_state = state[param]
            for key, value in local_state.items():
                old = param_state.get(key)
                if isinstance(old, DTensor) and old._local_tensor is value:
                    continue
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == local.shape:
                    value = wrap_like(param, value)
                param_state[key] = value
