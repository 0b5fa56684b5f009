"""RootContext: what every unit under one root shares during a step, and the root's own work.

The first forward makes the outermost fully_shard'ed module above the running one the root
(:func:`init_root`): its RootContext holds the step protocol of every unit below it
(``runtime/step.py``: execution order, prefetch policy, which unshard, reshard, prefetch and
reduction happen when), executes its actions on the units' tensors (it is the protocol's
:class:`~flashfsdp.runtime.step.StepExecutor`), and holds the reductions in flight. The root's
pre-forward starts each step (:meth:`RootContext.start_step`); whichever unit's backward starts
first queues :meth:`RootContext.end_backward` on the autograd engine.
"""

from __future__ import annotations

import operator

import torch

from flashfsdp.runtime import bucket, trace
from flashfsdp.runtime.env import count_from_env
from flashfsdp.runtime.schedule import PrefetchPolicy
from flashfsdp.runtime.states import ShardState
from flashfsdp.runtime.step import DEFAULT_BUCKET_BYTES, StepProtocol, UnitSettings
from flashfsdp.runtime.reduce import finish_all
from flashfsdp.runtime.unit import PendingReduce
from flashfsdp.runtime.tree import map_tensors

from . import backward_check, elision
from .autograd import outside_functorch
from .structure import check_same_structure

BUCKET_BYTES_ENV = "FLASHFSDP_BUCKET_BYTES"


def default_bucket_bytes() -> int:
    """The bucket size of a root whose ``set_bucket_bytes`` was not called: ``FLASHFSDP_BUCKET_BYTES``
    (bytes; 0 turns buckets off) if set, else ``DEFAULT_BUCKET_BYTES``.

    Raises:
        ValueError: the variable is not a whole number of bytes >= 0.
    """
    return count_from_env(BUCKET_BYTES_ENV, DEFAULT_BUCKET_BYTES,
                          "must be a whole number of bytes >= 0 (0 turns buckets off)")


