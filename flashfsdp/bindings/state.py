"""FSDPState: one fully_shard'ed unit's hooks, training state and parameter swapping.

Each ``fully_shard(module)`` call attaches one FSDPState (``module._flashfsdp_state``) holding the
runtime's ShardedUnit; ``fully_shard([m1, m2])`` attaches one state to both modules (one unit).
The first state whose forward runs lazily makes the outermost fully_shard'ed module above it the
root: the root gathers every state in its subtree into one :class:`RootContext` (execution order,
prefetch policy, reductions in flight). Whichever unit's backward starts first queues the final
callback of that backward (a backward through a non-root unit alone is finished too).

Module parameters: outside forward/backward each registration ``(submodule, name)`` holds the
sharded local piece; from unshard to reshard it holds the full-shape view into the unsharded
buffer (swapped in ``_parameters`` directly, as FSDP2's ``unsafe_setattr_param`` does).

[Note: recomputation]
``torch.utils.checkpoint`` runs a unit's forward a second time inside backward. Its pre-forward
then only unshards and casts the inputs exactly as the first forward did (``cast_forward_inputs``;
the post-forward casts to ``output_dtype`` again), so the recomputed tensors have the forward's
dtypes. With reentrant checkpointing the recomputed graph is backpropagated in a nested backward,
where the unit's gradients becoming ready reduce and reshard it; with non-reentrant checkpointing
the recomputed graph is never backpropagated (the first forward's hooks finish the unit).

[Note: grouped units]
For ``fully_shard([m1, m2])`` the pre-forward of whichever module runs first unshards the unit,
and the post-forward reshards it once every module of the group ran its forward (as FSDP2's
``_register_group_forward_hooks``); a module of the group that did not run in a forward is given
up on at the end of the root's forward.
"""

from __future__ import annotations

import operator
from itertools import chain

import torch
import torch.nn as nn

from flashfsdp.runtime import trace
from flashfsdp.runtime.states import ShardState, TrainingState
from flashfsdp.runtime.step import DEFAULT_BUCKET_BYTES, ReshardAfterForward, UnitSettings, check_bucket_bytes
from flashfsdp.runtime.unit import ShardedUnit
from flashfsdp.runtime.init_window import close_init_windows
from flashfsdp.runtime.tree import cast_floating, tensors_in

from .autograd import PostBackwardGate, current_backward, grad_tensors, in_backward, outside_functorch, queue_final_callback
from . import elision
from .adopt import adopt_module_params, adopt_replaced_params, check_materialised
from .compile_boundary import run_eagerly
from .autograd import register_pre_backward_hooks
from .root import RootContext, init_root
from .mixed_precision import MixedPrecisionPolicy


_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_SHARDED_PARAMS = operator.attrgetter("sharded_params")


