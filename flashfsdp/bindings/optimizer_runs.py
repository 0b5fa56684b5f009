"""What a stock element-wise optimizer's step is handed (``optimizer_local_step.py``): which groups
may be handed over, each flashfsdp parameter's local view (:class:`Param`), and the runs.

A group is handed over only if every DTensor in it is a flashfsdp sharded parameter over a plain
local tensor whose gradient and state DTensors have its placements and local shape
(:func:`param_entries`). Its parameters with their unit's own gradient and the same state age
form runs (:func:`group_runs`), the others are handed as local tensors — all of them where torch
steps the group tensor by tensor (:func:`loops_per_tensor`): that path's temporaries (Adam's
``exp_avg_sq.sqrt() / c``, ...) are as large as each tensor and the last tensor's may live on
while the next one's are made, so on a run they would be a unit's size where FSDP2's are a
parameter's; on the local tensors they are FSDP2's, tensor for tensor. The parameters of the
groups that form runs are covered by the optimizer's flat states (:func:`cover`;
``runtime/flat_runs.py``, [Note: state segments]): its state buffers span its own parameters only.
"""

from __future__ import annotations

import operator

import torch
from torch.distributed.tensor import DTensor

from flashfsdp.runtime.flat_runs import CPU_VECTOR_BYTES, FlatStates, plan_runs
from flashfsdp.runtime.param_tags import tag_of
from flashfsdp.runtime.sharding_spec import SHARDED_ATTR

# The optimizer classes whose update of a tensor is element-wise (``optimizer_local_step.py``).
ELEMENTWISE = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adagrad,
    torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD,
})
# Of those, the ones whose update of a zero gradient, value and state is not all zero (Adamax's
# exp_inf = max(beta2 * exp_inf, |g| + eps)): their runs hold no padding.
PADDING_CHANGES = frozenset({torch.optim.Adamax})


class Param:
    """One flashfsdp parameter of a handed-over group: the DTensor, its local tensor and spec, its
    state as the optimizer holds it between steps (``state[param]``, DTensors) and the same state
    over the local tensors (``local_state``, persistent from step to step), with the values the
    local state held when the two last agreed (``local_snapshot``)."""

    __slots__ = ("param", "local", "spec", "state", "local_state", "local_snapshot")

    def __init__(self, param: DTensor, local: torch.Tensor, state: dict | None, local_state: dict):
        self.param, self.local, self.spec = param, local, param._spec
        self.state, self.local_state = state, local_state
        self.local_snapshot = tuple(local_state.values())


def param_entries(params: list, state) -> list[Param] | None:
    """A :class:`Param` for each flashfsdp parameter of one group, or None where the group must
    step its DTensors (module docstring)."""
    out = []
    for param in params:
        if not isinstance(param, DTensor):
            continue
        if not getattr(param, SHARDED_ATTR, False):
            return None
        local = param._local_tensor
        if type(local) is not torch.Tensor:
            return None
        spec, grad = param._spec, param.grad
        if grad is not None and local_like(grad, spec, local) is None:
            return None
        param_state = state.get(param)
        local_state = {}
        for key, value in (param_state or {}).items():
            if isinstance(value, DTensor):
                value = local_like(value, spec, local)
                if value is None:
                    return None
            local_state[key] = value
        out.append(Param(param, local, param_state, local_state))
    return out


def local_like(tensor: torch.Tensor, spec, local: torch.Tensor) -> torch.Tensor | None:
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


def has_own_grad(param: DTensor, tag=None) -> bool:
    """Whether ``param.grad`` is the gradient DTensor its unit built over its gradient shard."""
    tag = tag or tag_of(param)
    own = None if tag is None or param.grad is None else tag.group.exposed_grads()
    return own is not None and own[1][tag.index] is param.grad


def loops_per_tensor(group: dict, members: list[Param]) -> bool:
    """Whether torch steps ``group`` tensor by tensor (its single-tensor path), as its functional
    optimizers decide: ``differentiable``; neither fused nor foreach asked for and one of them
    set False; or both left None — torch's default, foreach on CUDA-like devices only — with a
    Tensor ``lr`` not ``capturable`` (Adam's exception) or a parameter on another device than
    CUDA (a device torch may step foreach too is counted here: its group is handed its local
    tensors, as on FSDP2, at some host cost)."""
    if group.get("differentiable"):
        return True
    fused, foreach = group.get("fused"), group.get("foreach")
    if fused or foreach:
        return False
    if fused is False or foreach is False:
        return True
    return ((isinstance(group.get("lr"), torch.Tensor) and not group.get("capturable"))
            or any(e.local.device.type != "cuda" for e in members))


def cover(flat_states: FlatStates, groups: list[tuple[dict, list[Param]]]) -> None:
    """Cover the flashfsdp parameters of the handed-over ``groups`` (each a param group and its
    entries) that may form runs by ``flat_states``' segments."""
    flat_states.cover([e.param for group, members in groups if not loops_per_tensor(group, members)
                       for e in members])


def group_runs(optimizer: torch.optim.Optimizer, group: dict, members: list[Param]) -> tuple[list, list[Param]]:
    """The runs of one handed-over group, each with its parameters' entries, and the entries of
    the parameters outside them (module docstring): all of them where torch steps the group
    tensor by tensor."""
    if loops_per_tensor(group, members):
        return [], list(members)
    ages = {id(e.param): age(e) for e in members}
    ages = {i: a for i, a in ages.items() if a is not None}
    by_id = {id(e.param): e for e in members}
    runs, _ = plan_runs([by_id[i].param for i in ages], lambda p: ages[id(p)],
                        padding=type(optimizer) not in PADDING_CHANGES,
                        vector_bytes=CPU_VECTOR_BYTES if group.get("fused") else None)
    runs = [(run, [by_id[id(p)] for p in run.params]) for run in runs]
    in_runs = {id(e.param) for _, run_members in runs for e in run_members}
    return runs, [e for e in members if id(e.param) not in in_runs]


def age(e: Param) -> tuple | None:
    """What must be equal for ``e`` to join a run with its neighbour — its state's keys, the dtype
    and device of each state tensor, the values of the 0-d ones and of the others —, or None where
    it may not join one: no gradient, a gradient that is not its unit's own, a state tensor of
    another shape or device than the local tensor."""
    if not has_own_grad(e.param):
        return None
    out = []
    for key, value in e.local_state.items():
        if not isinstance(value, torch.Tensor):
            out.append((key, value))
        elif type(value) is torch.Tensor and value.dim() == 0:
            out.append((key, value.dtype, value.device, value.item()))
        elif type(value) is torch.Tensor and value.shape == e.local.shape and value.device == e.local.device:
            out.append((key, value.dtype))
        else:
            return None
    return tuple(sorted(out, key=operator.itemgetter(0)))
