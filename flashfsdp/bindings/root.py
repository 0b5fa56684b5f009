"""RootContext: what every unit under one root shares during a step, and the root's own work.

The first forward makes the outermost fully_shard'ed module above the running one the root
(:func:`init_root`): its RootContext holds the execution order and prefetch policy of every unit
below it, the reductions in flight and the prefetched units. The root's pre-forward starts each
step (:meth:`RootContext.start_step`); whichever unit's backward starts first queues
:meth:`RootContext.end_backward` on the autograd engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from flashfsdp.runtime import trace
from flashfsdp.runtime.schedule import ExecutionOrder, PrefetchPolicy
from flashfsdp.runtime.unit import PendingReduce

from .optimizer_check import register_optimizer_check
from .structure import check_same_structure
from .tree import map_tensors

if TYPE_CHECKING:
    from .state import FSDPState


@dataclass
class RootContext:
    """What every unit under one root shares during a step."""

    root: "FSDPState"
    states: list["FSDPState"]
    order: ExecutionOrder = field(default_factory=ExecutionOrder)
    policy: PrefetchPolicy = field(default_factory=PrefetchPolicy)
    pending: list[PendingReduce] = field(default_factory=list)
    prefetched: set = field(default_factory=set)
    callback_task: int | None = None  # the backward whose final callback is queued
    is_last_backward: bool = True  # FSDPModule.set_is_last_backward
    forward_without_backward: bool = False  # a grad-enabled forward whose backward has not run

    def finish_pending(self) -> None:
        """Wait for every reduce-scatter in flight and accumulate its result."""
        pending, self.pending = self.pending, []
        for p in pending:
            p.finish()

    def start_step(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The root's pre-forward: finish the last step's reductions, gather again what went stale,
        free unused gradient shards, and forget a forward without backward."""
        ctx = self  # (the root's context)
        ctx.finish_pending()
        ctx.order.start_step()
        for state in ctx.states:
            if ctx.forward_without_backward:
                state.gate.forget_inputs()  # the last forward's graph had no backward
            if state.unit.gathered_is_stale():
                state.reshard()  # an optimizer step or a load since it was gathered: gather again
            if any(group.sharded_grad is not None for group in state.unit.groups):
                # a reduce-scatter-stream block the optimizer read on the compute stream: order
                # its owner first (see [Note: memory safety without record_stream] in streams.py)
                state.unit.streams.order_after_current(state.unit.streams.reduce_scatter)
            for group in state.unit.groups:
                group.release_unused_grad()
        ctx.forward_without_backward = torch.is_grad_enabled()
        if trace.active() is not None:
            trace.active().next_step()
        device = self.root.unit.device
        if device.type not in ("cpu", "meta"):
            # FSDP2's root moves the forward inputs to its device.
            args, kwargs = map_tensors(lambda t: t.to(device, non_blocking=True), (args, kwargs))
        return args, kwargs

    def reset_iter_state(self) -> None:
        """Drop a step that an exception aborted (see ``FSDPModule.reset_iter_state``)."""
        ctx = self
        for state in ctx.states:
            state.reshard()  # waits for an all-gather in flight first
            state._end_backward_bookkeeping()
            state._pending_forward = set()
            for group in state.unit.groups:
                group.unsharded_accum = None
                group.accum_had_grad = [False] * len(group.accum_had_grad)
                for p in group.unsharded_params:
                    p.grad = None
        for p in ctx.pending:
            p.work.wait()
        ctx.pending = []
        ctx.prefetched.clear()
        ctx.callback_task = None
        ctx.forward_without_backward = False
        ctx.order.start_step()

    def end_backward(self) -> None:
        """The final callback of every backward (queued by whichever unit's backward starts first):
        finish the units whose post-backward did not run, reshard what should be, and wait for
        the reductions (unless ``set_is_last_backward(False)``)."""
        ctx = self
        for state in ctx.states:
            if state.needs_post_backward():
                state._reduce_grads()
                state._finish_backward()
            if state.should_reshard_at_end():
                state.reshard()
            state._end_backward_bookkeeping()
        ctx.callback_task = None
        ctx.forward_without_backward = False
        if not ctx.is_last_backward:
            # set_is_last_backward(False): the reductions finish at the next root forward, and a
            # unit prefetched for a backward that did not need it stays for the next backward.
            return
        for state in list(ctx.prefetched):
            state.reshard()
        ctx.finish_pending()
        streams = self.root.unit.streams
        streams.wait_for_reduce_scatter(self.root.unit.name)
        streams.release_held()


def init_root(self: "FSDPState") -> None:
    """Make state ``self`` the root of every state in its module's subtree (lazy init).

    Collective over the units' communicators (once per unit and process): the units must be
    the same on every rank (``structure.py``). Registers the check of optimizers built before
    ``fully_shard`` (``optimizer_check.py``).

    Raises:
        ValueError: ``set_max_inflight_all_gathers`` was called on a module of the subtree
            other than this root (only the root's limit is used); or this root is a group of
            several modules (a root must be one module, as in FSDP2); or the units differ across
            ranks (raised on every rank, naming the first difference).
    """
    states: list["FSDPState"] = []
    for m in self.module.modules():
        state = m.__dict__.get("_flashfsdp_state")
        if state is not None and state not in states:
            states.append(state)
    names = {id(m): n for n, m in self.module.named_modules()}
    try:
        _check_root(self, states, names)
        error = None
    except ValueError as exc:
        error = exc
    for state in states:
        state.unit.name = "+".join(names.get(id(m), "?") for m in state.modules) or "<root>"
    # Before any all-gather (a model that differs by rank would abort it); a refused setting on
    # one rank alone is raised on every rank.
    check_same_structure(states, error)
    register_optimizer_check()
    ctx = RootContext(root=self, states=states, policy=PrefetchPolicy(max_inflight=self.max_inflight),
                      is_last_backward=self.is_last_backward)
    for state in states:
        state.ctx = ctx
    # Backward starts with the root's parameters: keep them after forward, unless told
    # otherwise explicitly (FSDP2 does the same for reshard_after_forward=None).
    if not self.reshard_explicit:
        self.reshard_after_forward = False


def _check_root(self: "FSDPState", states: list["FSDPState"], names: dict[int, str]) -> None:
    """The local checks of :func:`init_root` (see its Raises)."""
    if len(self.modules) > 1:
        raise ValueError(
            f"fully_shard: the unit of the modules {[type(m).__name__ for m in self.modules]} has no "
            f"fully_shard'ed parent, so it would be the root, and a root must be one module: call "
            f"fully_shard on a module that contains them all"
        )
    for state in states:
        if state is not self and state.max_inflight_set:
            raise ValueError(
                f"set_max_inflight_all_gathers was called on '{names[id(state.module)]}' "
                f"({state.class_name}), which is not the root: only the root's limit is used; "
                f"call it on the root module ({self.class_name}) instead"
            )