class FSDPState:
    """The state of one fully_shard'ed unit.

    Args:
        modules: the module(s) of the ``fully_shard`` call (their classes are already FSDPModule
            subclasses); more than one for a grouped unit.
        unit: the runtime unit holding their parameters.
        registrations: per unit parameter, every ``(submodule, attribute name)`` that refers to it
            (more than one for shared parameters such as tied embeddings).
        mp_policy: the mixed-precision policy.
        reshard_after_forward: the resolved ``reshard_after_forward`` (``runtime.step.ReshardAfterForward``).
        class_name: the first module's class before fully_shard made it ``FSDP<ClassName>``.
        param_owners: per unit parameter, which of ``modules`` it was found under (default: the first).
        comm_spec: ``(process group, communicator argument)`` the unit's communicator was built from
            (to build it again for another device when a meta-device unit is materialised).
        compute_device: where the unit computes once materialised (a meta-device or CPU-offloaded
            unit's parameters are elsewhere).
    """

    def __init__(
        self,
        modules: list[nn.Module],
        unit: ShardedUnit,
        registrations: list[list[tuple[nn.Module, str]]],
        mp_policy: MixedPrecisionPolicy,
        reshard_after_forward: ReshardAfterForward,
        class_name: str | None = None,
        param_owners: list[nn.Module] | None = None,
        comm_spec: tuple | None = None,
        compute_device: torch.device | None = None,
    ):
        self.modules = list(modules)
        self.module = self.modules[0]
        self.class_name = class_name or type(self.module).__name__
        self.unit = unit
        self.registrations = registrations
        self.param_owners = param_owners or [self.module] * len(registrations)
        self.comm_spec = comm_spec
        self.compute_device = compute_device or unit.device  # where a meta / offloaded unit computes
        self.mp_policy = mp_policy
        # reshard after forward / backward, unshard in backward, explicit prefetch lists: what the
        # step protocol (runtime/step.py) reads; FSDPModule's setters change them
        self.settings = UnitSettings(reshard_after_forward)
        self.requires_gradient_sync = True
        self.force_sum_reduction = False  # flashfsdp always reduces with SUM
        self.is_last_backward = True  # read by the root (set_is_last_backward)
        self.unsharded_init = False  # set_unsharded_init: to_empty opens the init window (adopt.py)
        self.training_state = TrainingState.IDLE
        self.parent: FSDPState | None = None  # the state of the enclosing fully_shard call
        self.ctx: RootContext | None = None
        self.max_inflight = 2  # prefetched units ahead of compute, when this state is the root
        self.max_inflight_set = False  # set_max_inflight_all_gathers was called (only the root may)
        self.bucket_bytes = DEFAULT_BUCKET_BYTES  # set_bucket_bytes of this state as a root
        self.bucket_bytes_set = False  # set_bucket_bytes was called (only the root may)
        self.all_reduce_hook = None  # set_all_reduce_hook (W = 1 per replica group: called on the shards)
        self.gate = PostBackwardGate(self._on_grads_ready, self._on_backward_done)
        # Leaf outputs (a parameter or input returned as is) already hooked: id -> weak reference
        # (hooks on non-leaf outputs live and die with their graph; see register_pre_backward_hooks)
        self._hooked_leaves: dict = {}
        self._pending_forward: set[int] = set()  # modules of a grouped unit still to run forward
        self._tracked_requires_grad: tuple | None = None
        self._sharded_flags: tuple | None = None  # the sharded parameters' requires_grad, last synced
        # The registrations still hold the original full parameters: install the pieces.
        self.holds_unsharded = True
        self._swap(False)
        self._compute_start = None  # trace timestamp of the forward/backward compute in progress
        self.hook_handles = []
        for module in self.modules:
            self.hook_handles += [
                module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True),
                module.register_forward_hook(self._post_forward, prepend=False),
            ]
        elision.attach(self)  # after _post_forward: its hook ends the forward's watch

    def __repr__(self) -> str:
        return f"FSDPState({self.unit.name!r})"

    @property
    def is_root(self) -> bool:
        return self.ctx is not None and self.ctx.root is self

    # ------------------------------------------------------------------ parameters
    def _swap(self, unsharded: bool) -> None:
        if self.holds_unsharded == unsharded:
            return
        # Parameter i is slot i's entry of its group's list (ShardedUnit.unsharded_param /
        # sharded_param), read here without a method call per parameter: this runs 4 times per
        # unit per step.
        attr = "unsharded_params" if unsharded else "sharded_params"
        for (group, pos), regs in zip(self.unit.param_slots, self.registrations):
            param = getattr(group, attr)[pos]
            for mod, name in regs:
                mod._parameters[name] = param
        self.holds_unsharded = unsharded

    def unshard(self) -> None:
        """Issue this unit's all-gather (asynchronous) if it is sharded."""
        elision.count_unshard(self)
        with outside_functorch():
            self.unit.unshard()

    def wait_unshard(self) -> None:
        """Wait for this unit's all-gather (issuing it if it was not prefetched) and give the module
        its unsharded parameters."""
        elision.count_unshard(self)  # a gather issued here, not by unshard(), counts too
        with outside_functorch():
            self.unit.wait_unshard()
        self._swap(True)
        if self.ctx is not None:
            self.ctx.step.prefetched.discard(self)

    def reshard(self, to_secondary: bool = False) -> None:
        """Give the module its sharded pieces back and free the unsharded storage (keeping the
        post-forward slice with ``to_secondary`` when the unit reshards to a smaller group)."""
        self._swap(False)
        with outside_functorch():
            self.unit.reshard(to_secondary)
        if self.ctx is not None:
            self.ctx.step.prefetched.discard(self)

    def reshard_idle(self, what: str) -> None:
        """Before ``what`` (a load, a conversion): reshard the unit if it is idle and unsharded (kept
        by ``reshard_after_forward=False``, also after a no-grad forward, as FSDP2); RuntimeError
        if it is unsharded inside a forward or backward."""
        if self.holds_unsharded and (self.training_state is not TrainingState.IDLE or in_backward() or (
                self.ctx is not None and self.ctx.root.training_state is not TrainingState.IDLE)):
            raise RuntimeError(
                f"{what} on fully_shard'ed module '{self.unit.name}' while its parameters are unsharded inside "
                f"forward/backward: call it outside forward/backward")
        if self.holds_unsharded:
            self.reshard()

    def prefix_fqns(self, module: nn.Module, prefix: str) -> None:
        """Prepend ``prefix`` to the names of the parameters found under ``module``."""
        for i, owner in enumerate(self.param_owners):
            if owner is module:
                group, pos = self.unit.param_slots[i]
                group.prefix_fqn(pos, prefix)

    # ------------------------------------------------------------------ settings (FSDPModule's setters)
    def reshards_after_forward(self) -> bool:
        """Whether the unit's forward ends with a reshard by its own setting (the root keeps its
        parameters when the value was not given; the schedule may keep the last block too)."""
        setting = self.settings.reshard_after_forward
        return setting.reshard and (setting.explicit or not self.is_root)

    def set_is_last_backward(self, value: bool) -> None:
        self.is_last_backward = value
        if self.ctx is not None:
            self.ctx.step.is_last_backward = value

    def set_max_inflight(self, max_inflight: int) -> None:
        """Raises ValueError if this state is known not to be the root."""
        if self.ctx is not None and not self.is_root:
            raise ValueError(
                f"set_max_inflight_all_gathers: '{self.unit.name}' is not the root (its root is "
                f"{self.ctx.root.class_name}); only the root's limit is used: call it on the root module"
            )
        self.max_inflight = max_inflight
        self.max_inflight_set = True
        if self.ctx is not None:
            self.ctx.step.policy.max_inflight = max_inflight

    def set_bucket_bytes(self, nbytes: int) -> None:
        """Raises ValueError if this state is known not to be the root (see ``FSDPModule.set_bucket_bytes``)."""
        if self.ctx is not None and not self.is_root:
            raise ValueError(
                f"set_bucket_bytes: '{self.unit.name}' is not the root (its root is {self.ctx.root.class_name}); "
                f"the root's bucket size applies to every unit under it: call it on the root module")
        self.bucket_bytes = check_bucket_bytes(nbytes)
        self.bucket_bytes_set = True
        if self.ctx is not None:
            self.ctx.step.flush_reductions()
            self.ctx.step.bucket_bytes = self.bucket_bytes

    def set_separate_reduce_scatter_group(self, enable: bool) -> None:
        """Give the unit's reduce-scatters a communicator over a process group of their own."""
        from flashfsdp.runtime.comm_factory import separate_communicator  # noqa: PLC0415

        self.unit.rs_comm = separate_communicator(self.unit.comm, self.unit.device) if enable else None

    def reset_iter_state(self) -> None:
        """Drop a step that an exception aborted (see ``FSDPModule.reset_iter_state``).

        Raises:
            RuntimeError: this state is not the root.
        """
        if self.ctx is None:
            return
        if not self.is_root:
            raise RuntimeError(f"reset_iter_state: call it on the root module ({self.ctx.root.class_name})")
        self.ctx.reset_iter_state()

    def adopt_module_params(self) -> None:
        """After ``module.to(...)`` / ``to_empty`` / ``load_state_dict(assign=True)``: see ``adopt.py``."""
        adopt_module_params(self)

    def drop_pending_forward(self) -> None:
        """Forget the modules of a grouped unit still to run their forward (an aborted step)."""
        self._pending_forward = set()

    def end_backward_bookkeeping(self) -> None:
        """Go idle and drop the gate's input hooks and counts. The pre-backward hooks on forward
        outputs stay: a graph whose backward is still to come (a forward before another unit's
        backward) must still unshard its units."""
        self.training_state = TrainingState.IDLE
        self.gate.reset()
        elision.end_backward(self)

    def _has_frozen_params(self) -> bool:
        """Whether a parameter of the unit is frozen (as of the last :meth:`_sync_requires_grad`)."""
        if self._sharded_flags is None:
            return any(not p.requires_grad for g in self.unit.groups for p in g.sharded_params)
        return not all(self._sharded_flags)

    def _sync_requires_grad(self) -> None:
        """Follow ``requires_grad_`` calls made on the sharded parameters since the last forward.
        The flags are read in one pass (in C) and compared with the last forward's: the unsharded
        parameters and the gate are visited only when one changed (or the unit was converted, or
        it has all-gather extensions, whose unsharded parameters may be new ones)."""
        groups = self.unit.groups
        if self.holds_unsharded and self._tracked_requires_grad is not None:
            self._carry_unsharded_requires_grad()
        sharded = tuple(map(_REQUIRES_GRAD, chain.from_iterable(map(_SHARDED_PARAMS, groups))))
        if (sharded == self._sharded_flags and self._tracked_requires_grad is not None
                and not self.unit.extensions):
            return
        for group in groups:
            group.sync_requires_grad()
        flags = tuple(p.requires_grad for g in groups for p in g.unsharded_params)
        if self.unit.extensions:  # fsdp_post_all_gather built new unsharded parameters: watch those
            flags += tuple(id(e.unsharded) for e in self.unit.extensions)
        if flags != self._tracked_requires_grad:
            if not self.gate.track_params([p for g in groups for p in g.unsharded_params]):
                return  # (inside a functorch transform: again at the next forward)
            self._tracked_requires_grad = flags
        self._sharded_flags = sharded

    def _carry_unsharded_requires_grad(self) -> None:
        """``requires_grad_`` on the unsharded parameters of a unit kept unsharded since its last
        forward (``reshard_after_forward=False``) goes to the sharded ones, which hold the flags."""
        pairs = [(s, u) for g in self.unit.groups for s, u in zip(g.sharded_params, g.unsharded_params)]
        if tuple(u.requires_grad for _, u in pairs) != self._tracked_requires_grad[:len(pairs)]:
            for sharded, unsharded in pairs:
                sharded.requires_grad_(unsharded.requires_grad)

    # ------------------------------------------------------------------ lazy init
    def _lazy_init(self) -> None:
        """Make the outermost fully_shard'ed module above this one the root (first forward only)."""
        if self.ctx is not None:
            return
        root = self
        while root.parent is not None:
            root = root.parent
        init_root(root)

    # ------------------------------------------------------------------ forward hooks
    @run_eagerly
    @trace.labelled("pre_forward")
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict):
        if in_backward():
            # Activation recomputation inside backward (torch.utils.checkpoint): the parameters are
            # needed and the inputs get the forward's cast, so the recomputation matches the forward;
            # the scheduling hooks are not. See [Note: recomputation].
            self.wait_unshard()
            return self._cast_inputs(args, kwargs)
        close_init_windows()
        self._lazy_init()
        if self._pending_forward:  # another module of this grouped unit is mid-forward
            self.wait_unshard()
            args, kwargs = self._cast_inputs(args, kwargs)
            if self._has_frozen_params():
                self.gate.wait_for_inputs(grad_tensors((args, kwargs)))
            return args, kwargs
        ctx = self.ctx
        if self.is_root:
            args, kwargs = ctx.start_step(args, kwargs)
        adopt_replaced_params(self)
        check_materialised(self)
        inputs_need_grad = self._check_input_devices(args, kwargs)
        # A grouped unit stays unsharded until all its modules ran, within one root forward (whose
        # end gives up on the ones that did not); a module of it called on its own is a forward of
        # its own.
        in_root_forward = not self.is_root and ctx.root.training_state is TrainingState.FORWARD
        self._pending_forward = {id(m) for m in self.modules} if len(self.modules) > 1 and in_root_forward else set()
        self.training_state = TrainingState.FORWARD
        self._sync_requires_grad()
        ctx.step.pre_forward(self)  # record; wait for the parameters; prefetch
        if self.unit.extensions:  # the unsharded parameters fsdp_post_all_gather built are known now
            self._sync_requires_grad()
        args, kwargs = self._cast_inputs(args, kwargs)
        if self._has_frozen_params():
            # A frozen parameter's gradient never marks the end of its uses: wait for the inputs'
            # gradients too (units whose parameters are all frozen reshard on those alone; without
            # such inputs, for the end of the backward). A unit
            # whose parameters all train reshards when they all have their gradients, before the
            # previous unit's backward starts (and prefetches), as FSDP2 does. See autograd.py.
            self.gate.wait_for_inputs(grad_tensors((args, kwargs)))
        elision.begin_forward(self, inputs_need_grad)
        self._mark_compute_start()
        return args, kwargs

    def _cast_inputs(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Floating-point inputs cast to ``param_dtype`` if the policy asks for it."""
        if self.mp_policy.cast_forward_inputs and self.mp_policy.param_dtype is not None:
            args, kwargs = cast_floating((args, kwargs), self.mp_policy.param_dtype)
        return args, kwargs

    def _mark_compute_start(self) -> None:
        prof = trace.active()
        self._compute_start = prof.now() if prof is not None else None

    def _mark_compute_end(self, kind: str) -> None:
        prof = trace.active()
        if prof is not None and self._compute_start is not None:
            prof.add(kind, self.unit.name, "compute", self._compute_start, prof.now())
        self._compute_start = None

    @run_eagerly
    @trace.labelled("post_forward")
    def _post_forward(self, module: nn.Module, args: tuple, output):
        if in_backward():
            return self._cast_output(output)
        if self._pending_forward:
            self._pending_forward.discard(id(module))
            if self._pending_forward:  # other modules of the group still to run
                register_pre_backward_hooks(self._pre_backward, output, self._hooked_leaves)
                return self._cast_output(output)
        if self.is_root:
            for state in self.ctx.states:
                if state._pending_forward:  # a grouped unit with a module that did not run
                    state._pending_forward = set()
                    state._end_forward()
        self._end_forward()  # after those: the root's forward ends last (the backward order)
        register_pre_backward_hooks(self._pre_backward, output, self._hooked_leaves)
        return self._cast_output(output)

    def _end_forward(self) -> None:
        """The unit's forward is over: reshard it (or keep it for backward) and go idle."""
        self._mark_compute_end("forward")
        self.ctx.step.post_forward(self, backward_follows=torch.is_grad_enabled())
        self.training_state = TrainingState.IDLE

    def _cast_output(self, output):
        """Floating-point outputs cast to ``output_dtype`` if the policy sets one."""
        if self.mp_policy.output_dtype is not None:
            output = cast_floating(output, self.mp_policy.output_dtype)
        return output

    def _check_input_devices(self, args: tuple, kwargs: dict) -> bool:
        """Raises ValueError for a forward input on another device than the unit's (a CPU scalar
        aside); returns whether any input requires grad."""
        device = self.unit.device
        needs_grad = False
        for t in tensors_in((args, kwargs)):
            needs_grad = needs_grad or t.requires_grad
            if t.device != device and not (t.device.type == "cpu" and t.dim() == 0):
                raise ValueError(
                    f"fully_shard module '{self.unit.name}' got a forward input on {t.device} but its "
                    f"parameters are on {device}: move the inputs to {device} first"
                )
        return needs_grad

    # ------------------------------------------------------------------ backward hooks
    def _queue_final_callback(self) -> None:
        """Queue the end-of-backward callback once per backward, whichever unit's backward starts it."""
        ctx = self.ctx
        task = current_backward()
        if ctx.callback_task != task:
            ctx.callback_task = task
            queue_final_callback(ctx.end_backward)

    @trace.labelled("pre_backward")
    def _pre_backward(self) -> None:
        self._queue_final_callback()
        if self.training_state is TrainingState.PRE_BACKWARD:
            return
        self.training_state = TrainingState.PRE_BACKWARD
        self.ctx.check_backward()  # the step's first backward hook: every rank runs the same units' backward
        self.ctx.step.pre_backward(self)  # record; wait unless the backward needs no parameters; prefetch
        self._mark_compute_start()

    @trace.labelled("post_backward")
    def _on_grads_ready(self) -> None:
        """The gate: every trainable parameter reached by this backward has its gradient."""
        self._queue_final_callback()
        self.ctx.step.gradients_ready(self)

    def _on_backward_done(self) -> None:
        """The gate: the unit's backward is over."""
        self._queue_final_callback()
        self._finish_backward()

    def reduce_grads(self) -> None:
        """Reduce-scatter the unsharded gradients, then finish the reductions issued before (or,
        without gradient sync, keep accumulating): the step protocol's reduction of this unit."""
        if self.requires_gradient_sync:
            pending = self.unit.reduce_grads()
            # Earlier reductions had this unit's backward to run behind: finish them now.
            self.ctx.finish_pending()
            self.ctx.pending.extend(pending)
        else:
            self.unit.accumulate_unsharded_grads()

    def needs_reduction(self) -> bool:
        """At the end of a backward: whether this unit's backward started (or left gradients)
        without its post-backward having run (its gate did not fire)."""
        return self.training_state is TrainingState.PRE_BACKWARD or self.unit.has_unsharded_grads()

    def end_backward_unfinished(self) -> bool:
        """At the end of a backward: whether this unit's backward started and did not end (then
        it ends now: POST_BACKWARD, its compute span closed); False if it already ended."""
        if self.training_state is TrainingState.POST_BACKWARD:
            return False
        unfinished = self.training_state is TrainingState.PRE_BACKWARD or self.unit.has_unsharded_grads()
        if unfinished:
            self.training_state = TrainingState.POST_BACKWARD
            self._mark_compute_end("backward")
        return unfinished

    def should_reshard_at_end(self) -> bool:
        """At the end of a backward: whether this unit still holds parameters it should free
        (a post-forward slice, or unsharded parameters while resharding after backward)."""
        return self.unit.state is ShardState.SECONDARY or (
            self.holds_unsharded and self.settings.reshard_after_backward and self.unit.state is not ShardState.SHARDED)

    def run_post_backward(self) -> None:
        """FSDP2's ``post_backward()`` called by hand (torch's pipelining, ``torch_state.py``): reduce
        what the unit holds (its micro-batches' gradients accumulated without sync, gradients set
        on its unsharded parameters), then end its backward (reshard unless told to keep the
        parameters). Nothing to reduce and nothing held: nothing happens but the state change."""
        if self.ctx is None:
            return
        if self.needs_reduction():
            self.ctx.step.gradients_ready(self)
        self._finish_backward()

    def _finish_backward(self) -> None:
        """Reshard after backward (unless asked to keep the parameters) and mark the unit done."""
        if self.training_state is TrainingState.POST_BACKWARD:
            return
        self.training_state = TrainingState.POST_BACKWARD
        self._mark_compute_end("backward")
        self.ctx.step.backward_done(self)
