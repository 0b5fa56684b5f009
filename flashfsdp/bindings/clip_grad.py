"""clip_grad_norm_: the true global gradient norm of a sharded model, and clipping to it."""

from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.nn as nn

from flashfsdp._torch_private import assert_async, foreach_mul_
from flashfsdp.runtime.communicator import Communicator
from flashfsdp.runtime.sharding_spec import is_dtensor, local_of

from .agreement import raise_group_errors, raise_own
from .init_window import close_init_windows


def clip_grad_norm_(
    model_or_params: nn.Module | Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip gradients by the norm of *all* gradients across ranks; return that norm.

    Sharded parameters (DTensors over their unit's flat shard) contribute their local chunk,
    summed over the unit's ranks (max for ``norm_type=inf``) in one all-reduce per unit
    communicator; other parameters (replicated, e.g. ``ignored_params``) count once. The stock
    ``torch.nn.utils.clip_grad_norm_`` gives the same norm on DTensor gradients (FSDP2's way:
    one DTensor reduction per parameter group); this one reads the units' flat layout instead.
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
        The total norm (0-dim fp32 tensor); same semantics as ``torch.nn.utils.clip_grad_norm_``
        on the unsharded model. It is identical on every rank when every gradient belongs to a
        sharded parameter (reduced across ranks). Other parameters (``ignored_params``,
        parameters of modules outside any unit) keep their rank-local gradients, which enter
        this rank's norm as they are: make them equal on every rank first (e.g. all-reduce them)
        if the norm must agree.

    Raises:
        ValueError: ``max_norm`` <= 0 or ``norm_type`` <= 0 (on any rank).
        RuntimeError: the total norm is not finite and ``error_if_nonfinite`` is set (on any rank).
    """
    close_init_windows()
    params = list(model_or_params.parameters() if isinstance(model_or_params, nn.Module) else model_or_params)
    error = None
    try:
        norm_type = _check_args(max_norm, norm_type)
    except ValueError as exc:
        error, norm_type = exc, 2.0  # (this rank still takes part in the all-reduces)
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


def _check_args(max_norm: float, norm_type: float) -> float:
    """``norm_type`` as a float; ValueError for a bad ``max_norm`` or ``norm_type``."""
    if not max_norm > 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be > 0, got {max_norm}")
    norm_type = float(norm_type)
    if not norm_type > 0:
        raise ValueError(f"clip_grad_norm_: norm_type must be > 0 or inf, got {norm_type}")
    return norm_type


def unit_communicators(params: list[torch.Tensor]) -> dict[int, tuple[Communicator, torch.device]]:
    """``id(communicator) -> (communicator, its unit's device)`` of every sharded parameter's unit,
    in parameter order, whether or not the parameter has a gradient on this rank (a piece may be
    empty on one rank and have no gradient there, and its unit's all-reduce is still owed)."""
    comms: dict[int, tuple[Communicator, torch.device]] = {}
    for p in params:
        unit = getattr(p, "_flashfsdp_unit", None)
        if unit is not None and hasattr(p, "_flashfsdp_group"):
            comms.setdefault(id(unit.comm), (unit.comm, unit.device))
    return comms


def total_grad_norm(params: list[torch.Tensor], norm_type: float, device: torch.device, comms: dict,
                    error: BaseException | None = None, error_if_nonfinite: bool = False) -> torch.Tensor:
    """The ``norm_type``-norm of every gradient of ``params`` across ranks (0-dim fp32 on ``device``):
    per communicator of ``comms`` (:func:`unit_communicators`), the sum (max for inf) of its sharded
    parameters' terms, all-reduced once together with a failure flag; replicated parameters' terms
    added once. Collective over ``comms``. A flat group whose every parameter is given with the
    gradient its reduction exposed contributes one term over its whole gradient shard (the
    padding is zero), not one per parameter.

    Raises:
        ``error`` (this rank's refused argument) or a non-finite norm (``error_if_nonfinite``) of
        any rank, on every rank.
    """
    is_inf = math.isinf(norm_type)
    terms_by_comm: dict[int, list[torch.Tensor]] = {key: [] for key in comms}
    replicated: list[torch.Tensor] = []
    whole = _whole_groups(params)
    for group in whole.values():
        terms_by_comm[id(group.sharded_params[0]._flashfsdp_unit.comm)].append(_norm_term(group.sharded_grad, norm_type))
    for p in params:
        if p.grad is None:
            continue
        group = getattr(p, "_flashfsdp_group", None)
        if group is not None and id(group) in whole:
            continue
        if group is None:
            replicated.append(_norm_term(p.grad.full_tensor() if is_dtensor(p.grad) else p.grad, norm_type))
        else:
            terms_by_comm[id(p._flashfsdp_unit.comm)].append(_norm_term(local_of(p.grad), norm_type))
    total = _combine(torch.zeros((), dtype=torch.float32, device=device), replicated, is_inf)
    # Flags sent with each norm part: [refused argument, replicated norm not finite]; >= 0, so both
    # sum and max leave them > 0 exactly when some rank raised one.
    flags = torch.tensor([float(error is not None), 0.0], device=device)
    if error_if_nonfinite:
        flags[1] = (~torch.isfinite(total)).float()
    nonfinite_elsewhere = False
    for key, (comm, comm_device) in comms.items():
        part = _combine(torch.zeros((), dtype=torch.float32, device=device), terms_by_comm[key], is_inf)
        payload = torch.cat([part.reshape(1), flags]).to(comm_device)
        comm.all_reduce(payload, op="max" if is_inf else "sum").wait()
        if _remote_failure(payload, comm_device, error_if_nonfinite, comm.rank):
            raise_group_errors(comm, error, comm_device)
        nonfinite_elsewhere = nonfinite_elsewhere or (error_if_nonfinite and payload[2].item() > 0)
        part = payload[0].to(device)
        total = torch.maximum(total, part) if is_inf else total + part
    raise_own(error)  # (no communicator, or the device assertion tells the other ranks)
    total = total if is_inf else total ** (1.0 / norm_type)
    if error_if_nonfinite and (nonfinite_elsewhere or not torch.isfinite(total)):
        raise RuntimeError(f"clip_grad_norm_: the total norm of order {norm_type} is not finite ({total.item()} on "
                           f"this rank{', and not finite on another' if nonfinite_elsewhere else ''}); no gradient was clipped")
    return total


def _whole_groups(params: list[torch.Tensor]) -> dict:
    """``id(group) -> group`` of the flat groups whose every parameter is in ``params`` with the
    DTensor gradient the group's reduction exposed (so the gradient shard holds exactly their
    gradients, zeros in the padding)."""
    seen: dict[int, tuple] = {}
    for p in params:
        group = getattr(p, "_flashfsdp_group", None)
        if group is not None and p.grad is not None:
            seen.setdefault(id(group), (group, set()))[1].add(p._flashfsdp_index)
    whole = {}
    for key, (group, indices) in seen.items():
        exposed = group._grad_tensors
        if (len(indices) == len(group.sharded_params) and exposed is not None
                and exposed[0] is group.sharded_grad
                and all(p.grad is g for p, g in zip(group.sharded_params, exposed[1]))):
            whole[key] = group
    return whole


def _remote_failure(payload: torch.Tensor, device: torch.device, synchronising: bool, rank: int) -> bool:
    """Whether some rank refused its arguments (``payload[1] > 0``).

    Read on the host where that costs nothing (CPU) or the caller asked for a synchronisation
    anyway (``error_if_nonfinite``). On CUDA otherwise an asynchronous device assertion carries it
    (no synchronisation on the training step's path; the rank fails at its next one) and this
    returns False.
    """
    if device.type == "cpu" or synchronising:
        return payload[1].item() > 0
    assert_async(payload[1] == 0, f"clip_grad_norm_: another rank than rank {rank} refused its arguments "
                                         f"(see its error); the gradients were not clipped consistently")
    return False


def _combine(start: torch.Tensor, terms: list[torch.Tensor], is_inf: bool) -> torch.Tensor:
    """``start`` with ``terms`` added (max for the inf-norm)."""
    if not terms:
        return start
    stacked = torch.stack(terms).float()
    return torch.maximum(start, stacked.max()) if is_inf else start + stacked.sum()


def _norm_term(grad: torch.Tensor, norm_type: float) -> torch.Tensor:
    """|g|_inf, or sum |g|^p, in fp32."""
    g = grad.detach().float()
    if math.isinf(norm_type):
        return g.abs().max() if g.numel() else torch.zeros((), device=g.device)
    if norm_type == 2.0:
        return (g * g).sum()
    return g.abs().pow(norm_type).sum()
