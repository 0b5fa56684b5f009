"""FSDPState: one fully_shard'ed module's hooks, training state and parameter swapping.

Each ``fully_shard(module)`` call attaches one FSDPState (``module._flashfsdp_state``) holding the
runtime's ShardedUnit. The first state whose forward runs becomes the root: it lazily gathers every
state in its subtree into one :class:`RootContext` (execution order, prefetch policy, reductions in
flight) and queues the final callback of every backward.

Module parameters: outside forward/backward each registration ``(submodule, name)`` holds the
sharded local piece; from unshard to reshard it holds the full-shape view into the unsharded
buffer (swapped in ``_parameters`` directly, as FSDP2's ``unsafe_setattr_param`` does).

[Note: recomputation]
``torch.utils.checkpoint`` runs a unit's forward a second time inside backward. Its pre-forward
then only unshards and casts the inputs exactly as the first forward did (``cast_forward_inputs``;
the post-forward casts to ``output_dtype`` again), so the recomputed tensors have the forward's
dtypes. It also hooks the post-backward on the recomputed inputs: with reentrant checkpointing the
forward ran without grad, so only this hook reduces and reshards the unit right after its backward;
with non-reentrant checkpointing the recomputed graph is never backpropagated and the hook never
fires (the first forward's hook does).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from flashfsdp.runtime import trace
from flashfsdp.runtime.schedule import ExecutionOrder, PrefetchPolicy
from flashfsdp.runtime.states import ShardState, TrainingState
from flashfsdp.runtime.unit import PendingReduce, ShardedUnit

from .autograd import apply_to_tensors, in_backward, queue_final_callback
from .mixed_precision import MixedPrecisionPolicy


@dataclass
class RootContext:
    """What every unit under one root shares during a step."""

    root: "FSDPState"
    states: list["FSDPState"]
    order: ExecutionOrder = field(default_factory=ExecutionOrder)
    policy: PrefetchPolicy = field(default_factory=PrefetchPolicy)
    pending: list[PendingReduce] = field(default_factory=list)
    prefetched: set = field(default_factory=set)
    callback_queued: bool = False
    forward_without_backward: bool = False  # a grad-enabled forward whose backward has not run

    def finish_pending(self) -> None:
        """Wait for every reduce-scatter in flight and accumulate its result."""
        pending, self.pending = self.pending, []
        for p in pending:
            p.finish()


class FSDPState:
    """The state of one fully_shard'ed module.

    Args:
        module: the module (its class is already the FSDPModule subclass).
        unit: the runtime unit holding its parameters.
        registrations: per unit parameter, every ``(submodule, attribute name)`` that refers to it
            (more than one for shared parameters such as tied embeddings).
        mp_policy: the mixed-precision policy.
        reshard_after_forward: free the unsharded parameters after forward (re-gather in backward).
        class_name: the module's class before fully_shard made it ``FSDP<ClassName>`` (for errors).
    """

    def __init__(
        self,
        module: nn.Module,
        unit: ShardedUnit,
        registrations: list[list[tuple[nn.Module, str]]],
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward: bool,
        class_name: str | None = None,
    ):
        self.module = module
        self.class_name = class_name or type(module).__name__
        self.unit = unit
        self.registrations = registrations
        self.mp_policy = mp_policy
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.training_state = TrainingState.IDLE
        self.ctx: RootContext | None = None
        self.max_inflight = 2  # prefetched units ahead of compute, when this state is the root
        self.max_inflight_set = False  # set_max_inflight_all_gathers was called (only the root may)
        self.explicit_forward_prefetch: list[FSDPState] | None = None
        self.explicit_backward_prefetch: list[FSDPState] | None = None
        # The registrations still hold the original full parameters: install the pieces.
        self.holds_unsharded = True
        self._swap(False)
        self._compute_start = None  # trace timestamp of the forward/backward compute in progress
        self.hook_handles = [
            module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True),
            module.register_forward_hook(self._post_forward, prepend=False),
        ]

    def __repr__(self) -> str:
        return f"FSDPState({self.unit.name!r})"

    @property
    def is_root(self) -> bool:
        return self.ctx is not None and self.ctx.root is self

    # ------------------------------------------------------------------ parameters
    def _swap(self, unsharded: bool) -> None:
        if self.holds_unsharded == unsharded:
            return
        get = self.unit.unsharded_param if unsharded else self.unit.sharded_param
        for i, regs in enumerate(self.registrations):
            param = get(i)
            for mod, name in regs:
                mod._parameters[name] = param
        self.holds_unsharded = unsharded

    def unshard(self) -> None:
        """Issue this unit's all-gather (asynchronous) if it is sharded."""
        self.unit.unshard()

    def wait_unshard(self) -> None:
        """Wait for this unit's all-gather and give the module its unsharded parameters."""
        self.unit.wait_unshard()
        self._swap(True)
        if self.ctx is not None:
            self.ctx.prefetched.discard(self)

    def reshard(self, to_secondary: bool = False) -> None:
        """Give the module its sharded pieces back and free the unsharded storage (keeping the
        post-forward slice with ``to_secondary`` when the unit reshards to a smaller group)."""
        self._swap(False)
        self.unit.reshard(to_secondary)
        if self.ctx is not None:
            self.ctx.prefetched.discard(self)

    # ------------------------------------------------------------------ lazy init
    def _lazy_init(self) -> None:
        """Become the root of every state in this module's subtree (first forward only).

        Raises:
            ValueError: ``set_max_inflight_all_gathers`` was called on a module of the subtree
                other than this root (only the root's limit is used).
        """
        if self.ctx is not None:
            return
        states = [m._flashfsdp_state for m in self.module.modules() if hasattr(m, "_flashfsdp_state")]
        names = {id(m): n for n, m in self.module.named_modules()}
        for state in states:
            if state is not self and state.max_inflight_set:
                raise ValueError(
                    f"set_max_inflight_all_gathers was called on '{names[id(state.module)]}' "
                    f"({state.class_name}), which is not the root: only the root's limit is used; "
                    f"call it on the root module ({self.class_name}) instead"
                )
        ctx = RootContext(root=self, states=states, policy=PrefetchPolicy(max_inflight=self.max_inflight))
        for state in states:
            state.ctx = ctx
            state.unit.name = names[id(state.module)] or "<root>"
        # Backward starts with the root's parameters: keep them after forward (FSDP2 does too).
        self.reshard_after_forward = False

    def _prefetch(self, targets: list["FSDPState"]) -> None:
        ctx = self.ctx
        candidates = [t for t in targets if t.unit.state in (ShardState.SHARDED, ShardState.SECONDARY)]
        for target in ctx.policy.admit(candidates, len(ctx.prefetched)):
            target.unshard()
            ctx.prefetched.add(target)

    # ------------------------------------------------------------------ forward hooks
    @trace.labelled("pre_forward")
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if in_backward():
            # Activation recomputation inside backward (torch.utils.checkpoint): the parameters are
            # needed and the inputs get the forward's cast, so the recomputation matches the forward;
            # the scheduling hooks are not. See [Note: recomputation].
            self.wait_unshard()
            args, kwargs = self._cast_inputs(args, kwargs)
            return self._register_post_backward(args, kwargs)
        self._lazy_init()
        ctx = self.ctx
        if self.is_root:
            ctx.finish_pending()
            ctx.order.start_step()
            if ctx.forward_without_backward:
                # The last forward recorded a graph but no backward ran: its unsharded parameters
                # (and post-forward slices) may be stale by now (an optimizer step, a loaded state
                # dict): gather from the master shards again.
                for state in ctx.states:
                    if state.unit.state is not ShardState.SHARDED:
                        state.reshard()
            ctx.forward_without_backward = torch.is_grad_enabled()
            if trace.active() is not None:
                trace.active().next_step()
        self._check_input_devices(args, kwargs)
        self.training_state = TrainingState.FORWARD
        ctx.order.record(self)
        self.wait_unshard()
        self._prefetch(ctx.policy.forward_targets(self, ctx.order, self.explicit_forward_prefetch))
        args, kwargs = self._cast_inputs(args, kwargs)
        args, kwargs = self._register_post_backward(args, kwargs)
        self._mark_compute_start()
        return args, kwargs

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Floating-point inputs cast to ``param_dtype`` if the policy asks for it."""
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            args, kwargs = _cast_floating((args, kwargs), self.mp_policy.param_dtype)
        return args, kwargs

    def _register_post_backward(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Hook the post-backward on the inputs that require grad, if the unit has parameters.

        Also for units whose parameters are all frozen: they reduce nothing, but the hook is what
        reshards them as soon as their backward is done (else they would stay unsharded until the
        final callback, every frozen unit at once).
        """
        if self.unit.groups:
            args, kwargs = apply_to_tensors(self._post_backward, (args, kwargs))
        return args, kwargs

    def _mark_compute_start(self) -> None:
        prof = trace.active()
        self._compute_start = prof.now() if prof is not None else None

    def _mark_compute_end(self, kind: str) -> None:
        prof = trace.active()
        if prof is not None and self._compute_start is not None:
            prof.add(kind, self.unit.name, "compute", self._compute_start, prof.now())
        self._compute_start = None

    @trace.labelled("post_forward")
    def _post_forward(self, module: nn.Module, args: tuple, output):
        if in_backward():
            return self._cast_output(output)
        self._mark_compute_end("forward")
        if self.ctx is not None:
            self.ctx.order.record_post_forward(self)
        if not torch.is_grad_enabled():
            self.reshard()  # no backward follows
            if self.is_root:
                # A unit prefetched in this forward that never ran (a branch not taken) would keep
                # its gathered parameters, stale after the next optimizer step or load.
                for state in list(self.ctx.prefetched):
                    state.reshard()
        elif self.reshard_after_forward and not (
            self.ctx is not None and self.ctx.policy.keep_for_backward(self, self.ctx.order)
        ):
            self.reshard(to_secondary=True)
        self.training_state = TrainingState.IDLE
        output = apply_to_tensors(self._pre_backward, output)
        return self._cast_output(output)

    def _cast_output(self, output):
        """Floating-point outputs cast to ``output_dtype`` if the policy sets one."""
        if self.mp_policy.output_dtype is not None:
            output = _cast_floating(output, self.mp_policy.output_dtype)
        return output

    def _check_input_devices(self, args: tuple, kwargs: dict) -> None:
        device = self.unit.device
        for t in _tensors((args, kwargs)):
            if t.device != device and not (t.device.type == "cpu" and t.dim() == 0):
                raise ValueError(
                    f"fully_shard module '{self.unit.name}' got a forward input on {t.device} but its "
                    f"parameters are on {device}: move the inputs to {device} first"
                )

    # ------------------------------------------------------------------ backward hooks
    @trace.labelled("pre_backward")
    def _pre_backward(self) -> None:
        ctx = self.ctx
        if self.is_root and not ctx.callback_queued:
            ctx.callback_queued = True
            queue_final_callback(self._final_callback)
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        self.training_state = TrainingState.PRE_BACKWARD
        ctx.order.record_pre_backward(self)
        self.wait_unshard()
        self._prefetch(ctx.policy.backward_targets(self, ctx.order, self.explicit_backward_prefetch))
        self._mark_compute_start()

    @trace.labelled("post_backward")
    def _post_backward(self) -> None:
        if self.training_state is TrainingState.POST_BACKWARD:
            return
        self.training_state = TrainingState.POST_BACKWARD
        self._mark_compute_end("backward")
        ctx = self.ctx
        if self.requires_gradient_sync:
            pending = self.unit.reduce_grads()
            # Earlier reductions had this unit's backward to run behind: finish them now.
            ctx.finish_pending()
            ctx.pending.extend(pending)
        if self.reshard_after_backward:
            self.reshard()

    def _final_callback(self) -> None:
        ctx = self.ctx
        for state in ctx.states:
            if state.training_state is TrainingState.PRE_BACKWARD or (
                state.training_state is TrainingState.IDLE and state.unit.has_unsharded_grads()
                and state.requires_gradient_sync
            ):
                state._post_backward()
            elif state.unit.state is ShardState.SECONDARY or (
                state.holds_unsharded and state.reshard_after_backward and state.unit.state is not ShardState.SHARDED
            ):
                state.reshard()
            state.training_state = TrainingState.IDLE
        for state in list(ctx.prefetched):
            state.reshard()
        ctx.finish_pending()
        streams = self.unit.streams
        streams.wait_for_reduce_scatter(self.unit.name)
        streams.release_held()
        ctx.callback_queued = False
        ctx.forward_without_backward = False


def _tensors(tree) -> list[torch.Tensor]:
    from torch.utils._pytree import tree_leaves  # noqa: PLC0415

    return [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _cast_floating(tree, dtype: torch.dtype):
    return tree_map(
        lambda x: x.to(dtype) if isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != dtype else x,
        tree,
    )
