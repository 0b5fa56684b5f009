"""Refuse to step an optimizer built before ``fully_shard``: its parameters are no longer the model's.

``fully_shard`` replaces every parameter of a unit by this rank's sharded piece (a new
``nn.Parameter``), exactly as FSDP2 replaces them by DTensors. An optimizer built before holds the
replaced originals: stepping them changes tensors the model no longer uses, so nothing trains and
no error says so. ``_init.mark_taken`` tags each original with ``_flashfsdp_taken_by``; the step
pre-hook (``optimizer_hooks.py``) raises at the first step of an optimizer that holds one, looking
again only when its ``param_groups`` change.
"""

from __future__ import annotations

import torch

_TAKEN = "_flashfsdp_taken_by"  # set by _init.mark_taken on the parameters fully_shard replaced


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
