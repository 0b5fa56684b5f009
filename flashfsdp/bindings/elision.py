"""Backward all-gather elision for fully_shard'ed units: on by default, exact, automatic.

A unit whose backward reads none of its unsharded parameters (an embedding; a linear layer whose
input requires no gradient) skips the all-gather before its backward, and backward prefetch skips
it too; its gradients are still reduce-scattered (``flashfsdp.runtime.elision`` explains why that
is exact and how the saved tensors are watched). Per unit and per backward:

- Each forward of the unit with grad enabled, outside backward, runs under a watch of the tensors
  autograd saves, from the unit's pre-forward to the end of its post-forward hooks (user forward
  pre-hooks and the hooks of its submodules included). Only units that reshard after forward are
  watched: the others are not all-gathered in backward anyway.
- A forward that cannot be watched counts as reading the parameters: under other saved-tensor
  hooks (a non-reentrant ``torch.utils.checkpoint`` around the unit, ``save_on_cpu``), inside a
  ``torch.func`` transform or ``torch.compile``, or when the unit holds a module that recomputes
  activations in backward (``checkpoint_wrapper``, the composable ``checkpoint``, a module with
  ``gradient_checkpointing = True`` as Hugging Face sets it): recomputation re-runs forward code
  that reads the weights. A unit whose forward runs inside a reentrant checkpoint has no backward
  of its own (its recomputed forward unshards it).
- The backward all-gather is skipped when at least one forward since the last backward ended was
  watched and none saved a tensor overlapping the unit's unsharded buffers; one that did makes
  that backward gather as before (the next one decides afresh). A unit told to keep its
  parameters after backward (``set_reshard_after_backward(False)``) gathers them as before.

Limits, all raising rather than computing wrong values: a weight kept for backward outside
``ctx.save_for_backward`` (a ``ctx`` attribute, a closure of a tensor hook) or read in a module's
backward hook is read from freed storage or gets the sharded piece; ``torch.utils.checkpoint``
called on a plain function (not a module) inside the unit's forward is not detected. Turn it off
for such a model with ``FSDPModule.set_backward_all_gather_elision(False)``, or for every unit
built afterwards with the environment variable ``FLASHFSDP_BACKWARD_ALL_GATHER_ELISION=0``.

Under an active ``flashfsdp.profile()`` each skipped all-gather adds its bytes (the unsharded
buffers') to the counter ``backward_all_gather_bytes_elided``.
"""

from __future__ import annotations

import os

import torch
import torch.nn as nn

from flashfsdp._torch_private import REGISTRY_KEY, ActivationWrapper
from flashfsdp.runtime import trace
from flashfsdp.runtime.elision import (BackwardNeeds, SavedTensorWatch, buffer_ranges, start_watch, stop_watch,
                                       watch_possible)
from flashfsdp.runtime.quantized_gather import all_gather_nbytes
from flashfsdp.runtime.states import ShardState

from .autograd import functorch_active, in_backward


ENV_VAR = "FLASHFSDP_BACKWARD_ALL_GATHER_ELISION"
ELIDED_COUNTER = "backward_all_gather_bytes_elided"
_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def default_enabled() -> bool:
    """Elision for newly built units: on unless ``FLASHFSDP_BACKWARD_ALL_GATHER_ELISION`` is 0.

    Raises:
        ValueError: the variable holds something else than 1/0, true/false, on/off, yes/no.
    """
    value = os.environ.get(ENV_VAR, "1").strip().lower()
    if value not in _ON + _OFF:
        raise ValueError(f"{ENV_VAR}={os.environ[ENV_VAR]!r}: set it to 1 (elide, the default) or 0 (always all-gather)")
    return value in _ON


# A unit whose watched forward saved a parameter reads it again in most forwards after: the next
# RECHECK_AFTER forwards whose inputs need gradients as the watched one's did are taken as reading
# it without a watch (the unit all-gathers for backward, as a watch that finds a read decides), so
# that the watch's per-tensor hooks cost nothing there. Inputs that change whether they need
# gradients (what decides whether a linear layer's backward reads its weight) are watched again.
RECHECK_AFTER = 8


class UnitElision:
    """One unit's elision state (``FSDPState.elision``): the switch, the forwards' record, the
    watch of the forward in progress, and how many forwards still go unwatched after a watch found
    a parameter read (:data:`RECHECK_AFTER`)."""

    __slots__ = ("enabled", "needs", "watch", "unwatched", "inputs_need_grad")

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.needs = BackwardNeeds()
        self.watch: SavedTensorWatch | None = None
        self.unwatched = 0
        self.inputs_need_grad = False  # of the forward watched last


def attach(state: "FSDPState") -> None:
    """Give ``state`` its elision state, and each of its modules a forward hook that ends the
    watch even when the forward raises (``always_call``)."""
    state.elision = UnitElision(default_enabled())
    hook = torch.compiler.disable(lambda module, args, output: end_forward(state))
    for module in state.modules:
        state.hook_handles.append(module.register_forward_hook(hook, always_call=True))


def set_enabled(state: "FSDPState", enabled: bool) -> None:
    """``FSDPModule.set_backward_all_gather_elision``: turning it off drops the current record."""
    state.elision.enabled = enabled
    state.elision.needs.reset()
    state.elision.unwatched = 0


