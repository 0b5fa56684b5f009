"""Stock element-wise ``torch.optim`` optimizers step flashfsdp's flat shards, one tensor per run.

A sharded parameter is a DTensor (``runtime/sharding_spec.py``), as on FSDP2, so a stock optimizer
would run every one of its operations through DTensor's dispatch: per parameter and per operation
on CPU (the single-tensor loop, torch's default there), per operation and list on GPU (foreach).
For the optimizers whose update is element-wise — ``SGD``, ``Adam``, ``AdamW``, ``Adamax``,
``Adagrad``, ``Adadelta``, ``RMSprop``, ``NAdam``, ``RAdam``, ``ASGD``, exactly these classes, not
subclasses, which may override ``step`` — an update of a sharded parameter is the same update of
each rank's local chunk, and the update of consecutive chunks of one flat shard is the update of
the slice that holds them. So a global optimizer step-pre-hook hands such an optimizer, for the
step, plain tensors in place of the DTensors, and a step-post-hook puts the DTensors back:

- a **run** (``runtime/flat_runs.py``: consecutive parameters of one param group and flat shard,
  each with its unit's own gradient DTensor and the same state age — keys and 0-d values such as
  the step count) as ONE tensor, its slice of the master shard ``sharded_flat``, with ``.grad``
  the same range of the gradient shard and its state the same range of flat state buffers
  (``FlatStates``, see below). The padding between chunks is stepped too; its gradient, value and state are
  zero and stay zero, as every listed update maps zeros to zeros, except Adamax's
  ``max(|g| + eps)``: its runs hold no padding. With ``fused=True`` a run is split after every
  chunk that is not a whole number of CPU vectors (see [Note: CPU vector tails] there), since
  torch's fused CPU kernels round a tensor's scalar tail differently from its vectorised body;
- any other flashfsdp parameter (a gradient set to None or replaced by another DTensor, a state of
  another age), and every one of a group torch steps tensor by tensor (below), as its local
  tensor, with its gradient's and states' local tensors;
- a group with a DTensor that is not a flashfsdp parameter over a plain local tensor, or a
  gradient or state that is not a DTensor of the parameter's placements and local shape (a
  gradient left ``Partial`` by tensor parallelism, say, needs DTensor's redistribution), steps
  the DTensors, as does a step inside ``torch.compile`` (a compiled step traces the DTensors).

Between steps ``optimizer.state[param]`` holds what FSDP2's does: per element-wise key a DTensor
of the parameter's placements — here over the parameter's view of a flat buffer — and per
0-d key (``step``, NAdam's ``mu_product``, ASGD's ``eta`` and ``mu``) a 0-d tensor of torch's
dtype and device — here a view into a slot vector with one slot per parameter (``FlatStates``).
A run's step is handed its first parameter's slot, which torch advances; after the step one
``_foreach_copy_`` copies it into the run's other slots. A state torch creates for a run (at its
first step) becomes the flat buffer (or is copied into it) and the slots once, and the
parameters' states are pointed at their views; a state loaded or assigned between steps
(``load_state_dict``, DCP, DSD) is copied into them at the next step. ``state_dict()``, DCP and
DSD therefore read and write FSDP2's keys, types, placements and values, and the results are
FSDP2's bits: the same kernels run on the same elements with the same scalars
(``tests/bindings/test_optimizer_local_step.py``, foreach and fused where torch has them).
(``Rprop`` is element-wise too, but it raises on FSDP2's DTensors — no sharding rule for its
masked writes —, and a drop-in raises where FSDP2 raises.)

Memory is FSDP2's (``optimizer_runs.py``): a state buffer spans one *segment* of the optimizer's
own parameters in one unit, not the unit's shard (``runtime/flat_runs.py``, [Note: state
segments]), so an optimizer per parameter (stepped in a post-accumulate-grad hook) keeps state
for its parameter only. Runs go to foreach steps (all tensors' temporaries at once, FSDP2's too)
and fused ones (none); where torch steps tensor by tensor (``foreach=False``, or the default on
CPU), each tensor's temporaries are its size and may outlive it into the next tensor's, so such
a group is handed its local tensors: FSDP2's tensors, FSDP2's temporaries, and states made by
torch per parameter (DTensors over them, no flat buffers).

What a step learned is kept for the next (``_Plan``); a later step checks that nothing of it
changed (the same ``param_groups`` lists, ``state`` dict and values, local tensors, each run's
gradients its unit's own: ``GradShard.exposed_grads``) by identity over whole lists (``map`` over
``operator.is_``, in C) and swaps ``optimizer.state`` as a whole for the plan's dict keyed by the
handed tensors; anything changed builds the plan again. Checks, hand-over and put-back cost about
0.28 ms per step for 434 parameters in 49 runs (2-core AMD EPYC CPU). A step that raises leaves
the handed tensors in ``param_groups`` and the plan's dict as ``optimizer.state`` (torch runs no
post-hook then); both are put back at the start of that optimizer's next step.
"""

