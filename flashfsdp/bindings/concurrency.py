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
thread is the one that ran the last unit hook (``flight.hook_thread``).

A full (collective) state-dict read from another thread is refused whether or not a step runs at
that moment (:func:`thread_refusal`): the training thread could start one right after any check,
and nothing holds it back. The refusal is raised on the reading thread before any collective,
by each rank on its own (every rank whose reader asks refuses; a rank whose training thread asks
proceeds, and any rank left waiting is named by the desync window). Sharded state dicts
(``module.state_dict()``, DSD's ``get_model_state_dict``) run no collective: from any thread they
hold every unit's sharded DTensors (``state_dict/sharded.py``, [Note: state dict from a reader
thread]).
"""

from __future__ import annotations

import threading

import torch.nn as nn

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


def _thread_names() -> tuple[str, str]:
    """(this thread's name, the training thread's name)."""
    owner = flight.hook_thread()
    names = {t.ident: t.name for t in threading.enumerate()}
    return threading.current_thread().name, str(names.get(owner, owner))


def _step_of(states) -> str | None:
    """"unit 'x' is in forward"-style words for the first of ``states`` inside a step, or None."""
    for state in states:
        doing = _step_in_progress(state)
        if doing is not None:
            return f"unit '{state.unit.name}' {doing}"
    return None


def _on_another_thread() -> bool:
    owner = flight.hook_thread()
    return owner is not None and owner != threading.get_ident()


def busy_error(states) -> RuntimeError | None:
    """The refusal of a state-dict read on this thread while another thread runs a step on any of
    ``states`` (see the module docstring), or None."""
    step = _step_of(states) if _on_another_thread() else None
    if step is None:
        return None
    mine, owner = _thread_names()
    return RuntimeError(
        f"a state dict was requested from thread '{mine}' while thread '{owner}' runs a training step ({step}): "
        f"its all-gathers would interleave with the step's. Read state dicts between steps, from the training "
        f"thread (or have the training thread hand the reader its turn)")


def thread_refusal(states, rank: int) -> RuntimeError | None:
    """The refusal of a full (collective) state-dict read on this thread, rank ``rank``, when
    another thread trains ``states``' model (the thread of the last unit hook), step in progress
    or not (see the module docstring), or None."""
    if not _on_another_thread():
        return None
    mine, owner = _thread_names()
    step = _step_of(states)
    now = f"runs a training step ({step})" if step is not None else "trains the model (between two steps now)"
    return RuntimeError(
        f"a full state dict was requested from thread '{mine}' while thread '{owner}' {now}, on rank {rank}: "
        f"its all-gathers would interleave with a step's, so it is refused on this thread before any "
        f"collective. Take full state dicts from the training thread, between steps (have the training "
        f"thread hand the reader its turn); a sharded state dict (module.state_dict(), get_model_state_dict "
        f"without full_state_dict) may be read from any thread")


def refuse_reader_thread(model) -> None:
    """Raise :func:`thread_refusal`'s error for ``model`` (on this thread, before any collective)
    when called from a thread other than the training thread; the full state-dict functions call
    it first.

    Raises:
        RuntimeError: see :func:`thread_refusal`.
    """
    if not _on_another_thread():
        return
    from flashfsdp.runtime.agreement import global_rank  # noqa: PLC0415

    modules = model.modules() if isinstance(model, nn.Module) else ()
    states = [m.__dict__["_flashfsdp_state"] for m in modules if "_flashfsdp_state" in m.__dict__]
    raise thread_refusal(states, global_rank())
