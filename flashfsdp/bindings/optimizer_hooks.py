"""The optimizer step hooks flashfsdp needs: one global pre-hook and one post-hook, registered at
the first ``fully_shard``, that act only for optimizers holding flashfsdp's parameters.

torch offers per-instance step hooks, but flashfsdp never sees a user's optimizer being built, so
it registers torch's process-wide ones (``register_optimizer_step_pre_hook`` / ``_post_hook``) and
dispatches: an optimizer is looked at when its ``param_groups`` change (another group, a group's
list replaced or resized; the first step counts), and its verdict is kept in a weak dictionary.
Every other step of any optimizer costs one look-up and a comparison of a tuple of
``(list id, length)`` per group; an optimizer over none of flashfsdp's parameters (a second model,
a GAN's other half, a probe) runs nothing of flashfsdp's.

For an optimizer that holds flashfsdp's parameters, in order:

- before the step: :func:`~flashfsdp.runtime.init_window.close_init_windows` (the step reads the
  parameters' own values), the refusal of an optimizer built before ``fully_shard``
  (:func:`~flashfsdp.bindings.optimizer_check.check_optimizer`, at each look), the hand-over of
  flat runs (:mod:`flashfsdp.bindings.optimizer_local_step`);
- after it: :func:`~flashfsdp.runtime.flat_param.shards_written` (the shards changed: gathered
  parameters are stale), then the runs handed back.

An optimizer holding a parameter that ``fully_shard`` replaced is looked at like any other and
refused at its step (``RuntimeError``), whatever else it holds.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from flashfsdp.runtime.flat_param import shards_written
from flashfsdp.runtime.init_window import close_init_windows
from flashfsdp.runtime.sharding_spec import SHARDED_ATTR

from . import optimizer_check, optimizer_local_step

# optimizer -> (its param_groups' signature when looked at, whether it holds flashfsdp parameters)
_verdicts: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[tuple, bool]]" = weakref.WeakKeyDictionary()
_handles: tuple = ()


def register_optimizer_hooks() -> None:
    """Register (once per process) the pre- and post-hook described in the module docstring."""
    global _handles
    if not _handles:
        _handles = (register_optimizer_step_pre_hook(_pre_step), register_optimizer_step_post_hook(_post_step))


def holds_flashfsdp_params(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` steps any of flashfsdp's sharded parameters (looked at again when its
    ``param_groups`` changed).

    Raises:
        RuntimeError: it holds a parameter that ``fully_shard`` replaced (see
            :func:`~flashfsdp.bindings.optimizer_check.check_optimizer`).
    """
    signature = tuple((id(group["params"]), len(group["params"])) for group in optimizer.param_groups)
    kept = _verdicts.get(optimizer)
    if kept is not None and kept[0] == signature:
        return kept[1]
    optimizer_check.check_optimizer(optimizer)
    ours = any(getattr(p, SHARDED_ATTR, False) for group in optimizer.param_groups for p in group["params"])
    _verdicts[optimizer] = (signature, ours)
    return ours


def _pre_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    optimizer_local_step.restore(optimizer)  # (its groups hold the handed runs until then)
    if not holds_flashfsdp_params(optimizer):
        return
    close_init_windows()
    optimizer_local_step.pre_step(optimizer)


def _post_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    kept = _verdicts.get(optimizer)
    if kept is None or not kept[1]:
        return
    shards_written()
    optimizer_local_step.post_step(optimizer)