from __future__ import annotations

import operator
import weakref
from collections import defaultdict
from itertools import chain, repeat

import torch
from torch.distributed.tensor import DTensor

from flashfsdp._torch_private import foreach_copy_
from flashfsdp.runtime.flat_runs import FlatStates, Run
from flashfsdp.runtime.param_tags import tag_of
from flashfsdp.runtime.sharding_spec import wrap_like

from .optimizer_runs import ELEMENTWISE, Param, cover, group_runs, has_own_grad, local_like, param_entries

# optimizer -> its hand-over plan (see _Plan), kept from step to step while it holds; its plan
# while a step is in progress (handed over, not yet put back); the flat state buffers its runs'
# states live in (kept across plans)
_plans: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _Plan]" = weakref.WeakKeyDictionary()
_handed: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _Plan]" = weakref.WeakKeyDictionary()
_flat_states: "weakref.WeakKeyDictionary[torch.optim.Optimizer, FlatStates]" = weakref.WeakKeyDictionary()


class _Run:
    """One run handed over as one tensor: ``flat`` (its slice of the master shard), its flat group
    and index range ``[first, stop)``, its range ``[grad_lo, grad_hi)`` of the gradient shard, the
    positions ``[start, end)`` of its parameters in the plan's list, and its state as the step
    sees it (``state``: flat-buffer slices and its first parameter's 0-d slots), with the values
    the plan put there (``known``) and those it held when last put back (``snapshot``)."""

    __slots__ = ("run", "flat", "group", "first", "stop", "grad_lo", "grad_hi", "start", "end", "state",
                 "known", "snapshot")

    def __init__(self, run: Run, start: int, state: dict):
        tag = tag_of(run.params[0])
        self.run, self.flat, self.group, self.first = run, run.flat, tag.group, tag.index
        self.stop = self.first + len(run.params)
        self.grad_lo = run.lo + run.shift - tag.group.exposed_grads()[0].storage_offset()
        self.grad_hi = self.grad_lo + run.flat.numel()
        self.start, self.end = start, start + len(run.params)
        self.state, self.known, self.snapshot = state, dict(state), tuple(state.values())