class RootContext:
    """What every unit under one root shares during a step; the step protocol's executor on tensors.

    Args:
        root: the root unit's state (an ``FSDPState``); ``states``: every unit under it, the root
            included, in module order.
        policy: the prefetch policy.
        is_last_backward: ``FSDPModule.set_is_last_backward`` as set before the first forward.
        bucket_bytes: ``FSDPModule.set_bucket_bytes`` (runtime/step.py, [Note: buckets]).
    """

    def __init__(self, root, states: list, policy: PrefetchPolicy, is_last_backward: bool = True,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.root, self.states = root, states
        self.step = StepProtocol(root, self, policy, bucket_bytes=bucket_bytes)
        self.buckets = bucket.Buckets()
        # each unit's bucket classes (bucket.py): state -> (what they depend on, (gather, reduce))
        self._classes: dict = {}
        self.step.is_last_backward = is_last_backward
        self.pending: list[PendingReduce] = []
        self.callback_task: int | None = None  # the backward whose final callback is queued
        self.forward_without_backward = False  # a grad-enabled forward whose backward has not run
        self.backward_checked = False  # this step's first reduction checked the ranks' backwards

    # ---------------------------------------------------------------- StepExecutor
    def keys(self) -> list:
        return self.states

    def settings(self, state) -> UnitSettings:
        return state.settings

    def shard_state(self, state) -> ShardState:
        return state.unit.state

    def unshard(self, state) -> None:
        state.unshard()

    def wait_unshard(self, state) -> None:
        state.wait_unshard()

    def reshard(self, state, to_secondary: bool = False) -> None:
        state.reshard(to_secondary)

    def reduce(self, state) -> None:
        self.check_backward()
        state.reduce_grads()

    def finish_reductions(self) -> None:
        self.finish_pending()

    def is_stale(self, state) -> bool:
        return state.unit.gathered_is_stale()

    def skips_backward_unshard(self, state) -> bool:
        return elision.skip_backward_unshard(state)

    def prefetches_in_backward(self, state) -> bool:
        return elision.needs_backward_unshard(state)

    def _bucket_classes(self, state) -> tuple:
        """The unit's (all-gather, reduction) bucket classes, found again when what they depend on
        changed: which parameters train (the tuple ``FSDPState`` tracks, replaced on a change and
        after a conversion), the divide factor, the communicators, the all-gather extensions."""
        unit = state.unit
        key = (state._tracked_requires_grad, unit.gradient_divide_factor, unit.rs_comm, unit.comm, unit._extensions)
        kept = self._classes.get(state)
        if kept is None or not all(map(operator.is_, kept[0], key)):  # by identity: a conversion's new tuple
            kept = self._classes[state] = (key, (bucket.all_gather_class(unit), bucket.reduce_class(unit)))
        return kept[1]

    def all_gather_bucket(self, state):
        return self._bucket_classes(state)[0]

    def unshard_together(self, states: list) -> None:
        for state in states:
            elision.count_unshard(state)
        with outside_functorch():
            self.buckets.unshard([state.unit for state in states])

    def reduce_scatter_bucket(self, state):
        return self._bucket_classes(state)[1] if state.requires_gradient_sync else None

    def reduce_together(self, states: list) -> None:
        self.check_backward()
        pending = bucket.reduce_units([state.unit for state in states])
        self.finish_pending()  # the earlier reductions had these units' backward to run behind
        self.pending.extend(pending)

    # ---------------------------------------------------------------- the root's work
    def check_backward(self) -> None:
        """Once per step, at its backward's first hook (a unit's pre-backward, or else its first
        reduction), before the backward's first collective: every rank runs the backward of the
        same units with the same gradient sync (``backward_check.py``; an exchange only on a
        root's first step and after a ``set_requires_gradient_sync``).

        Raises:
            ValueError: the ranks' backwards differ (on every rank, naming the first unit).
        """
        if self.backward_checked:
            return
        self.backward_checked = True
        if backward_check.needs_check(self.root, self.states):
            running = [s for s in self.states if s in self.step.forward_with_grad]
            backward_check.check_backward_units(self.root, self.states, running)

    def finish_pending(self) -> None:
        """Wait for every reduce-scatter in flight and accumulate its result."""
        pending, self.pending = self.pending, []
        finish_all(pending)

    def start_step(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """The root's pre-forward: finish the last step's reductions and gather again what went
        stale (the step protocol), free unused gradient shards, and forget a forward without
        backward."""
        self.step.start_step(self.states)
        self.backward_checked = False
        for state in self.states:
            if self.forward_without_backward:
                state.gate.forget_inputs()  # the last forward's graph had no backward
            if any(group.sharded_grad is not None for group in state.unit.groups):
                # a reduce-scatter-stream block the optimizer read on the compute stream: order
                # its owner first (see [Note: memory safety without record_stream] in streams.py)
                state.unit.streams.order_after_current(state.unit.streams.reduce_scatter)
            for group in state.unit.groups:
                group.release_unused_grad()
        self.forward_without_backward = torch.is_grad_enabled()
        if trace.active() is not None:
            trace.active().next_step()
        device = self.root.unit.device
        if device.type not in ("cpu", "meta"):
            # FSDP2's root moves the forward inputs to its device.
            args, kwargs = map_tensors(lambda t: t.to(device, non_blocking=True), (args, kwargs))
        return args, kwargs

    def reset_iter_state(self) -> None:
        """Drop a step that an exception aborted (see ``FSDPModule.reset_iter_state``)."""
        for state in self.states:
            state.reshard()  # waits for an all-gather in flight first
            state.end_backward_bookkeeping()
            state.drop_pending_forward()
            for group in state.unit.groups:
                group.unsharded_accum = None
                group.accum_had_grad = [False] * len(group.accum_had_grad)
                for p in group.unsharded_params:
                    p.grad = None
        for p in self.pending:
            p.work.wait()
        self.pending = []
        self.step.prefetched.clear()
        self.callback_task = None
        self.forward_without_backward = False
        self.backward_checked = False
        self.step.forward_with_grad.clear()
        self.step.order.start_step()

    def end_backward(self) -> None:
        """The final callback of every backward (queued by whichever unit's backward starts first):
        the step protocol reduces and ends the units whose post-backward did not run, reshards what
        should be, and with the step's last backward finishes the reductions; then the compute
        stream waits for the reduce-scatter stream."""
        self.step.flush_reductions()  # the open bucket's units hold gradients that are being reduced
        unreduced = [state for state in self.states if state.needs_reduction()]
        undone = [state for state in self.states if state.end_backward_unfinished()]
        last = self.step.end_backward(unreduced, undone, lambda state: state.should_reshard_at_end())
        for state in self.states:
            state.end_backward_bookkeeping()
        self.callback_task = None
        self.forward_without_backward = False
        if last:
            streams = self.root.unit.streams
            streams.wait_for_reduce_scatter(self.root.unit.name)
            streams.release_held()


def init_root(self) -> None:
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
    states: list = []
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
    ctx = RootContext(self, states, PrefetchPolicy(max_inflight=self.max_inflight), self.is_last_backward,
                      self.bucket_bytes if self.bucket_bytes_set else default_bucket_bytes())
    for state in states:
        state.ctx = ctx


def _check_root(self, states: list, names: dict[int, str]) -> None:
    """The local checks of :func:`init_root` (see its Raises)."""
    if len(self.modules) > 1:
        raise ValueError(
            f"fully_shard: the unit of the modules {[type(m).__name__ for m in self.modules]} has no "
            f"fully_shard'ed parent, so it would be the root, and a root must be one module: call "
            f"fully_shard on a module that contains them all"
        )
    for state in states:
        if state is not self and state.bucket_bytes_set:
            raise ValueError(
                f"set_bucket_bytes was called on '{names[id(state.module)]}' ({state.class_name}), which is not "
                f"the root: the root's bucket size applies to every unit under it; call it on the root module "
                f"({self.class_name}) instead"
            )
        if state is not self and state.max_inflight_set:
            raise ValueError(
                f"set_max_inflight_all_gathers was called on '{names[id(state.module)]}' "
                f"({state.class_name}), which is not the root: only the root's limit is used; "
                f"call it on the root module ({self.class_name}) instead"
            )
