"""The global gradient norm of sharded parameters: one all-reduce per unit communicator.

Used by ``flashfsdp.clip_grad_norm_`` and by ``flashfsdp.optim``'s ``max_grad_norm``. Sharded
parameters (DTensors over their unit's flat shard) contribute their local chunk, summed over the
unit's ranks (max for the inf-norm). Parameters outside any unit (``ignored_params``, modules not
sharded) hold rank-local gradients: they count once, and only when they are the same on every rank
(one more small all-reduce checks it, where such parameters are given next to sharded ones at
W > 1); otherwise each rank would compute its own norm and scale its shards of the same parameters
by a different factor, so every rank raises instead (:func:`check_replicated`).
"""

from __future__ import annotations

import math

import torch

from flashfsdp._torch_private import assert_async

from . import flight
from .agreement import raise_group_errors, raise_own
from .communicator import Communicator
from .param_tags import group_of, tag_of, unit_of
from .sharding_spec import is_dtensor, local_of
from .tensor_parallel import TensorParallelSpec


def unit_communicators(params: list[torch.Tensor]) -> dict[int, tuple[Communicator, torch.device]]:
    """``id(communicator) -> (communicator, its unit's device)`` of every sharded parameter's unit,
    in parameter order, whether or not the parameter has a gradient on this rank (a piece may be
    empty on one rank and have no gradient there, and its unit's all-reduce is still owed)."""
    comms: dict[int, tuple[Communicator, torch.device]] = {}
    for p in params:
        unit = unit_of(p)
        if unit is not None:
            _refuse_tensor_parallel(p)
            comms.setdefault(id(unit.comm), (unit.comm, unit.device))
    return comms


def _refuse_tensor_parallel(param: torch.Tensor) -> None:
    """The terms here are summed over the unit's DP ranks only; a tensor-parallel parameter's also
    need the TP ranks (only where TP shards it), which the stock function's DTensor math does."""
    tag = tag_of(param)
    if isinstance(tag.group.specs[tag.index], TensorParallelSpec):
        raise NotImplementedError(
            f"clip_grad_norm_: parameter '{tag.group.fqns[tag.index]}' is tensor-parallel (placements "
            f"{tuple(param.placements)}): flashfsdp's gradient norm sums over the data-parallel ranks only; use "
            f"torch.nn.utils.clip_grad_norm_(model.parameters(), ...), whose DTensor norm covers both meshes")


def total_grad_norm(params: list[torch.Tensor], norm_type: float, device: torch.device, comms: dict,
                    error: BaseException | None = None, error_if_nonfinite: bool = False) -> torch.Tensor:
    """The ``norm_type``-norm of every gradient of ``params`` across ranks (0-dim fp32 on ``device``):
    per communicator of ``comms`` (:func:`unit_communicators`), the sum (max for inf) of its sharded
    parameters' terms, all-reduced once together with a failure flag; parameters outside any unit
    added once (:func:`check_replicated`). Collective over ``comms``. A flat group whose every
    parameter is given with the gradient its reduction exposed contributes one term over its whole
    gradient shard (the padding is zero), not one per parameter.

    Raises:
        ``error`` (this rank's refused argument) or a non-finite norm (``error_if_nonfinite``) of
        any rank, on every rank.
        ValueError: parameters outside any unit have gradients that differ across ranks (on every rank).
    """
    is_inf = math.isinf(norm_type)
    terms_by_comm, replicated = _terms(params, norm_type, comms)
    total = _combine(torch.zeros((), dtype=torch.float32, device=device), replicated, is_inf)
    with flight.operation("clip_grad_norm_"):
        refusal = check_replicated(params, comms, total)  # (every rank takes part, whatever its error)
        error = error or refusal
        # Flags sent with each norm part: [refused argument, replicated norm not finite]; >= 0, so
        # both sum and max leave them > 0 exactly when some rank raised one.
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


def _terms(params: list[torch.Tensor], norm_type: float, comms: dict) -> tuple[dict[int, list], list]:
    """(per communicator, its sharded parameters' norm terms; the terms of parameters outside any unit)."""
    terms_by_comm: dict[int, list[torch.Tensor]] = {key: [] for key in comms}
    replicated: list[torch.Tensor] = []
    whole = _whole_groups(params)
    for group in whole.values():
        terms_by_comm[id(group.unit.comm)].append(_norm_term(group.sharded_grad, norm_type))
    for p in params:
        if p.grad is None:
            continue
        group = group_of(p)
        if group is not None and id(group) in whole:
            continue
        if group is None:
            replicated.append(_norm_term(p.grad.full_tensor() if is_dtensor(p.grad) else p.grad, norm_type))
        else:
            terms_by_comm[id(group.unit.comm)].append(_norm_term(local_of(p.grad), norm_type))
    return terms_by_comm, replicated


def check_replicated(params: list[torch.Tensor], comms: dict, term: torch.Tensor) -> ValueError | None:
    """Where ``params`` mix parameters outside any unit that take gradients with sharded ones over
    several ranks: one all-reduce (max) of this rank's term of those parameters and its negation
    per such communicator; returns the refusal (the same on every rank) when the terms
    differ across ranks, else None. Nothing is communicated otherwise (the decision is the same on
    every rank: it depends on the parameters given, not on their gradients). A non-finite term is
    left to the non-finite checks. Synchronises the host with the device (the comparison)."""
    plain = [p for p in params if group_of(p) is None and p.requires_grad]
    multi = [(comm, device) for comm, device in comms.values() if comm.world_size > 1]
    if not plain or not multi:
        return None
    high, low = -math.inf, math.inf
    for comm, device in multi:
        payload = torch.stack([term, -term]).to(device)
        comm.all_reduce(payload, op="max").wait()
        high, low = max(high, payload[0].item()), min(low, -payload[1].item())
    if high == low or not (math.isfinite(high) and math.isfinite(low)):
        return None
    return ValueError(
        f"clip_grad_norm_: {len(plain)} parameter(s) outside any fully_shard unit (ignored_params, or modules not "
        f"sharded) have gradients that differ across ranks (their norm term is between {low:.6g} and {high:.6g}): "
        f"each rank would compute its own total norm and scale its shards of the same parameters by a different "
        f"factor. Make those gradients equal on every rank first (all-reduce them), or clip the sharded "
        f"parameters and those separately; no gradient was clipped")


def _whole_groups(params: list[torch.Tensor]) -> dict:
    """``id(group) -> group`` of the flat groups whose every parameter is in ``params`` with the
    DTensor gradient the group's reduction exposed (so the gradient shard holds exactly their
    gradients, zeros in the padding)."""
    seen: dict[int, tuple] = {}
    for p in params:
        group = group_of(p)
        if group is not None and p.grad is not None:
            seen.setdefault(id(group), (group, set()))[1].add(tag_of(p).index)
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
