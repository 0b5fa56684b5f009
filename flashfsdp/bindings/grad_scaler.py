"""ShardedGradScaler: dynamic loss scaling for float16 training, unscaled in the reduction's pass.

A drop-in for ``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler`` (and usable where
code takes a ``torch.amp.GradScaler``: it is a subclass of both). The algorithm is torch's
(``torch/amp/grad_scaler.py``, after Micikevicius et al., "Mixed Precision Training", 2018):
multiply the loss by S, divide the gradients by S before the optimizer step, skip the step if any
gradient on any rank is inf/nan, then multiply S by ``backoff_factor`` after a skipped step or by
``growth_factor`` after ``growth_interval`` clean steps in a row.

What differs is where the division happens. For the gradients of flashfsdp units, the reduction's
``accumulate_grad_shard`` pass (post-divide, cast, accumulate, squared norm, inf/nan flag) also
divides by S once the scaler knows them (from its first ``unscale_``) and S is known before
backward (``scale(loss)`` was called): see ``flashfsdp.runtime.loss_scale``. ``unscale_`` then
reads only the per-group flags it recorded, ORs them into one flag and all-reduces that one flag
(one collective per optimizer and step); only gradients no reduction unscaled get a pass of their
own (``flashfsdp.bindings.unscale``). A visible consequence: between ``backward`` and
``unscale_`` such gradients already hold unscaled values (torch's hold scaled ones; only code that
reads ``.grad`` before ``unscale_`` can tell). ``clip_grad_norm_`` after ``unscale_`` sees the true
gradients (with the fused squared norm of the same pass).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import OptState
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler as TorchShardedGradScaler

from flashfsdp._torch_private import refresh_per_optimizer_state
from flashfsdp.runtime import loss_scale
from flashfsdp.runtime.sharding_spec import local_of

from .unscale import SCALED, plan_unscale

def _check_arguments(init_scale, backoff_factor, growth_factor, growth_interval) -> None:
    """Raise ValueError naming the first bad constructor argument."""
    if not (isinstance(init_scale, (int, float)) and 0 < init_scale < float("inf")):
        raise ValueError(f"ShardedGradScaler: init_scale must be a positive finite number, got {init_scale!r}")
    if not growth_factor > 1.0:
        raise ValueError(f"ShardedGradScaler: growth_factor must be > 1, got {growth_factor!r}")
    if not 0.0 < backoff_factor < 1.0:
        raise ValueError(f"ShardedGradScaler: backoff_factor must be in (0, 1), got {backoff_factor!r}")
    if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
        raise ValueError(f"ShardedGradScaler: growth_interval must be a positive int, got {growth_interval!r}")


class _Local:
    """A parameter as ``_unscale_grads_`` sees it: its gradient's local tensor (a DTensor
    gradient's chunk, unscaled in place without DTensor's dispatch, whose inf/nan check would
    all-reduce the flag once more on its own)."""

    __slots__ = ("grad",)

    def __init__(self, param: torch.Tensor):
        self.grad = None if param.grad is None else local_of(param.grad)


class _Params:
    """An optimizer-like view of some parameters (what ``_unscale_grads_`` reads)."""

    def __init__(self, params: list[torch.Tensor]):
        self.param_groups = [{"params": [_Local(p) for p in params]}]


def next_scale(scale: float, tracker: int, found_inf: bool, growth_factor: float, backoff_factor: float,
               growth_interval: int) -> tuple[float, int]:
    """The scale and growth tracker after one step (float32 scale, as a Python float).

    Source: torch's ``_amp_update_scale_`` kernel (aten/src/ATen/native/cuda/AmpKernels.cu):
    an inf/nan backs the scale off and resets the tracker; otherwise the tracker counts clean
    steps and, at ``growth_interval``, the scale grows (if the result is finite) and it resets.
    """
    if found_inf:
        return loss_scale.fp32(scale * backoff_factor), 0
    tracker += 1
    if tracker == growth_interval:
        grown = loss_scale.fp32(scale * growth_factor)
        return (grown if grown != float("inf") else scale), 0
    return scale, tracker


class ShardedGradScaler(TorchShardedGradScaler):
    """Dynamic loss scaling for sharded float16 training; torch's ``ShardedGradScaler`` API.

    Usage (as torch's)::

        scaler = flashfsdp.ShardedGradScaler("cuda")     # "cpu" for a CPU model
        loss = model(batch)
        scaler.scale(loss).backward()                   # gradients are unscaled in the reduction
        scaler.unscale_(optim)                          # optional: reads the flags only
        flashfsdp.clip_grad_norm_(model, 1.0)           # the true norm
        scaler.step(optim)                              # skipped if any rank saw inf/nan
        scaler.update()

    Args (torch's): device ("cuda", "cpu", ...), init_scale (2**16), backoff_factor (0.5, < 1),
        growth_factor (2.0, > 1), growth_interval (2000 steps), enabled (False: every method is
        a no-op and ``step`` just steps), process_group (the group the inf/nan flag is summed
        over when the optimizer's sharded parameters do not all share one flashfsdp
        communicator spanning as many ranks; default: the default group).

    Works on any model: gradients no flashfsdp reduction unscaled (an unsharded model, ignored
    parameters) are unscaled by an explicit pass as torch's ``GradScaler`` does, and without an
    initialised process group nothing is all-reduced. Its ``state_dict()`` holds only numbers, so
    ``flashfsdp.checkpoint.save(..., extra={"grad_scaler": scaler.state_dict()})`` stores it.

    Raises:
        ValueError: init_scale not a positive finite number, growth_factor <= 1, backoff_factor
            outside (0, 1), growth_interval not a positive int (torch raises AssertionError for
            the factors and checks nothing else).
        RuntimeError: (as torch's) ``unscale_`` twice or after ``step`` in one iteration,
            ``step(closure=...)``.

    Attributes:
        steps_skipped: optimizer steps ``step`` skipped for inf/nan gradients since construction.
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16, backoff_factor: float = 0.5,
                 growth_factor: float = 2.0, growth_interval: int = 2000, enabled: bool = True,
                 process_group: Any = None) -> None:
        if enabled:
            _check_arguments(init_scale, backoff_factor, growth_factor, growth_interval)
        super().__init__(device, init_scale=init_scale, backoff_factor=backoff_factor, growth_factor=growth_factor,
                         growth_interval=growth_interval, enabled=enabled, process_group=process_group)
        self._loss_scale = loss_scale.LossScale()
        self._host_scale: float | None = None  # the scale tensor's value, known without a sync
        self._host_tracker: int | None = None
        self.steps_skipped = 0

    # ------------------------------------------------------------ the scale, mirrored on the host
    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._host_scale, self._host_tracker = loss_scale.fp32(self._init_scale), int(self._init_growth_tracker)

    def _scale_value(self) -> float:
        """The current scale as a float (a device sync only after ``load_state_dict`` or
        ``update(tensor)``)."""
        if self._host_scale is None:
            self._host_scale = float(self._scale.item())
        return self._host_scale

    def _tracker_value(self) -> int:
        if self._host_tracker is None:
            self._host_tracker = int(self._growth_tracker.item())
        return self._host_tracker

    def get_scale(self) -> float:
        """The current scale (torch's ``get_scale``; no device sync here)."""
        if self._enabled and self._scale is not None:
            return self._scale_value()
        return super().get_scale()

    def _get_growth_tracker(self) -> int:
        if self._enabled and self._growth_tracker is not None:
            return self._tracker_value()
        return super()._get_growth_tracker()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load ``state_dict()`` output (torch's format: scale, factors, interval, tracker)."""
        super().load_state_dict(state_dict)
        self._host_scale = self._host_tracker = None

    # ------------------------------------------------------------ the step
    def scale(self, outputs):
        """Multiply ``outputs`` (a tensor or nested lists/tuples of tensors) by the scale, and arm
        the reductions of this step's backward to divide by it."""
        scaled = super().scale(outputs)
        if self._enabled:
            self._loss_scale.arm(self._scale_value())
        return scaled

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide ``optimizer``'s gradients by the scale (where the reduction did not already) and
        record whether any rank holds an inf/nan gradient (one all-reduce of one flag).

        Raises:
            RuntimeError: called twice for ``optimizer`` since the last ``update()``, or after
                ``step(optimizer)``.
        """
        if not self._enabled:
            return
        self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED:
            raise RuntimeError("unscale_() has already been called on this optimizer since the last update().")
        if state["stage"] is OptState.STEPPED:
            raise RuntimeError("unscale_() is being called after step().")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        plan = plan_unscale(params, self._scale_value())
        for group in plan.groups:
            loss_scale.attach(group, self._loss_scale)
        comm, device = self._flag_communicator(plan)
        found_inf = self._found_inf(plan, device or self._scale.device)
        self._all_reduce(found_inf, comm)
        state["found_inf_per_device"] = {found_inf.device: found_inf}
        state["stage"] = OptState.UNSCALED

    def _found_inf(self, plan, device: torch.device) -> torch.Tensor:
        """This rank's inf/nan flag (0-dim float32 on ``device``, 1.0 for inf/nan): from the
        fused flags and the explicit passes."""
        found_inf = torch.zeros((), dtype=torch.float32, device=device)  # 0-dim: fused optimizers take it
        for factor, params in plan.explicit.items():
            if not params:
                continue
            inv = (self._scale.double().reciprocal().float() if factor is SCALED
                   else torch.full((), factor, dtype=torch.float32, device=self._scale.device))
            flags = self._unscale_grads_(_Params(params), inv, torch.zeros((), device=self._scale.device), True)
            # torch's unscale kernel leaves version counters alone: bump them, so that the squared
            # norm cached by the reduction (clip_grad_norm_) is known to be stale.
            for p in params:
                if not p.grad.is_sparse:
                    torch.autograd.graph.increment_version(local_of(p.grad))
            for flag in flags.values():
                found_inf += flag.to(device)
        if plan.flags:
            found_inf += torch.stack([f.to(device) for f in plan.flags]).any()
        return found_inf.clamp_(max=1.0)  # 0 or 1 per rank, as torch's flags

    def _flag_communicator(self, plan):
        """(communicator, its device) the flag is all-reduced over: the units' one flashfsdp
        communicator when it spans ``process_group``'s ranks; else (None, None)."""
        if len(plan.comms) != 1:
            return None, None
        ((comm, device),) = plan.comms.values()
        if dist.is_available() and dist.is_initialized() and comm.world_size != dist.get_world_size(self.process_group):
            return None, None
        return comm, device

    def _all_reduce(self, found_inf: torch.Tensor, comm) -> None:
        """Sum ``found_inf`` over the ranks: over ``comm``, else over ``process_group`` as torch's
        ``ShardedGradScaler`` does (nothing without an initialised process group)."""
        if comm is not None:
            comm.all_reduce(found_inf, op="sum").wait()
            return
        if not (dist.is_available() and dist.is_initialized()):
            return
        if self._device != "cpu" and found_inf.device.type == "cpu":
            on_device = found_inf.to(self._device)
            dist.all_reduce(on_device, group=self.process_group)
            found_inf.copy_(on_device)
        else:
            dist.all_reduce(found_inf, group=self.process_group)

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """``unscale_(optimizer)`` if not done yet, then ``optimizer.step(*args, **kwargs)`` unless
        any rank found an inf/nan gradient (returns its result, or None when skipped)."""
        if (self._enabled and "closure" not in kwargs and getattr(optimizer, "_step_supports_amp_scaling", False)
                and self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY):
            self.unscale_(optimizer)  # the gradients may be unscaled already: no grad_scale for it
        return super().step(optimizer, *args, **kwargs)

    def _maybe_opt_step(self, optimizer, optimizer_state: dict, *args, **kwargs):
        found = sum(v.item() for v in optimizer_state["found_inf_per_device"].values())
        optimizer_state["found_inf_host"] = found
        if found:
            self.steps_skipped += 1
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Update the scale for the next iteration (torch's ``update``: back off after a skipped
        step, grow after ``growth_interval`` clean ones; or set ``new_scale``).

        Raises:
            AssertionError: (as torch) no ``unscale_``/``step`` recorded a flag since the last update.
        """
        if not self._enabled:
            return
        self._loss_scale.disarm()
        if new_scale is not None:
            super().update(new_scale)
            self._host_scale = loss_scale.fp32(new_scale) if isinstance(new_scale, float) else None
            return
        self._check_scale_growth_tracker("update")
        states = list(self._per_optimizer_states.values())
        if not any(s["found_inf_per_device"] for s in states):
            raise AssertionError("No inf checks were recorded prior to update.")
        found = any(self._found_inf_host(s) for s in states)
        scale, tracker = next_scale(self._scale_value(), self._tracker_value(), found, self._growth_factor,
                                    self._backoff_factor, self._growth_interval)
        self._scale.fill_(scale)
        self._growth_tracker.fill_(tracker)
        self._host_scale, self._host_tracker = scale, tracker
        self._per_optimizer_states = defaultdict(refresh_per_optimizer_state)

    @staticmethod
    def _found_inf_host(state: dict) -> bool:
        """Whether an optimizer's step saw an inf/nan (from ``step``'s own read, else a sync)."""
        if "found_inf_host" in state:
            return state["found_inf_host"] > 0
        return sum(v.item() for v in state["found_inf_per_device"].values()) > 0
