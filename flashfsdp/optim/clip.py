"""Gradient clipping inside the optimizer step: one norm, then the clip folded into the step.

``flashfsdp.clip_grad_norm_(model, max_norm)`` followed by ``optimizer.step()`` reads every
gradient three times: for the norm, to multiply it by the clip coefficient, and in the step.
torch's fused kernels (``torch._fused_adamw_``, CPU and CUDA) divide each gradient by a
``grad_scale`` tensor as they read it, so an optimizer that knows the coefficient passes
``grad_scale = 1 / coef`` instead and the clip costs no pass of its own. The norm is
:func:`flashfsdp.runtime.grad_norm.total_grad_norm` (the one ``clip_grad_norm_`` uses: one
all-reduce per communicator; parameters outside any unit count only when their gradients are the
same on every rank, else every rank raises); the coefficient is torch's
(``torch.nn.utils.clip_grad_norm_``): ``coef = min(1, max_norm / (norm + 1e-6))``, computed on
the device, without a host synchronisation.
"""

from __future__ import annotations

import math

import torch

from flashfsdp._torch_private import foreach_mul_
from flashfsdp.runtime.grad_norm import total_grad_norm, unit_communicators
from flashfsdp.runtime.sharding_spec import local_of


def check_max_grad_norm(owner: str, max_grad_norm) -> float | None:
    """``max_grad_norm`` as a float (None stays None).

    Raises:
        ValueError: ``max_grad_norm`` is not a finite number > 0.
    """
    if max_grad_norm is None:
        return None
    try:
        value = float(max_grad_norm)
    except (TypeError, ValueError):
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{owner}: max_grad_norm must be a finite number > 0 (or None not to clip), "
                         f"got {max_grad_norm!r}")
    return value


class ClipInStepMixin:
    """Clip by the global gradient norm within ``step()`` (see the module docstring).

    The optimizer sets ``self.max_grad_norm`` (via :func:`check_max_grad_norm`), steps through
    :meth:`_clipped_step` (the closure, then the norm, then ``_flat_step``) and takes each
    functional call's ``grad_scale`` from :meth:`_grad_scale_for` (fused: the clip folded into
    it; otherwise the gradients scaled first by one ``_foreach_mul_``, the same result).
    ``last_grad_norm`` is the 0-d fp32 norm of the last step's gradients (unscaled by an AMP
    ``grad_scale`` if one was set), or None before the first clipping step.
    """

    max_grad_norm: float | None = None
    last_grad_norm: torch.Tensor | None = None
    _clip_coef: torch.Tensor | None = None

    def _clipped_step(self, closure):
        """Run ``closure`` (with grad), compute the norm and coefficient, step every group flat."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._prepare_clip()
        self._flat_step(None)
        return loss

    def _grad_scale_for(self, grads: list[torch.Tensor], fused) -> torch.Tensor | None:
        """The ``grad_scale`` argument of one functional call over ``grads``: fused, the clip folded
        into it; otherwise the gradients are multiplied by the coefficient now."""
        if fused:
            return self._clip_grad_scale()
        self._clip_grads(grads)
        return getattr(self, "grad_scale", None)

    def _prepare_clip(self) -> None:
        """Compute the global 2-norm of every parameter's gradient and the clip coefficient
        (collective over the units' communicators, on every rank alike)."""
        self._clip_coef = None
        if self.max_grad_norm is None:
            return
        params = [p for group in self.param_groups for p in group["params"]]
        grads = [p.grad for p in params if p.grad is not None]
        comms = unit_communicators(params)
        if not grads and not comms:
            self.last_grad_norm = torch.tensor(0.0)
            return
        device = grads[0].device if grads else next(iter(comms.values()))[1]
        norm = total_grad_norm(params, 2.0, device, comms)
        amp_scale = getattr(self, "grad_scale", None)
        if amp_scale is not None:  # gradients still multiplied by the GradScaler's scale
            norm = norm / amp_scale.to(norm.device, torch.float32)
        self.last_grad_norm = norm
        self._clip_coef = torch.clamp(self.max_grad_norm / (norm + 1e-6), max=1.0)

    def _clip_grad_scale(self) -> torch.Tensor | None:
        """The ``grad_scale`` for a fused call: the AMP scale (if set) divided by the coefficient."""
        amp_scale = getattr(self, "grad_scale", None)
        if self._clip_coef is None:
            return amp_scale
        inverse = 1.0 / self._clip_coef
        return inverse if amp_scale is None else amp_scale.to(inverse.device, torch.float32) * inverse

    def _clip_grads(self, grads: list[torch.Tensor]) -> None:
        """Multiply ``grads`` by the coefficient in place (non-fused paths)."""
        if self._clip_coef is None or not grads:
            return
        grads = [local_of(g) for g in grads]  # (DTensor gradients: their local chunks, in place)
        coef = self._clip_coef.to(grads[0].device)
        foreach_mul_(grads, coef.to(grads[0].dtype) if len({g.dtype for g in grads}) == 1 else coef)
