"""Which gradients of an optimizer its reduction already unscaled, and which need a pass.

``ShardedGradScaler.unscale_`` sorts its optimizer's gradients with :func:`plan_unscale`:

- a flat group whose reduction divided its whole gradient shard by the current loss scale S
  (``flashfsdp.runtime.loss_scale``) and whose parameters all belong to this optimizer contributes
  the inf/nan flag ``accumulate_grad_shard`` computed in that pass: no gradient is read;
- every other gradient is divided explicitly (``torch._amp_foreach_non_finite_check_and_unscale_``,
  one read and write): by S when it is still scaled (parameters outside any unit, ignored
  parameters, a group reduced without an armed scaler, a ``.grad`` replaced by hand), by
  S_applied / S when its reduction divided by another scale S_applied (the scale changed between
  backward and ``unscale_``; a factor of 1 when only the flag is stale).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import torch

from flashfsdp.runtime import loss_scale
from flashfsdp.runtime.sharding_spec import local_of
from flashfsdp.runtime.param_tags import group_of

# The key of gradients still multiplied by the loss scale (divided by it as torch does).
SCALED = "scaled"


@dataclasses.dataclass
class UnscalePlan:
    """The outcome of :func:`plan_unscale`.

    Attributes:
        flags: 0-dim bool tensors, the fused inf/nan flags of the groups already unscaled.
        explicit: factor -> parameters whose gradients need a pass multiplying by it;
            :data:`SCALED` stands for 1/S.
        groups: every flat group with a gradient among the parameters (to attach the scaler to).
        comms: ``id(communicator) -> (communicator, its unit's device)`` of the parameters' units.
    """

    flags: list[torch.Tensor] = dataclasses.field(default_factory=list)
    explicit: dict[object, list[torch.Tensor]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    groups: list = dataclasses.field(default_factory=list)
    comms: dict[int, object] = dataclasses.field(default_factory=dict)


def plan_unscale(params: list[torch.Tensor], scale: float) -> UnscalePlan:
    """Sort the gradients of ``params`` for unscaling by the loss scale ``scale``. The
    communicators are collected from every flashfsdp parameter, with a gradient on this rank or
    not, so that all ranks choose the same one."""
    plan = UnscalePlan()
    by_group: dict[int, tuple[object, list[torch.Tensor]]] = {}
    for p in params:
        group = group_of(p)
        if group is not None:
            unit = group.unit
            plan.comms.setdefault(id(unit.comm), (unit.comm, unit.device))
        if p.grad is None:
            continue
        if group is None:
            plan.explicit[SCALED].append(p)
            continue
        by_group.setdefault(id(group), (group, []))[1].append(p)
    for group, mine in by_group.values():
        plan.groups.append(group)
        _sort_group(plan, group, mine, scale)
    return plan


def _sort_group(plan: UnscalePlan, group, mine: list[torch.Tensor], scale: float) -> None:
    """One flat group's share of ``plan``: its fused flag, or its gradients for explicit passes."""
    applied = loss_scale.unscaled_by(group)
    views = group.grad_views() if applied is not None else []
    ours = {id(p) for p in mine}
    fused, scaled = [], []
    for i, p in enumerate(group.sharded_params):
        if p.grad is None:
            continue
        grad = local_of(p.grad)
        if applied is not None and grad.data_ptr() == views[i].data_ptr() and grad.numel() == views[i].numel():
            fused.append(p)
        else:
            scaled.append(p)
    complete = not scaled and all(id(p) in ours for p in fused)
    if complete and applied == scale:
        plan.flags.append(group.grad_stats[1])
        return
    plan.explicit[SCALED].extend(p for p in scaled if id(p) in ours)
    if applied is not None:
        plan.explicit[applied / scale].extend(p for p in fused if id(p) in ours)
