"""clip_grad_norm_: the true global gradient norm of a sharded model, and clipping to it (the norm
itself: ``flashfsdp.runtime.grad_norm``)."""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from flashfsdp._torch_private import foreach_mul_
from flashfsdp.runtime.agreement import raise_own
from flashfsdp.runtime.grad_norm import total_grad_norm, unit_communicators
from flashfsdp.runtime.sharding_spec import local_of
from flashfsdp.runtime.init_window import close_init_windows

__all__ = ["clip_grad_norm_", "total_grad_norm", "unit_communicators"]


def clip_grad_norm_(
    model_or_params: nn.Module | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients by the norm of *all* gradients across ranks; return that norm.

    Sharded parameters (DTensors over their unit's flat shard) contribute their local chunk,
    summed over the unit's ranks (max for ``norm_type=inf``) in one all-reduce per unit
    communicator; other parameters (e.g. ``ignored_params``) count once, when their gradients are
    the same on every rank (else every rank raises: see Returns). The stock
    ``torch.nn.utils.clip_grad_norm_`` gives the same norm on DTensor gradients (FSDP2's way: one
    DTensor reduction per parameter group); this one reads the units' flat layout instead.
    The norm is read from the gradients as they are now: a squared norm cached at the reduction
    could be stale without any sign of it (torch's ``GradScaler.unscale_`` and in-place ops
    through ``.grad.data`` change gradients without bumping their version counters).

    Collective over the communicators of the units whose parameters are given (one all-reduce
    each), with or without gradients on this rank, so that no rank is left waiting: an argument
    refused on one rank, or a non-finite norm with ``error_if_nonfinite`` on one rank, travels in
    the same all-reduce as the norm and is raised on every rank (naming the rank); then no
    gradient is clipped.

    Args:
        model_or_params: a model (its ``parameters()``) or an iterable of parameters.
        max_norm: the norm to clip to (> 0).
        norm_type: p of the p-norm (> 0, or ``inf``).
        error_if_nonfinite: raise if the total norm is inf/nan instead of clipping with it.

    Returns:
        The total norm (0-dim fp32 tensor), identical on every rank; same semantics as
        ``torch.nn.utils.clip_grad_norm_`` on the unsharded model. Parameters outside any unit
        (``ignored_params``, modules not sharded) keep rank-local gradients: they count once, and
        only when they are equal on every rank (``flashfsdp.runtime.grad_norm.check_replicated``:
        one more small all-reduce, and a host synchronisation, when such parameters are given
        next to sharded ones at W > 1).

    Raises:
        ValueError: ``max_norm`` <= 0 or ``norm_type`` <= 0 (on any rank); gradients of
            parameters outside any unit that differ across ranks (on every rank; nothing clipped).
        RuntimeError: the total norm is not finite and ``error_if_nonfinite`` is set (on any rank).
        NotImplementedError: a tensor-parallel parameter (named; on every rank, before any
            communication): use ``torch.nn.utils.clip_grad_norm_``.
    """
    close_init_windows()
    params = list(model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params)
    norm_type, error = _checked_args(max_norm, norm_type)
    grads = [local_of(p.grad) for p in params if p.grad is not None]
    comms = unit_communicators(params)
    if not grads and not comms:
        raise_own(error)
        return torch.tensor(0.0)
    device = grads[0].device if grads else next(iter(comms.values()))[1]
    total_norm = total_grad_norm(params, norm_type, device, comms, error, error_if_nonfinite)
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    if grads:
        foreach_mul_(grads, coef.to(grads[0].dtype) if len({g.dtype for g in grads}) == 1 else coef)
    return total_norm


def _checked_args(max_norm: float, norm_type: float) -> tuple[float, ValueError | None]:
    """(``norm_type`` as a float, None), or (2.0, the ValueError) for a bad ``max_norm`` or
    ``norm_type``: this rank still takes part in the all-reduces, which carry the error."""
    if not max_norm > 0:
        return 2.0, ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
    norm_type = float(norm_type)
    if not norm_type > 0:
        return 2.0, ValueError(f"clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type}")
    return norm_type, None
