"""clip_grad_norm_: the true global gradient norm of a sharded model, and clipping to it."""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn as nn

from flashfsdp.runtime.communicator import Communicator


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
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type}")
    params = list(model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params)
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    device = grads[0].device
    is_inf = math.isinf(norm_type)

    per_comm: dict[int, tuple[Communicator, list[torch.Tensor]]] = {}
    replicated: list[torch.Tensor] = []
    seen_groups: set[int] = set()
    for p in params:
        if p.grad is None:
            continue
        group = getattr(p, "_flashfsdp_group", None)
        if group is None:
            replicated.append(_norm_term(p.grad, norm_type))
            continue
        comm = p._flashfsdp_unit.comm
        terms = per_comm.setdefault(id(comm), (comm, []))[1]
        if _fused_norm_usable(group, norm_type, params):
            if id(group) not in seen_groups:
                seen_groups.add(id(group))
                terms.append(group.grad_stats[0].to(device))
        else:
            terms.append(_norm_term(p.grad, norm_type))

    total = torch.zeros((), dtype=torch.float32, device=device)
    for comm, terms in per_comm.values():
        part = (torch.stack(terms).max() if is_inf else torch.stack(terms).sum()).reshape(1).clone()
        comm.all_reduce(part, op="max" if is_inf else "sum").wait()
        total = torch.maximum(total, part[0]) if is_inf else total + part[0]
    if replicated:
        rep = torch.stack(replicated)
        total = torch.maximum(total, rep.max()) if is_inf else total + rep.sum()
    total_norm = total if is_inf else total ** (1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total_norm):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} is {total_norm.item()}")
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    torch._foreach_mul_(grads, coef.to(grads[0].dtype) if len({g.dtype for g in grads}) == 1 else coef)
    return total_norm


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
