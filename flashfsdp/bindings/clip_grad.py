"""clip_grad_norm_: the true global gradient norm of a sharded model, and clipping to it."""

from __future__ import annotations

import functools
import math
from typing import Iterable

import torch
import torch.nn as nn

from flashfsdp.runtime.communicator import Communicator

from .init_window import close_init_windows


def clip_grad_norm_(
    model_or_params: nn.Module | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients by the norm of *all* gradients across ranks; return that norm.

    Sharded parameters (local pieces) contribute their rank's part, summed over the unit's ranks
    (max for ``norm_type=inf``); other parameters (replicated, e.g. ``ignored_params``) count once.
    For the 2-norm, a unit whose gradient shard is unchanged since its reduction reuses the
    squared norm that ``accumulate_grad_shard`` computed in the same pass (no extra read).

    Args:
        model_or_params: a model (its ``parameters()``) or an iterable of parameters.
        max_norm: the norm to clip to (> 0).
        norm_type: p of the p-norm (> 0, or ``inf``).
        error_if_nonfinite: raise if the total norm is inf/nan instead of clipping with it.

    Returns:
        The total norm (0-dim fp32 tensor); same semantics as ``torch.nn.utils.clip_grad_norm_``
        on the unsharded model. It is identical on every rank when every gradient belongs to a
        sharded parameter (reduced across ranks). Other parameters (``ignored_params``,
        parameters of modules outside any unit) keep their rank-local gradients, which enter
        this rank's norm as they are: make them equal on every rank first (e.g. all-reduce them)
        if the norm must agree.

    Raises:
        ValueError: ``max_norm`` <= 0 or ``norm_type`` <= 0.
        RuntimeError: the total norm is not finite and ``error_if_nonfinite`` is set.
    """
    close_init_windows()
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type}")
    params = list(model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    total_norm = total_grad_norm(params, norm_type, grads[0].device)
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} is {total_norm.item()}")
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].dtype) if len({g.dtype for g in grads}) == 1 else coef)
    return total_norm


def total_grad_norm(params: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """The ``norm_type``-norm of every gradient of ``params`` across ranks (0-dim fp32 on ``device``):
    per communicator, the sum (max for inf) of its sharded pieces' terms, all-reduced once;
    replicated parameters' terms added once. Collective over the units' communicators."""
    is_inf = math.isinf(norm_type)
    per_comm: dict[int, tuple[Communicator, torch.device, list[torch.Tensor]]] = {}
    replicated: list[torch.Tensor] = []
    seen_groups: set[int] = set()
    for p in params:
        if p.grad is None:
            continue
        group = getattr(p, "_flashfsdp_group", None)
        if group is None:
            replicated.append(_norm_term(p.grad, norm_type))
            continue
        unit = p._flashfsdp_unit
        terms = per_comm.setdefault(id(unit.comm), (unit.comm, unit.device, []))[2]
        if _fused_norm_usable(group, norm_type, params):
            if id(group) not in seen_groups:
                seen_groups.add(id(group))
                terms.append(group.grad_stats[0].to(device))
        else:
            terms.append(_norm_term(p.grad, norm_type))
    total = torch.zeros((), dtype=torch.float32, device=device)
    for comm, comm_device, terms in per_comm.values():
        part = (torch.stack(terms).max() if is_inf else torch.stack(terms).sum()).reshape(1)
        part = part.to(comm_device, copy=True)  # (CPU-offloaded gradients: the collective's device)
        comm.all_reduce(part, op="max" if is_inf else "sum").wait()
        part = part.to(device)
        total = torch.maximum(total, part[0]) if is_inf else total + part[0]
    if replicated:
        rep = torch.stack(replicated)
        total = torch.maximum(total, rep.max()) if is_inf else total + rep.sum()
    return total if is_inf else total ** (1.0 / norm_type)


def _norm_term(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """|g|_inf, or sum |g|^p, in fp32."""
    g = grad.detach().float()
    if math.isinf(norm_type):
        return g.abs().max() if g.numel() else torch.zeros((), device=g.device)
    if norm_type == 2.0:
        return (g * g).sum()
    return g.abs().pow(norm_type).sum()


def _fused_norm_usable(group, norm_type: float, params: list) -> bool:
    """Whether the group's fused squared norm still describes its pieces' gradients exactly."""
    stats = group.grad_stats
    if norm_type != 2.0 or stats is None or group.sharded_grad is None:
        return False
    if group.sharded_grad._version != stats[2]:
        return False
    views = group.grad_views()
    ids = {id(p) for p in params}
    return all(
        id(p) in ids and p.grad is not None and p.grad.data_ptr() == v.data_ptr()
        for p, v in zip(group.sharded_params, views)
    )


_stock_clip_grad_norm = None


def route_stock_clip_grad_norm() -> None:
    """Make ``torch.nn.utils.clip_grad_norm_`` clip flashfsdp parameters by their global norm.

    FSDP2 code calls the stock function on ``model.parameters()``: with DTensor gradients it sees the
    global norm. flashfsdp's gradients are plain 1-D pieces, so the stock function would compute
    each rank's *local* norm and clip each rank by a different factor — silently wrong. Importing
    flashfsdp therefore wraps it (once): when any of the parameters is a flashfsdp piece the call
    goes to :func:`clip_grad_norm_` (all-reduced, same result on every rank); otherwise to the
    original, unchanged. ``torch.nn.utils.clip_grad.clip_grad_norm_`` is the same function.
    """
    global _stock_clip_grad_norm
    import torch.nn.utils as nn_utils  # noqa: PLC0415
    import torch.nn.utils.clip_grad as clip_module  # noqa: PLC0415

    if _stock_clip_grad_norm is not None:
        return
    _stock_clip_grad_norm = stock = clip_module.clip_grad_norm_

    @functools.wraps(stock)
    def clip_grad_norm_routed(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if any(hasattr(p, "_flashfsdp_group") for p in params):
            return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
        return stock(params, max_norm, norm_type, error_if_nonfinite, foreach)

    nn_utils.clip_grad_norm_ = clip_module.clip_grad_norm_ = clip_grad_norm_routed
