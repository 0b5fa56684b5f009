"""The backward check: every rank reduces the same units in a backward, checked before the first wait.

A rank whose backward runs over other units than the others' (a unit skipped on one rank, a
branch taken on one rank only), or whose ``set_requires_gradient_sync`` differs, issues other
reduce-scatters: gloo pairs collectives of different units (of equal sizes: wrong gradients
without a sign; of unequal ones: an abort) or waits until its timeout, NCCL hangs. So at the start
of a step's backward, before any of its collectives is issued,
:func:`check_backward_units` exchanges one bit mask per communicator (per unit: does its backward
run here, does it synchronise gradients) over the communicator's control group
(``flashfsdp.runtime.control``) the first time the root's units show a combination of
``requires_gradient_sync`` flags on this rank (its first step, and each new combination after),
and every rank raises the same error naming the first unit and the ranks that differ. A
combination checked once is not exchanged again: gradient accumulation switches the flags back
and forth each step (off for the micro-batches, on for the last; torch's pipelining twice per
step), and those steps cost nothing after the first (one set lookup).

Called by ``RootContext.check_backward`` (``root.py``) once per step, at the backward's first
hook (a unit's pre-backward, else its first reduction), before any collective of the backward,
with ``running`` the units whose forward ran with grad in this step (the step protocol's
``forward_with_grad``). A rank that changes ``set_requires_gradient_sync`` alone checks alone: the
others are in their backward's collectives by then, and the timeout's diagnosis names both
(the control exchange of the backward check on one rank, an all-gather or reduce-scatter on the other).
"""

from __future__ import annotations

import weakref
from typing import Sequence

from flashfsdp.runtime import control, flight

_checked: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # root -> the sync flags checked


def needs_check(root, states: Sequence) -> bool:
    """Whether :func:`check_backward_units` would exchange: the units' ``requires_gradient_sync``
    flags form a combination not checked yet for this root (its first check included)."""
    return tuple(bool(s.requires_gradient_sync) for s in states) not in _checked.get(root, ())


def check_backward_units(root, states: Sequence, running: Sequence) -> None:
    """Collective over the control group of each communicator of ``states``, when
    :func:`needs_check` (see the module docstring): raise on every rank unless every rank runs the
    backward of the same units with the same gradient synchronisation.

    Args:
        root: the root whose step this is (the first check is per root).
        states: every unit under the root (FSDPStates), in the same order on every rank.
        running: the states whose backward runs in this step.

    Raises:
        ValueError: the masks differ; names the first unit, what differs and the ranks (on every rank).
        control.ControlMismatch: a rank is in another operation (e.g. another step).
    """
    flags = tuple(bool(s.requires_gradient_sync) for s in states)
    seen = _checked.setdefault(root, set())
    if flags in seen:
        return
    seen.add(flags)
    running_ids = {id(s) for s in running}
    by_comm: dict[int, list] = {}
    for state in states:
        if state.unit.comm.world_size > 1:
            by_comm.setdefault(id(state.unit.comm), []).append(state)
    operation = f"the backward check (step {flight.step()})"
    for group_states in by_comm.values():
        mask = [(id(s) in running_ids, bool(s.requires_gradient_sync)) for s in group_states]
        everyone = control.exchange(control.for_comm(group_states[0].unit.comm), operation, mask)
        if any(theirs != everyone[0] for theirs in everyone[1:]):
            raise ValueError(_describe(group_states, everyone))


def _describe(states: Sequence, masks: list[list[tuple[bool, bool]]]) -> str:
    """The first unit whose (backward runs, gradient sync) differs between rank 0 and another rank."""
    def words(bits: tuple[bool, bool]) -> str:
        runs, sync = bits
        return ("runs its backward" if runs else "has no backward") + (
            ", requires_gradient_sync=True" if sync else ", requires_gradient_sync=False")

    for rank, theirs in enumerate(masks[1:], start=1):
        for state, ours, other in zip(states, masks[0], theirs):
            if ours != other:
                return (f"the ranks' backwards differ: unit '{state.unit.name}' {words(other)} on rank {rank} but "
                        f"{words(ours)} on rank 0; every rank must run the backward of the same units, with the same "
                        f"set_requires_gradient_sync, in each step (otherwise their reduce-scatters do not match)")
    return "the ranks' backwards differ (no single unit found)"