class _Plan:
    """How one optimizer's steps are handed over (see the module docstring), built at a step and
    kept for the next ones while nothing it depends on changed (:meth:`holds`): the
    ``param_groups`` lists (the same objects, the same lengths), the optimizer's ``state`` dict and
    everything in it (the same keys, per-parameter dicts and values, by identity), each
    parameter's local tensor, and at the hand-over each run's gradients. ``optimizer.state`` is
    swapped as a whole for a dict keyed by the handed tensors.

    ``dparams`` lists the handed-over DTensor parameters, the runs' first (run by run, in index
    order), then the others (``params``); ``all_locals`` follows it, ``specs`` and ``locals`` are
    the others'."""

    __slots__ = ("groups", "lists", "lengths", "local_lists", "state", "local_state", "params", "others", "runs",
                 "dparams", "all_locals", "locals", "flats", "specs", "local_dicts", "seen", "local_seen",
                 "flat_states", "copy_to", "copy_from", "waiting")

    def __init__(self, optimizer: torch.optim.Optimizer, handed: list, flat_states: FlatStates):
        self.groups = list(optimizer.param_groups)
        self.lists = [g["params"] for g in self.groups]
        self.lengths = [len(p) for p in self.lists]
        self.state, self.flat_states = optimizer.state, flat_states
        self.copy_to, self.copy_from = [], []
        self.runs: list[_Run] = []
        members: list[Param] = []
        for _, runs, _ in handed:
            for run, entries in runs:
                self.runs.append(_Run(run, len(members), self._run_state(run, entries)))
                members += entries
        self.params = [e for _, _, entries in handed for e in entries]
        # parameters left out of runs for their gradient (None, or not their unit's own): should
        # one get its unit's own, the plan is built again to let it join a run
        self.waiting = [(e.param, tag_of(e.param)) for e in self.params if not has_own_grad(e.param)]
        self.dparams = [e.param for e in chain(members, self.params)]
        self.all_locals = [e.local for e in chain(members, self.params)]
        self.specs = [e.spec for e in self.params]
        self.locals = [e.local for e in self.params]
        self.flats = [r.flat for r in self.runs]
        self.local_lists = {id(group): _handed_list(group, runs, entries) for group, runs, entries in handed}
        handed_ids = set(map(id, self.dparams))
        # every other parameter keeps its own state, the same dict in both
        self.others = [p for g in self.lists for p in g if id(p) not in handed_ids]
        self.local_state = defaultdict(dict)
        for r in self.runs:
            self.local_state[r.flat] = r.state
        for e in self.params:
            self.local_state[e.local] = e.local_state
        for p in self.others:
            if p in self.state:
                self.local_state[p] = self.state[p]
        self.local_dicts = [r.state for r in self.runs] + [e.local_state for e in self.params]
        self.seen = _contents(self.state)
        self.local_seen = _values_of(self.local_dicts)

    def _run_state(self, run: Run, entries: list[Param]) -> dict:
        """The run's state as its step sees it, its parameters' states moved into the flat buffers
        and slots first (``FlatStates.gather``)."""
        mine, slots = self.flat_states.gather(run, [e.state for e in entries] if entries[0].state else [])
        for vector in slots:
            self._copy_slots(vector)
        return mine

    def _copy_slots(self, slots: torch.Tensor) -> None:
        """After each step, copy a run's first slot (the one its step advanced) into the others."""
        if slots.numel() > 1:
            self.copy_to.append(slots[1:])
            self.copy_from.append(slots[0].expand(slots.numel() - 1))

    def holds(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the plan still describes ``optimizer`` (see the class docstring)."""
        groups = optimizer.param_groups
        if optimizer.state is not self.state or len(groups) != len(self.groups):
            return False
        for group, mine, plist, n in zip(groups, self.groups, self.lists, self.lengths):
            if group is not mine or group["params"] is not plist or len(plist) != n:
                return False
        return (self.seen is not None and _contents(self.state) == self.seen
                and all(map(_is, map(_LOCAL, self.dparams), self.all_locals)))

    def hand_over(self, optimizer: torch.optim.Optimizer) -> bool:
        """Give the step the runs and local tensors, their gradients and states; False (nothing
        changed) where a gradient is not one the step may take as planned."""
        for param, tag in self.waiting:
            if param.grad is not None and has_own_grad(param, tag):
                return False
        grads = list(map(_GRAD, self.dparams))
        local_grads = self._local_grads(grads[len(self.dparams) - len(self.params):])
        if local_grads is None:
            return False
        run_grads = []
        for r in self.runs:  # each run's gradients its unit's own: its slice of the gradient shard
            own = r.group.exposed_grads()
            if own is None or not all(map(_is, grads[r.start : r.end], own[1][r.first : r.stop])):
                return False
            run_grads.append(own[0][r.grad_lo : r.grad_hi])
        list(map(setattr, self.flats, repeat("grad"), run_grads))
        list(map(setattr, self.locals, repeat("grad"), local_grads))
        for group in self.groups:
            local = self.local_lists.get(id(group))
            if local is not None:
                group["params"] = local
        optimizer.state = self.local_state
        return True

    def _local_grads(self, grads: list) -> list | None:
        """The local tensors of ``grads`` (the gradients of ``params``; None stays None), or None
        where one is not a DTensor of its parameter's placements and local shape."""
        try:  # every gradient the unit's own DTensor over a plain local tensor: no walk
            if all(map(_is, map(_SPEC, grads), self.specs)):
                local_grads = list(map(_LOCAL, grads))
                if all(map(_is, map(type, local_grads), repeat(torch.Tensor))):
                    return local_grads
        except AttributeError:  # a None or plain gradient
            pass
        out = []
        for grad, spec, local in zip(grads, self.specs, self.locals):
            if grad is not None:
                grad = local_like(grad, spec, local)
                if grad is None:
                    return None
            out.append(grad)
        return out

    def put_back(self, optimizer: torch.optim.Optimizer) -> None:
        """Restore ``param_groups`` and ``state``, clear the handed tensors' ``.grad``, copy each
        run's advanced 0-d states into its other parameters' slots and bring what the step created
        into the parameters' states (see :meth:`_adopt_run`, :meth:`_adopt_param`)."""
        for group, plist in zip(self.groups, self.lists):
            group["params"] = plist
        optimizer.state = state = self.state
        list(map(setattr, chain(self.flats, self.locals), repeat("grad"), repeat(None)))
        if self.copy_to:
            with torch.no_grad():
                foreach_copy_(self.copy_to, self.copy_from)
        local_state = self.local_state
        changed = _values_of(self.local_dicts) != self.local_seen
        if changed or any(p not in state and p in local_state for p in self.others):
            self._new_states_in_order(state)
            if changed:
                with torch.no_grad():
                    for r in self.runs:
                        self._adopt_run(r, state)
                for e in self.params:
                    _adopt_param(e, state)
                self.local_seen = _values_of(self.local_dicts)
            self.seen = _contents(state)

    def _new_states_in_order(self, state: dict) -> None:
        """Enter into ``state`` the parameters the step gave a state for the first time, in the
        order of ``param_groups`` (torch's, which ``state_dict()`` lists): a state made for a
        parameter not handed over as it is, an empty dict that :meth:`_adopt_run` and
        :func:`_adopt_param` fill for the others."""
        fresh = {}
        for r in self.runs:
            if r.state:
                fresh.update((id(p), None) for p in r.run.params)
        fresh.update((id(e.param), None) for e in self.params if e.local_state)
        fresh.update((id(p), self.local_state[p]) for p in self.others if p in self.local_state)
        for plist in self.lists:
            for p in plist:
                if id(p) in fresh and p not in state:
                    value = fresh[id(p)]
                    state[p] = {} if value is None else value

    def _adopt_run(self, r: _Run, state: dict) -> None:
        """Move what the step created or replaced in a run's state into the flat buffers and slots
        and point its parameters' states at their views (``FlatStates.scatter``: values copied once)."""
        mine = r.state
        if len(mine) == len(r.snapshot) and all(map(_is, mine.values(), r.snapshot)):
            return
        states = [state[p] for p in r.run.params]
        for key, value in list(mine.items()):
            if r.known.get(key) is not value:
                mine[key], slots = self.flat_states.scatter(r.run, key, value, states)
                r.known[key] = mine[key]
                if slots is not None:
                    self._copy_slots(slots)
        r.snapshot = tuple(mine.values())


def _adopt_param(e: Param, state: dict) -> None:
    """Bring what the step changed in a parameter's local state into its state (new state tensors
    wrapped as DTensors of the parameter's placements)."""
    mine = e.local_state
    if len(mine) == len(e.local_snapshot) and all(map(_is, mine.values(), e.local_snapshot)):
        return
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


def _handed_list(group: dict, runs: list, entries: list[Param]) -> list:
    """What the step sees as ``group["params"]``: each run's flat tensor where its first parameter
    is, the local tensor of every other flashfsdp parameter, the rest as it is."""
    by_id = {id(e.param): e.local for e in entries}
    for run, _ in runs:
        by_id[id(run.params[0])] = run.flat
        by_id.update((id(p), None) for p in run.params[1:])
    return [t for t in (by_id.get(id(p), p) for p in group["params"]) if t is not None]


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


def restore(optimizer: torch.optim.Optimizer) -> None:
    """Before any step of ``optimizer``: put back what its last step left handed over (it raised,
    so torch ran no post-hook); nothing otherwise."""
    plan = _handed.pop(optimizer, None)
    if plan is not None:
        plan.put_back(optimizer)


def pre_step(optimizer: torch.optim.Optimizer) -> None:
    """Before the step of an optimizer holding flashfsdp's parameters (``optimizer_hooks.py``,
    after :func:`restore`): hand over the runs of its plan (built again where it no longer holds)."""
    if type(optimizer) not in ELEMENTWISE or torch.compiler.is_compiling():
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
    else:  # a gradient that is not as planned (a Partial TP gradient, one replaced): build again
        _plans.pop(optimizer, None)
        plan = _build(optimizer)
        if plan is not None and plan.hand_over(optimizer):
            _handed[optimizer] = plan


def _build(optimizer: torch.optim.Optimizer) -> _Plan | None:
    """The plan of ``optimizer`` now, or None where no group can be handed over."""
    groups = []
    for group in optimizer.param_groups:
        members = param_entries(group["params"], optimizer.state)
        if members:
            groups.append((group, members))
    if not groups:
        return None
    flat_states = _flat_states.get(optimizer)
    if flat_states is None:
        flat_states = _flat_states[optimizer] = FlatStates()
    cover(flat_states, groups)
    handed = [(group, *group_runs(optimizer, group, members)) for group, members in groups]
    with torch.no_grad():  # (states copied into the flat buffers)
        return _Plan(optimizer, handed, flat_states)


def post_step(optimizer: torch.optim.Optimizer) -> None:
    """After ``optimizer``'s step: put back what :func:`pre_step` handed over."""
    plan = _handed.pop(optimizer, None)
    if plan is not None:
        plan.put_back(optimizer)
