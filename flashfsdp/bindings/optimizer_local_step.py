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

What the first step learned is kept for the next (``_Plan``): which parameters are handed over,
their local tensors, and their states over the local tensors; a later step checks that nothing of
it changed (the same ``param_groups`` lists, ``state`` dict, local tensors and state values) and
swaps ``optimizer.state`` as a whole for the plan's dict keyed by the local tensors. The checks
compare whole lists by identity in C (``map`` over ``operator.is_``), so a step costs, per
handed-over parameter, reading its ``.grad`` and setting and clearing the local tensor's — about
1 µs on a 2-core AMD EPYC CPU (0.43 ms for 434 parameters); anything changed builds the plan again.

A step that raises leaves the local tensors in ``param_groups`` and the plan's dict as
``optimizer.state`` (torch runs no post-hook then); both are put back at the start of that
optimizer's next step.
"""

from __future__ import annotations

import operator
import weakref
from collections import defaultdict
from itertools import chain, repeat

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from flashfsdp.runtime.sharding_spec import SHARDED_ATTR, wrap_like

# The optimizer classes whose update of a tensor is element-wise (see the module docstring).
_ELEMENTWISE = frozenset({
    torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.Adagrad,
    torch.optim.Adadelta, torch.optim.RMSprop, torch.optim.NAdam, torch.optim.RAdam, torch.optim.ASGD,
})
# optimizer -> its hand-over plan (see _Plan), kept from step to step while it holds
_plans: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _Plan]" = weakref.WeakKeyDictionary()
# optimizer -> its plan, while a step is in progress (handed over, not yet put back)
_handed: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _Plan]" = weakref.WeakKeyDictionary()
_handles: tuple = ()


class _Param:
    """One handed-over parameter: the DTensor, its local tensor and spec, its state as the
    optimizer holds it between steps (``state[param]``, DTensors) and the same state over the local
    tensors (``local_state``, persistent from step to step), with the values the local state held
    when the two last agreed (``local_snapshot``)."""

    __slots__ = ("param", "local", "spec", "state", "local_state", "local_snapshot")

    def __init__(self, param: DTensor, local: torch.Tensor, state: dict | None, local_state: dict):
        self.param, self.local, self.spec = param, local, param._spec
        self.state, self.local_state = state, local_state
        self.local_snapshot = tuple(local_state.values())


class _Plan:
    """How one optimizer's steps are handed over (see the module docstring), built at a step and
    kept for the next ones while nothing it depends on changed (:meth:`holds`): the
    ``param_groups`` lists (the same objects, the same lengths), the optimizer's ``state`` dict and
    everything in it (the same keys, per-parameter dicts and values, by identity), each
    parameter's local tensor. ``optimizer.state`` is swapped as a whole for a dict keyed by the
    local tensors.

    The checks and hand-overs of a step that changes nothing run as comparisons by identity over
    whole lists (``map`` with ``operator.is_``, ``attrgetter``), in C rather than a Python loop per
    parameter; only a step that changes something (the first, a new state, a gradient that is not
    the unit's own) walks the parameters one by one."""

    __slots__ = ("groups", "lists", "lengths", "local_lists", "state", "local_state", "params", "others",
                 "dparams", "locals", "specs", "local_dicts", "seen", "local_seen")

    def __init__(self, optimizer: torch.optim.Optimizer, handed: list[tuple[dict, list[_Param]]]):
        self.groups = list(optimizer.param_groups)
        self.lists = [g["params"] for g in self.groups]
        self.lengths = [len(p) for p in self.lists]
        self.state = optimizer.state
        self.params = [entry for _, entries in handed for entry in entries]
        self.dparams = [e.param for e in self.params]
        self.locals = [e.local for e in self.params]
        self.specs = [e.spec for e in self.params]
        handed_ids = {id(e.param) for e in self.params}
        self.local_lists = {}
        for group, entries in handed:
            by_id = {id(e.param): e.local for e in entries}
            self.local_lists[id(group)] = [by_id.get(id(p), p) for p in group["params"]]
        # every other parameter keeps its own state, the same dict in both
        self.others = [p for g in self.lists for p in g if id(p) not in handed_ids]
        self.local_state = defaultdict(dict)
        for e in self.params:
            self.local_state[e.local] = e.local_state
        for p in self.others:
            if p in self.state:
                self.local_state[p] = self.state[p]
        self.local_dicts = [e.local_state for e in self.params]
        self.seen = _contents(self.state)
        self.local_seen = _values_of(self.local_dicts)

    def holds(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the plan still describes ``optimizer`` (see the class docstring)."""
        groups = optimizer.param_groups
        if optimizer.state is not self.state or len(groups) != len(self.groups):
            return False
        for group, mine, plist, n in zip(groups, self.groups, self.lists, self.lengths):
            if group is not mine or group["params"] is not plist or len(plist) != n:
                return False
        return (self.seen is not None and _contents(self.state) == self.seen
                and all(map(_is, map(_LOCAL, self.dparams), self.locals)))

    def hand_over(self, optimizer: torch.optim.Optimizer) -> bool:
        """Give the step the local tensors, their gradients and states; False (nothing changed)
        where a gradient is not one the step may take as a local tensor."""
        grads = list(map(_GRAD, self.dparams))
        try:  # every gradient the unit's own DTensor over a plain local tensor: no walk
            fast = all(map(_is, map(_SPEC, grads), self.specs))
        except AttributeError:  # a None or plain gradient
            fast = False
        if fast:
            grads = list(map(_LOCAL, grads))
            fast = all(map(_is, map(type, grads), repeat(torch.Tensor)))
        if not fast:
            locals_ = []
            for grad, e in zip(grads, self.params):
                if grad is not None:
                    grad = _local_like(grad, e.spec, e.local)
                    if grad is None:
                        return False
                locals_.append(grad)
            grads = locals_
        list(map(setattr, self.locals, repeat("grad"), grads))
        for group in self.groups:
            local = self.local_lists.get(id(group))
            if local is not None:
                group["params"] = local
        optimizer.state = self.local_state
        return True

    def put_back(self, optimizer: torch.optim.Optimizer) -> None:
        """Restore ``param_groups`` and ``state``, clear the local tensors' ``.grad`` and bring
        what the step changed in the local states back into the parameters' states (new state
        tensors wrapped as DTensors of the parameter's placements)."""
        for group, plist in zip(self.groups, self.lists):
            group["params"] = plist
        optimizer.state = state = self.state
        list(map(setattr, self.locals, repeat("grad"), repeat(None)))
        changed = False
        local_state = self.local_state
        for p in self.others:  # a state the step created for a parameter not handed over
            if p not in state and p in local_state:
                state[p] = local_state[p]
                changed = True
        if _values_of(self.local_dicts) != self.local_seen:
            changed = True
            for e in self.params:
                mine = e.local_state
                if len(mine) == len(e.local_snapshot) and all(map(_is, mine.values(), e.local_snapshot)):
                    continue
                if e.state is None:
                    e.state = state[e.param]
                for key, value in mine.items():
                    old = e.state.get(key)
                    if isinstance(old, DTensor) and old._local_tensor is value:
                        continue
                    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == e.local.shape:
                        value = wrap_like(e.param, value)
                    e.state[key] = value
                e.local_snapshot = tuple(mine.values())
            self.local_seen = _values_of(self.local_dicts)
        if changed:
            self.seen = _contents(state)


_is = operator.is_
_LOCAL = operator.attrgetter("_local_tensor")
_SPEC = operator.attrgetter("_spec")
_GRAD = operator.attrgetter("grad")


class _Same:
    """A list compared by identity of its items (``==`` never calls the items' ``__eq__``:
    tensors compare element-wise), with the lengths of the dicts it was flattened from."""

    __slots__ = ("items", "lengths")

    def __init__(self, items: list, lengths: list[int]):
        self.items, self.lengths = items, lengths

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, _Same) and self.lengths == other.lengths and len(self.items) == len(other.items)
                and all(map(_is, self.items, other.items)))

    __hash__ = None


