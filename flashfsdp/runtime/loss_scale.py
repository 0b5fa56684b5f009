"""Dynamic loss scaling on the gradient path: the reduction unscales in the accumulate pass.

A dynamic loss scaler (``flashfsdp.ShardedGradScaler``) multiplies the loss by a scale S before
backward, so every gradient arrives multiplied by S, and divides them by S again before the
optimizer step, skipping the step if any gradient is inf/nan. For a flat group it unscales, the
division needs no pass of its own: ``accumulate_grad_shard`` already multiplies the reduced shard
by the post-divide factor and reports an inf/nan flag of the stored values, so the reduction uses
``post_scale / S`` instead and the flag it returns is the unscaled gradient's flag.

The protocol (no ``nn.Module`` or optimizer knowledge here):

- the scaler :func:`attach`\\ es one :class:`LossScale` to each flat group whose gradients it
  unscaled once (it learns them from its optimizer's parameters);
- :meth:`LossScale.arm` when the loss is scaled (S is then known before backward),
  :meth:`LossScale.disarm` when the scaler updates S at the end of the step;
- the reduction asks :func:`kernel_scale` for the factor of its pass and :func:`record`\\ s which
  S the group's gradient shard is now divided by;
- the scaler asks :func:`unscaled_by` which S a group's shard was divided by: its ``grad_stats``
  flag is then the inf/nan flag of the unscaled gradient, read without touching the gradient.

A group whose shard already holds a gradient that was not divided by the armed S (gradients
accumulated without a scaler, or modified in place since) is reduced without unscaling and left
to the scaler's explicit pass, which then divides the whole shard, as ``torch.amp.GradScaler``
would.
"""

from __future__ import annotations

import math
import struct
import warnings
import weakref
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .flat_param import FlatParam

# Smallest positive normal float32: a kernel factor below it would lose digits (or be zero).
_FP32_TINY = 2.0**-126


class LossScale:
    """The loss scale a dynamic scaler has armed for the gradients now being produced.

    Attributes:
        value: S (a float32 value, as a Python float) while armed, else None.
    """

    def __init__(self) -> None:
        self.value: float | None = None

    def arm(self, scale: float) -> None:
        """The loss of this step is multiplied by ``scale`` (> 0): reductions divide by it."""
        global _armed_once
        self.value = float(scale)
        _armed_once = True

    def disarm(self) -> None:
        """The step is over (the scale may change): reductions stop dividing."""
        self.value = None


_attached: "weakref.WeakKeyDictionary[FlatParam, LossScale]" = weakref.WeakKeyDictionary()
_unscaled: "weakref.WeakKeyDictionary[FlatParam, tuple[float, tuple]]" = weakref.WeakKeyDictionary()
_armed_once = False  # some LossScale was armed in this process (for the fp16 warning)
_warned = False


def attach(group: "FlatParam", loss_scale: LossScale) -> None:
    """Let ``loss_scale`` (while armed) unscale ``group``'s reductions (replaces an earlier one)."""
    _attached[group] = loss_scale


def fp32(value: float) -> float:
    """``value`` rounded to float32 (nearest even; inf beyond its range), as a Python float."""
    try:
        return struct.unpack("f", struct.pack("f", value))[0]
    except OverflowError:
        return math.copysign(math.inf, value)


def unscaled_by(group: "FlatParam") -> float | None:
    """The loss scale S that ``group.sharded_grad`` is divided by, if its reduction unscaled it
    and nothing changed the shard since (its ``grad_stats`` are those of that pass); else None."""
    record = _unscaled.get(group)
    if record is None or group.grad_stats is not record[1] or group.sharded_grad is None:
        return None
    return record[0] if group.sharded_grad._version == record[1][2] else None


def kernel_scale(group: "FlatParam", post_scale: float, accumulate: bool) -> tuple[float, float | None]:
    """The factor of ``group``'s accumulate pass and the loss scale it divides by (or None).

    ``post_scale / S`` when a :class:`LossScale` attached to the group is armed with S, the
    quotient is a normal float32, and the shard's earlier content (``accumulate``) was divided by
    the same S; else ``post_scale`` (the gradient stays scaled for the scaler's explicit pass).
    """
    loss_scale = _attached.get(group)
    scale = None if loss_scale is None else loss_scale.value
    if scale is None or (accumulate and unscaled_by(group) != scale):
        return post_scale, None
    fused = fp32(post_scale / scale)
    if not (math.isfinite(fused) and abs(fused) >= _FP32_TINY):
        return post_scale, None
    return post_scale / scale, scale


def record(group: "FlatParam", scale: float | None) -> None:
    """After ``group``'s accumulate pass (``group.grad_stats`` set): its shard is divided by
    ``scale`` (None: it is not)."""
    if scale is None:
        _unscaled.pop(group, None)
    else:
        _unscaled[group] = (scale, group.grad_stats)


def warn_if_unscaled(unit_name: str, param_dtype: torch.dtype, reduce_dtype: torch.dtype) -> None:
    """Warn once per process when a float16 unit reduces gradients and no flashfsdp loss scaler
    has scaled a loss: float16 gradients underflow to zero (or overflow) without loss scaling."""
    global _warned
    if _warned or _armed_once or torch.float16 not in (param_dtype, reduce_dtype):
        return
    _warned = True
    warnings.warn(
        f"flashfsdp: unit {unit_name!r} computes or reduces gradients in float16 but no loss scaler "
        "scaled the loss: small gradients underflow to zero in float16. Use flashfsdp.ShardedGradScaler "
        "(scaler.scale(loss).backward(); scaler.step(optimizer); scaler.update()), which also unscales "
        "in the reduction's own pass, or compute in bfloat16 (this warning is shown once).",
        UserWarning, stacklevel=2)
