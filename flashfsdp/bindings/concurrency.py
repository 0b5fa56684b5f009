"""A state-dict read from another thread while a training step runs: refused, on every rank.

A full state dict (``get_full_state_dict``, DSD's ``get_model_state_dict(full_state_dict=True)``,
``save_pretrained``) all-gathers every unit through the units' communicators. Called from a thread
while the training thread is inside a step, its all-gathers interleave with the step's: the ranks
pair different collectives (gloo aborts, or the same-model check sees garbage and blames the
model). The same-model check that opens each of these reads calls :func:`busy_error`; its error
travels in the check's exchange, so every rank refuses together.

A step is in progress from the root's forward until its backward has finished and its reductions
were waited for: a unit forwarding or in backward, an all-gather in flight, a forward whose
backward has not run, a queued end-of-backward callback, reductions still pending. The training
thread is the one that ran the last unit hook (``flight.hook_thread``). Not covered: a step that
the training thread starts after the read's check has passed (read between steps, or from the
training thread).
"""

from __future__ import annotations

import threading

from flashfsdp.runtime import flight
from flashfsdp.runtime.states import ShardState, TrainingState


def _step_in_progress(state) -> str | None:
    """What shows that ``state``'s unit is inside a step, in words, or None."""
    if state.training_state is not TrainingState.IDLE:
        return f"is in {state.training_state.value}"
    if state.unit.state is ShardState.UNSHARDING:
        return "has an all-gather in flight"
    ctx = getattr(state, "ctx", None)
    if ctx is None:
        return None
    if getattr(ctx, "forward_without_backward", False):
        return "ran a forward whose backward has not run yet"
    if getattr(ctx, "callback_task", None) is not None:
        return "is in a backward"
    if getattr(ctx, "pending", None):
        return "has reductions in flight"
    return None


def busy_error(states) -> RuntimeError | None:
    """The refusal of a state-dict read on this thread while another thread runs a step on any of
    ``states`` (see the module docstring), or None."""
    owner = flight.hook_thread()
    if owner is None or owner == threading.get_ident():
        return None
    for state in states:
        doing = _step_in_progress(state)
        if doing is not None:
            names = {t.ident: t.name for t in threading.enumerate()}
            return RuntimeError(
                f"a state dict was requested from thread '{threading.current_thread().name}' while thread "
                f"'{names.get(owner, owner)}' runs a training step (unit '{state.unit.name}' {doing}): its "
                f"all-gathers would interleave with the step's. Read state dicts between steps, from the "
                f"training thread (or have the training thread hand the reader its turn)")
    return None