def _values_of(dicts: list[dict]) -> _Same:
    """The values of ``dicts`` in order, as one list compared by identity."""
    return _Same(list(chain.from_iterable(map(dict.values, dicts))), list(map(len, dicts)))


def _contents(state: dict) -> _Same | None:
    """What an optimizer's ``state`` holds (its keys, per-parameter dicts and their values) as
    one list compared by identity; None where a per-parameter state is not a dict (a plan that
    holds such a state is rebuilt at every step)."""
    inner = list(state.values())
    try:
        values = _values_of(inner)
    except TypeError:
        return None
    return _Same(list(state) + inner + values.items, values.lengths)


def register_optimizer_local_step() -> None:
    """Register (once per process) the step pre- and post-hooks described in the module docstring."""
    global _handles
    if not _handles:
        _handles = (register_optimizer_step_pre_hook(_pre_step), register_optimizer_step_post_hook(_post_step))


def _pre_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    plan = _handed.pop(optimizer, None)
    if plan is not None:  # its last step raised: put its parameters back first
        plan.put_back(optimizer)
    if type(optimizer) not in _ELEMENTWISE or torch.compiler.is_compiling():
        return
    plan = _plans.get(optimizer)
    if plan is None or not plan.holds(optimizer):
        plan = _build(optimizer)
        if plan is None:
            _plans.pop(optimizer, None)
            return
        _plans[optimizer] = plan
    if plan.hand_over(optimizer):
        _handed[optimizer] = plan
    else:  # a gradient the step must take as a DTensor (a Partial TP gradient, say): build again
        _plans.pop(optimizer, None)
        plan = _build(optimizer)
        if plan is not None and plan.hand_over(optimizer):
            _handed[optimizer] = plan


def _build(optimizer: torch.optim.Optimizer) -> _Plan | None:
    """The plan of ``optimizer`` now, or None where no group can be handed over."""
    handed = []
    for group in optimizer.param_groups:
        entries = _entries(group["params"], optimizer.state)
        if entries:
            handed.append((group, entries))
    return _Plan(optimizer, handed) if handed else None


def _entries(params: list, state) -> list[_Param] | None:
    """A :class:`_Param` for each flashfsdp parameter of one group, or None where the group must
    step its DTensors (module docstring)."""
    entries = []
    for param in params:
        if not isinstance(param, DTensor):
            continue
        if not getattr(param, SHARDED_ATTR, False):
            return None
        local = param._local_tensor
        if type(local) is not torch.Tensor:
            return None
        spec = param._spec
        grad = param.grad
        if grad is not None and _local_like(grad, spec, local) is None:
            return None
        param_state = state.get(param)
        local_state = {}
        for key, value in (param_state or {}).items():
            if isinstance(value, DTensor):
                value = _local_like(value, spec, local)
                if value is None:
                    return None
            local_state[key] = value
        entries.append(_Param(param, local, param_state, local_state))
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
    plan = _handed.pop(optimizer, None)
    if plan is not None:
        plan.put_back(optimizer)