def _recomputes(module: nn.Module) -> bool:
    """Whether ``module`` re-runs its forward in backward (activation checkpointing): torch's
    checkpoint wrapper, the composable ``checkpoint``, or transformers' ``gradient_checkpointing``
    flag (which can be switched on at any time, so it is read at every forward). Read from the
    instance's ``__dict__`` (then the class), not through ``nn.Module.__getattr__``: this runs for
    every module of every unit at every forward."""
    attributes = module.__dict__
    flag = attributes.get("gradient_checkpointing", getattr(type(module), "gradient_checkpointing", False))
    return flag is True or isinstance(module, ActivationWrapper) or "checkpoint" in (attributes.get(REGISTRY_KEY) or ())


def recomputes_inside(state: "FSDPState") -> bool:
    """Whether a module of the unit (not of a unit nested in it) recomputes its forward in backward."""
    stack = list(state.modules)
    while stack:
        module = stack.pop()
        if _recomputes(module):
            return True
        for child in module.__dict__["_modules"].values():
            if child is not None and child.__dict__.get("_flashfsdp_state") in (None, state):
                stack.append(child)
    return False


def begin_forward(state: "FSDPState", inputs_need_grad: bool = True) -> None:
    """The unit's pre-forward (not during backward), its parameters unsharded: watch the forward
    (``inputs_need_grad``: whether any forward input requires grad)."""
    el = state.elision
    if state.is_root:
        for other in state.ctx.states:  # watches a forward that raised left open
            _close(other, found=True)
    if el.watch is not None or not el.enabled or not state.reshards_after_forward() or not torch.is_grad_enabled():
        return
    if el.unwatched and inputs_need_grad == el.inputs_need_grad:
        el.unwatched -= 1  # its last watch found a parameter read: taken as reading one (it gathers)
        el.needs.record(None)
        return
    # a unit with all-gather extensions: what its forward saves lies outside the flat buffers
    if (functorch_active() or torch.compiler.is_compiling() or not watch_possible() or recomputes_inside(state)
            or state.unit.extensions):
        el.needs.record(None)
        return
    el.unwatched, el.inputs_need_grad = 0, inputs_need_grad
    el.watch = start_watch(buffer_ranges([group.unsharded_flat for group in state.unit.groups]))


def end_forward(state: "FSDPState") -> None:
    """After the unit's post-forward (always called): end the watch once the unit's forward is over
    (every module of a grouped unit ran); the root ends those of grouped units given up on."""
    if not state._pending_forward:
        _close(state)
    if state.is_root:
        for other in state.ctx.states:
            if not other._pending_forward:
                _close(other)


def _close(state: "FSDPState", found: bool = False) -> None:
    watch = state.elision.watch
    if watch is not None:
        stop_watch(watch)
        watch.found |= found
        state.elision.needs.record(watch)
        state.elision.watch = None
        state.elision.unwatched = RECHECK_AFTER if watch.found else 0


def end_backward(state: "FSDPState") -> None:
    """A backward ended: the next forwards decide the next backward."""
    state.elision.needs.reset()


def elides(state: "FSDPState") -> bool:
    """Whether the unit's next backward runs without its unsharded parameters (not for a unit told
    to keep them after backward, ``set_reshard_after_backward(False)``: it is gathered for that)."""
    return state.elision.enabled and state.settings.reshard_after_backward and state.elision.needs.elidable()


def _gathered_bytes(state: "FSDPState") -> int:
    """Bytes one all-gather of the unit writes: its unsharded buffers (padding included), or with
    ``all_gather_dtype=torch.int8`` the packed int8 chunks and their scales; a gather from a
    post-forward (secondary) sharding moves ``param_dtype`` values (see ``quantized_gather.py``)."""
    unit = state.unit
    return all_gather_nbytes(unit.groups, None if unit.state is ShardState.SECONDARY else unit.all_gather_dtype)


def count_unshard(state: "FSDPState") -> None:
    """Before ``state`` unshards: under a profile, add the bytes its all-gather will write to the
    counter ``all_gather_bytes_backward`` (in backward: pre-backward, backward prefetch,
    recomputation) or ``all_gather_bytes_forward``."""
    if trace.active() is not None and state.unit.state in (ShardState.SHARDED, ShardState.SECONDARY):
        kind = "backward" if in_backward() else "forward"
        trace.count(f"all_gather_bytes_{kind}", state.unit.name, _gathered_bytes(state))


def skip_backward_unshard(state: "FSDPState") -> bool:
    """The unit's pre-backward: True (counting the bytes saved) if it is sharded and elides."""
    if state.unit.state not in (ShardState.SHARDED, ShardState.SECONDARY) or not elides(state):
        return False
    trace.count(ELIDED_COUNTER, state.unit.name, _gathered_bytes(state))
    return True


def needs_backward_unshard(state: "FSDPState") -> bool:
    """Whether backward prefetch should unshard the unit (``set_unshard_in_backward(False)`` and
    elision both say no, as FSDP2 skips prefetching a unit that does not unshard in backward)."""
    return state.settings.unshard_in_backward and not elides(state)
