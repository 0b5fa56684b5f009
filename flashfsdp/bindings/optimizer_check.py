"""Refuse to step an optimizer built before ``fully_shard``: its parameters are no longer the model's.

``fully_shard`` replaces every parameter of a unit by this rank's sharded piece (a new
``nn.Parameter``), exactly as FSDP2 replaces them by DTensors. An optimizer built before holds the
replaced originals: stepping them changes tensors the model no longer uses, so nothing trains and
no error says so. ``_init.mark_taken`` tags each original with ``_flashfsdp_taken_by``; a global
optimizer step-pre-hook (registered by the first root's lazy init) raises at the first step of an
optimizer that holds one.

Cost for correct use: each optimizer's parameters are scanned at its first step and again only
when its ``param_groups`` change (another group, or a group's list replaced or resized); every other
step costs one weak-dictionary look-up and a comparison of a tuple of (list id, length) per group.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_TAKEN = "_flashfsdp_taken_by"  # set by _init.mark_taken on the parameters fully_shard replaced
_scanned: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()
_handle = None


def register_optimizer_check() -> None:
    """Register (once per process) the step-pre-hook that runs :func:`check_optimizer`."""
    global _handle
    if _handle is None:
        _handle = register_optimizer_step_pre_hook(_on_step)


def _signature(optimizer: torch.optim.Optimizer) -> tuple:
    return tuple((id(group["params"]), len(group["params"])) for group in optimizer.param_groups)


def _on_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    signature = _signature(optimizer)
    if _scanned.get(optimizer) != signature:
        check_optimizer(optimizer)
        _scanned[optimizer] = signature


def check_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Raise if ``optimizer`` holds a parameter that ``fully_shard`` replaced by a sharded piece.

    Raises:
        RuntimeError: naming the first such parameter (its position, shape and unit) and how many
            there are; build the optimizer after ``fully_shard`` (from ``model.parameters()``).
    """
    stale = [(g, i, p) for g, group in enumerate(optimizer.param_groups)
             for i, p in enumerate(group["params"]) if hasattr(p, _TAKEN)]
    if not stale:
        return
    g, i, p = stale[0]
    raise RuntimeError(
        f"{type(optimizer).__name__}.step: the optimizer holds {len(stale)} parameter(s) that fully_shard "
        f"replaced by sharded pieces, e.g. param_groups[{g}]['params'][{i}] of shape {tuple(p.shape)}, taken "
        f"over by {getattr(p, _TAKEN)}; the model no longer uses them, so stepping them would train nothing. "
        f"Build the optimizer after fully_shard, from model.parameters()"
    )
