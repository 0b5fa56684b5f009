"""FSDPModule: the methods ``fully_shard`` adds to a module's class, with FSDP2's names.

flashfsdp's ``FSDPModule`` subclasses torch's ``torch.distributed.fsdp.FSDPModule``, so every
``isinstance(m, FSDPModule)`` in client code (torchtitan's gradient-divide and no-sync gates,
Lightning's checks, DSD) takes the FSDP path — and calls the methods below, which override every
public method of torch's class. Every setter asks the module's
:class:`~flashfsdp.bindings.state.FSDPState` (or those of every fully_shard'ed module below it,
with ``recurse``); none pokes at its fields. The FSDP2 methods that cannot mean anything here
raise ``NotImplementedError`` saying why and what to use.
"""

from __future__ import annotations

import functools
import warnings
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.fsdp import UnshardHandle as TorchUnshardHandle

from flashfsdp.runtime.init_window import close_init_windows
from flashfsdp.runtime.custom_collectives import custom_all_gather, custom_reduce_scatter

from .elision import end_forward, set_enabled
from .state import FSDPState


class UnshardHandle(TorchUnshardHandle):
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the unshard. A
    subclass of torch's ``torch.distributed.fsdp.UnshardHandle`` (as FSDP2's own handle is), so
    ``isinstance(handle, UnshardHandle)`` holds for either import."""

    def __init__(self, state: FSDPState | None):
        self._state = state

    def wait(self) -> None:
        """Make the current stream wait for the all-gather and install the unsharded parameters."""
        if self._state is not None:
            self._state.wait_unshard()
            self._state = None


class FSDPModule(TorchFSDPModule):
    """Mixin that ``fully_shard`` adds to a module's class (``FSDP<ClassName>``, one per class),
    as FSDP2 does; a subclass of torch's ``FSDPModule``."""

    def __new__(cls, *args, **kwargs):
        """Constructing ``FSDP<ClassName>`` builds a plain ``ClassName`` (FSDP2 does the same): e.g.
        slicing a fully_shard'ed ``nn.Sequential`` gives a plain Sequential of its children."""
        orig_cls = cls.__dict__.get("_flashfsdp_orig_cls") or next(
            c for c in cls.__mro__ if not issubclass(c, TorchFSDPModule))
        self = orig_cls.__new__(orig_cls, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def __deepcopy__(self, memo):
        """Refused, as by FSDP2: a copy would share (or copy half of) the unit's communicator,
        flat storage and hooks.

        Raises:
            RuntimeError: always; deep-copy the module before ``fully_shard``, or build a new one
                and load ``flashfsdp.get_full_state_dict(model)`` into it.
        """
        raise RuntimeError(
            f"FSDP does not support deepcopy: {type(self).__name__} is fully_shard'ed. Copy the module before "
            f"fully_shard, or build a new one and load flashfsdp.get_full_state_dict(model) into it")

    def _apply(self, fn, recurse: bool = True):
        """``nn.Module._apply`` (behind ``to``, ``double``, ``to_empty``, ...), then the unit takes its
        converted pieces back into its flat storage (``FSDPState.adopt_module_params``): after
        ``model.to(torch.float64)`` the master shard, gradients and unsharded buffers are float64;
        after ``to_empty(device=...)`` a meta-device unit holds this rank's shard on that device.

        Raises:
            RuntimeError: the unit is unsharded inside forward/backward (an idle unit kept unsharded
                is resharded first).
            ValueError: a dtype narrower than at ``fully_shard`` (the flat layout is not aligned
                for it: convert before fully_shard or use ``mp_policy``).
        """
        state = self.__dict__.get("_flashfsdp_state")
        if state is not None:  # the other units' windows stay open (to_empty on the root reaches them first)
            close_init_windows([p for g in state.unit.groups for p in g.sharded_params])
        if state is not None:  # kept unsharded after a forward: resharded first (refused inside one)
            state.reshard_idle(f"{type(self).__name__}._apply (module.to / half / to_empty)")
        out = super(TorchFSDPModule, self)._apply(fn, recurse)  # (torch's FSDPModule._apply reads its own state)
        if state is not None:
            state.adopt_module_params()
        return out

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters; with ``async_op`` return a handle to ``wait()`` on.

        Until :meth:`reshard` (or the end of the next forward/backward that reshards it) the
        module's parameters are the full-shape views into the unsharded buffer.

        Raises:
            ValueError: this module was never passed to ``fully_shard``.
        """
        state = state_of(self, "unshard")
        close_init_windows()
        state.unshard()
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters; the module holds its sharded pieces again.

        Raises:
            ValueError: this module was never passed to ``fully_shard``.
        """
        state_of(self, "reshard").reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Reduce gradients in backward (True) or accumulate them unsharded, without communication.

        The next backward with sync on reduce-scatters everything accumulated meanwhile. With a
        ``reduce_dtype`` other than ``param_dtype`` the accumulation runs in ``reduce_dtype``.
        ``recurse``: also every fully_shard'ed module below this one. Under HSDP it switches the
        all-reduce across replicas along (as FSDP2 does; see :meth:`set_requires_all_reduce`).
        """
        for state in states_of(self, recurse, "set_requires_gradient_sync"):
            state.requires_gradient_sync = bool(requires_gradient_sync)
            state.unit.requires_all_reduce = bool(requires_gradient_sync)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Free the unsharded parameters after backward (True, the default) or keep them.

        Keeping them saves the all-gather of the next forward during gradient accumulation; set it
        back to True for the last micro-batch, since an optimizer step changes only the shards.
        """
        for state in states_of(self, recurse, "set_reshard_after_backward"):
            state.settings.reshard_after_backward = bool(reshard_after_backward)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free the unsharded parameters after forward (re-gather in backward) or keep them.

        An explicit value like this one is followed exactly, by the root too (as FSDP2's setter);
        only ``fully_shard``'s default (None) keeps the root and the last unit before it unsharded.
        ``recurse`` may be given positionally, as in FSDP2.

        Raises:
            ValueError: ``reshard_after_forward`` is not a bool (an int group size is for
                ``fully_shard`` only), as FSDP2 raises; or this module was never passed to ``fully_shard``.
        """
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for state in states_of(self, recurse, "set_reshard_after_forward"):
            state.settings.set_reshard_after_forward(bool(reshard_after_forward))

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether this unit's backward needs its parameters (True) or not (e.g. an embedding, whose
        backward reads only the indices): False skips the backward all-gather of a unit that
        resharded after forward. Wrong when the backward does read them (like FSDP2's)."""
        state_of(self, "set_unshard_in_backward").settings.unshard_in_backward = bool(unshard_in_backward)

    def set_backward_all_gather_elision(self, enabled: bool, *, recurse: bool = True) -> None:
        """Skip the backward all-gather of units whose backward reads no parameter (True, the
        default) or always all-gather (False). flashfsdp only; FSDP2 has no counterpart.

        A unit elides when the tensors autograd saved in its forwards since the last backward
        share no storage with its unsharded parameters (an embedding, a linear layer whose input
        needs no gradient): the gradients are the same, bit for bit, without the all-gather
        (``flashfsdp.bindings.elision``). The default for new units comes from the environment
        variable ``FLASHFSDP_BACKWARD_ALL_GATHER_ELISION`` (1 or 0). ``recurse``: also every
        fully_shard'ed module below this one.

        Raises:
            TypeError: ``enabled`` is not a bool.
            ValueError: this module was never passed to ``fully_shard``.
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"set_backward_all_gather_elision: enabled must be a bool, got {enabled!r}")
        for state in states_of(self, recurse, "set_backward_all_gather_elision"):
            set_enabled(state, enabled)

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Whether the next backward is the last of the step (default True). With False the end of
        that backward does not wait for the gradient reductions in flight; the next root forward
        does (micro-batching). Set it back to True before the micro-batch whose gradients the
        optimizer will read."""
        state_of(self, "set_is_last_backward").set_is_last_backward(bool(is_last_backward))

    def set_unsharded_init(self, enabled: bool = True, *, recurse: bool = True) -> None:
        """flashfsdp only: initialise a meta-device model as the unsharded model would be.

        By default, as in FSDP2, the parameters after ``to_empty`` are DTensors and an init
        (``reset_parameters()``, ``init_weights()``) runs DTensor's ops on them: a random op draws
        each rank's chunk on its own, so the values are FSDP2's, not those the unsharded model gets
        from the same seed. With this on (call it before ``to_empty``), ``to_empty`` opens the
        init window (``runtime/init_window.py``): until the model's first use each parameter acts
        as its full-shape tensor, every rank draws the full values and keeps its rows, so the
        shards hold exactly the unsharded model's values at any world size. ``recurse``: also
        every fully_shard'ed module below this one.

        Raises:
            TypeError: ``enabled`` is not a bool.
            ValueError: this module was never passed to ``fully_shard``.
        """
        if not isinstance(enabled, bool):
            raise TypeError(f"set_unsharded_init: enabled must be a bool, got {enabled!r}")
        for state in states_of(self, recurse, "set_unsharded_init"):
            state.unsharded_init = enabled

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: all-reduce the reduce-scattered gradients across replicas (True, the default) or
        only reduce-scatter them (False): the shards are then summed, without gradients, until a
        backward with the all-reduce, which adds them in (gradient accumulation with the
        intra-replica reduce-scatter only, as FSDP2). A 1-D mesh has no all-reduce to skip.
        ``recurse``: also every fully_shard'ed module below this one."""
        for state in states_of(self, recurse, "set_requires_all_reduce"):
            state.unit.requires_all_reduce = bool(requires_all_reduce)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this unit's summed gradients by ``factor`` instead of the world size.

        Raises:
            ValueError: ``factor`` is not a positive number.
        """
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
            raise ValueError(f"set_gradient_divide_factor: factor must be a positive number, got {factor!r}")
        state_of(self, "set_gradient_divide_factor").unit.gradient_divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated name of :meth:`set_gradient_divide_factor` (as in FSDP2)."""
        warnings.warn("Use `set_gradient_divide_factor` instead", DeprecationWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Only ever reduce with SUM. flashfsdp always does (the divide is a scale in the pack and
        post-reduce kernels), so the gradients do not change; what an all-reduce hook
        (:meth:`set_all_reduce_hook`) receives does, as in FSDP2: the sum instead of the average."""
        state = state_of(self, "set_force_sum_reduction_for_comms")
        state.force_sum_reduction = state.unit.force_sum_reduction = bool(enable)

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """Give parameters that got no gradient on any rank a zero gradient (True) instead of None
        (False, the default). Flat units always reduce zeros for them, so usage that differs across
        ranks (mixture of experts) never mismatches the collective either way."""
        for state in states_of(self, recurse, "set_reduce_scatter_unused_params"):
            state.unit.reduce_unused_params = bool(reduce_scatter_unused_params)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream=None) -> None:
        """Call ``hook(reduce_output)`` on each reduction of this unit before it is accumulated,
        with FSDP2's tensor: 1-D, ``reduce_dtype``, this rank's chunk of every parameter that got a
        gradient (padded to ``ceil(dim0 / W)`` rows, as FSDP2 pads it), back to back in parameter
        order, averaged over the ranks (the sum under ``set_force_sum_reduction_for_comms(True)``;
        fp16 reductions: pre-divided, as FSDP2); e.g. for a user's own all-reduce across replicas.
        What the hook writes into it is what gets accumulated (then divided by the rest). Under
        HSDP it runs on the output of the all-reduce across replicas (as FSDP2). One call per flat
        group of trainable parameters (a unit whose parameters differ in dtype has several). On
        CUDA it runs on ``stream`` (default: the reduce-scatter stream) ordered after the
        reduction (``runtime/reduce.py``, [Note: all-reduce hook]).

        Raises:
            TypeError: ``hook`` is not callable.
            ValueError: a ``stream`` under HSDP (the hook runs where the all-reduce ran, as FSDP2).
        """
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook: hook must be callable, got {type(hook).__name__}")
        unit = state_of(self, "set_all_reduce_hook").unit
        if stream is not None and unit.replicate_comm is not None:
            raise ValueError("set_all_reduce_hook: stream cannot be set when using native HSDP (a 2-D mesh): the hook "
                             "runs on the stream of the all-reduce across replicas; pass no stream")
        unit.all_reduce_hook, unit.all_reduce_hook_stream = hook, stream

    def set_post_optim_event(self, event) -> None:
        """The root's first all-gather of the next step waits on ``event`` (recorded after the
        optimizer step) instead of the whole compute stream; used once. No-op on CPU."""
        state_of(self, "set_post_optim_event").unit.streams.set_post_optim_event(event)

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many units' packed gradients may stay in flight before the compute stream waits for
        the oldest pack (CUDA; default 1). More hides an exposed reduce-scatter, at the memory of
        one unit's gradients each.

        Raises:
            TypeError: not an integer.
            ValueError: an integer < 1.
        """
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"set_reduce_scatter_max_input_buffers: must be an integer >= 1, got {max_input_buffers!r}")
        if max_input_buffers < 1:
            raise ValueError(f"set_reduce_scatter_max_input_buffers: must be an integer >= 1, got {max_input_buffers!r}")
        for state in states_of(self, recurse, "set_reduce_scatter_max_input_buffers"):
            state.unit.streams.max_held = max_input_buffers

    def set_max_inflight_all_gathers(self, max_inflight: int) -> None:
        """Let at most ``max_inflight`` all-gathers be prefetched (unsharded) ahead of compute; the
        units gathered in one bucket (``set_bucket_bytes``) count as one.

        Default 2; 0 disables prefetching (each unit, or bucket, is all-gathered when its forward
        or backward starts). Only the root's value counts, for every unit under it: call this on the root.
        Implicit prefetching asks for one unit at a time (the next in forward, the previous in
        backward), explicit lists can ask for more and get the first ones that fit.

        Raises:
            ValueError: ``max_inflight`` is not an integer >= 0; this module was never passed to
                ``fully_shard``; or it is not the root (known once the root's first forward ran:
                then here, else at that forward).
        """
        if not isinstance(max_inflight, int) or isinstance(max_inflight, bool) or max_inflight < 0:
            raise ValueError(f"set_max_inflight_all_gathers: max_inflight must be an integer >= 0, got {max_inflight!r}")
        state_of(self, "set_max_inflight_all_gathers").set_max_inflight(max_inflight)

    def set_bucket_bytes(self, nbytes: int) -> None:
        """Let units that run back to back share their collectives, up to ``nbytes`` per bucket
        (flashfsdp only; FSDP2 has no counterpart).

        Where a unit is all-gathered, the units that come next in the step's order (forward: the
        last step's forward order; backward: the reverse of this step's) and are gathered there
        too are all-gathered with it in one collective, while their gathered bytes add up to at
        most ``nbytes``; reductions likewise share one reduce-scatter in the order their gradients
        become ready. Values are those of unit-by-unit collectives (each output element is the
        same sum), every unit still unshards, reshards and reduces as its own settings say, and
        memory grows by at most ``nbytes`` (parameters gathered a little ahead of their use,
        gradients held until their bucket is packed). Default 4 MiB, or the environment variable
        ``FLASHFSDP_BUCKET_BYTES`` read when the root's first forward runs; 0: every unit has its
        own collectives, as in FSDP2. Only the root's value counts, for every unit under it. Units
        that cannot share (int8 all-gathers, all-gather extensions, CPU offload, ``Shard(k)``
        parameters with k != 0, post-forward regathers of ``reshard_after_forward=<int>``) keep
        their own collectives. See ``runtime/step.py``, [Note: buckets].

        Raises:
            TypeError: ``nbytes`` is not an int.
            ValueError: ``nbytes`` < 0; this module was never passed to ``fully_shard``; or it is
                not the root (known once the root's first forward ran: then here, else at that
                forward).
        """
        state_of(self, "set_bucket_bytes").set_bucket_bytes(nbytes)

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Unshard these units when this one starts its forward (replaces the implicit choice)."""
        where = "set_modules_to_forward_prefetch"
        state_of(self, where).settings.forward_prefetch = [state_of(m, where) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Unshard these units when this one starts its backward (replaces the implicit choice)."""
        where = "set_modules_to_backward_prefetch"
        state_of(self, where).settings.backward_prefetch = [state_of(m, where) for m in modules]

    def reset_iter_state(self) -> None:
        """Recover after an exception aborted a forward or backward: wait for collectives in flight,
        reshard every unit, drop the reductions in flight (the failed step's gradients are lost;
        restart a gradient-accumulation sequence) and clear the step's bookkeeping. Call it on the
        root.

        Raises:
            RuntimeError: called on a module that is not the root.
        """
        state_of(self, "reset_iter_state").reset_iter_state()

    def set_custom_all_gather(self, comm) -> None:
        """Run this unit's all-gathers (not its submodules') through ``comm``, a torch FSDP2
        ``AllGather`` object, called as FSDP2 calls it: ``allocate`` gives the output buffer, then
        ``comm(output_tensor=, input_tensor=, group=, async_op=True)`` over the unit's process group
        (``flashfsdp/runtime/custom_collectives.py``). The unit then all-gathers alone (no bucket).

        Raises:
            TypeError: ``comm`` is not an ``AllGather``.
            ValueError: the unit's communicator runs over no torch.distributed process group.
        """
        custom_all_gather(state_of(self, "set_custom_all_gather").unit, comm)

    def set_custom_reduce_scatter(self, comm) -> None:
        """Run this unit's reduce-scatters through ``comm``, a torch FSDP2 ``ReduceScatter``
        object: ``allocate`` gives the input buffer, then ``comm(output_tensor=, input_tensor=,
        group=, op=, async_op=True)``; the unit then reduces alone (no bucket). See
        :meth:`set_custom_all_gather`.

        Raises:
            TypeError: ``comm`` is not a ``ReduceScatter``.
            ValueError: the unit's communicator runs over no torch.distributed process group.
        """
        custom_reduce_scatter(state_of(self, "set_custom_reduce_scatter").unit, comm)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Not supported: the NCCL communicator enqueues on buffers from PyTorch's caching
        allocator (its own streams); there is no process-group memory pool to allocate from."""
        raise NotImplementedError(
            "set_allocate_memory_from_process_group_for_comm: flashfsdp's collective buffers come from PyTorch's "
            "caching allocator on its own streams; there is no process-group memory pool to use")

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Not supported: symmetric-memory all-gathers belong to torch's NCCL process group, which
        flashfsdp's CuPy NCCL communicator does not use."""
        raise NotImplementedError(
            "set_symm_mem_for_comm: flashfsdp's NCCL collectives run through CuPy, not torch's symmetric memory; "
            "use torch.distributed.fsdp.fully_shard for copy-engine all-gathers")

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Run this unit's reduce-scatters on a communicator of their own (a new process group over
        the same ranks), so they can progress concurrently with all-gathers. Collective: call it on
        every rank, in the same order."""
        for state in states_of(self, recurse, "set_separate_reduce_scatter_group"):
            state.set_separate_reduce_scatter_group(bool(enable))

    def _get_fsdp_state(self):
        """torch's private accessor of its own FSDP state, which a flashfsdp unit does not have.

        Raises:
            NotImplementedError: always, naming the public method to use instead.
        """
        raise NotImplementedError(
            f"{type(self).__name__} is a flashfsdp unit: torch's private FSDP state does not exist; use the public "
            f"FSDPModule methods (unshard, reshard, set_*), which flashfsdp implements")


def states_of(module: nn.Module, recurse: bool, where: str) -> list[FSDPState]:
    """``module``'s state, and with ``recurse`` those of every fully_shard'ed module below it.

    Raises:
        ValueError: ``module`` itself was never passed to ``fully_shard``.
    """
    states = [state_of(module, where)]
    if recurse:
        states = []
        for m in module.modules():
            state = m.__dict__.get("_flashfsdp_state")
            if state is not None and state not in states:
                states.append(state)
    return states


def state_of(module: nn.Module, where: str) -> FSDPState:
    """The FSDPState of a fully_shard'ed module.

    Raises:
        ValueError: ``module`` was never passed to ``fully_shard``.
    """
    state = module.__dict__.get("_flashfsdp_state") if isinstance(module, nn.Module) else None
    if state is None:
        raise ValueError(
            f"{where}: {type(module).__name__} is not a fully_shard'ed module; call flashfsdp.fully_shard on it first"
        )
    return state


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` unshard and reshard like ``forward`` (e.g. ``generate``).

    FSDP only knows ``nn.Module.forward``; other entry points (``model.generate()`` of a Hugging Face
    model) would run on the sharded pieces. The method is wrapped in the unit's pre- and
    post-forward, as FSDP2's function of the same name does. A module that is not fully_shard'ed is
    left as it is (so the same code runs with and without flashfsdp).

    Raises:
        ValueError: ``module`` has no method ``method_name``.
    """
    if not isinstance(module, FSDPModule):
        return
    if not callable(getattr(module, method_name, None)):
        raise ValueError(f"register_fsdp_forward_method: {type(module).__name__} has no method '{method_name}'")
    orig = getattr(module, method_name)

    @functools.wraps(orig)
    def wrapped(self, *args, **kwargs):
        state = state_of(self, method_name)
        try:
            args, kwargs = state._pre_forward(self, args, kwargs)
            return state._post_forward(self, args, orig(*args, **kwargs))
        finally:  # what the module's always-called forward hook does after a forward
            end_forward(state)

    setattr(module, method_name, wrapped.__get__(module, type(module)))


def share_comm_ctx(modules: list[FSDPModule]) -> None:
    """FSDP2's stream sharing between roots (pipeline stages). flashfsdp's units on one device
    already share one all-gather and one reduce-scatter stream, so this only checks its input.

    Raises:
        ValueError: an element is not a fully_shard'ed module.
    """
    for module in modules:
        if not isinstance(module, FSDPModule):
            raise ValueError(f"share_comm_ctx: expects a list of fully_shard'ed modules, got {type(module).__name__}")
