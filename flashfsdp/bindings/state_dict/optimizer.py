"""Optimizer state dicts over fully_shard'ed parameters: torch's own, keyed by parameter name.

A stock optimizer's state of a sharded parameter (``exp_avg``, ``momentum_buffer``, ...) is created
with ``zeros_like`` of the DTensor parameter, so it is a DTensor of the parameter's placements:
``optimizer.state_dict()`` is FSDP2's, DCP saves and reshards it natively, and DSD's
``get_optimizer_state_dict`` / ``set_optimizer_state_dict`` (full-state-dict options included)
work unchanged. The two functions here are those DSD calls with the arguments checked.

One global optimizer step post-hook stays registered (by the first ``fully_shard``): a step may
write the shards without bumping version counters (fused optimizers), so it advances the shard
epoch that tells a unit kept unsharded across steps that its gathered parameters are stale (see
[Note: stale unsharded parameters] in ``runtime/flat_param.py``).
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn as nn

from flashfsdp.runtime.flat_param import shards_written
from flashfsdp.runtime.init_window import close_init_windows


def _check_optimizer(model: Any, optimizer: Any, where: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be an nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{where}: optimizer must be a torch.optim.Optimizer over the model's parameters, "
                        f"got {type(optimizer).__name__}")


def get_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, sharded like the parameters (for DCP).

    ``torch.distributed.checkpoint.state_dict.get_optimizer_state_dict`` with the default options
    (which keys the state by the names ``model.named_parameters()`` gives, and initialises a fresh
    optimizer's state with a zero-lr step): the per-element state of a sharded parameter is a
    DTensor of its placements, scalars (``step``) and ``param_groups`` stay as they are.

    Args:
        model: the (fully_shard'ed) model whose parameters ``optimizer`` steps.
        optimizer: a torch optimizer (Adam, AdamW, SGD, ... or ``flashfsdp.optim``'s).

    Returns:
        ``{"state": {name: {key: value}}, "param_groups": [...]}``; the tensors share storage with
        the optimizer's state (``dcp.load`` into it loads in place).

    Raises:
        TypeError: ``model`` or ``optimizer`` of the wrong type.
    """
    from torch.distributed.checkpoint import state_dict as dsd  # noqa: PLC0415

    _check_optimizer(model, optimizer, "get_optimizer_state_dict")
    close_init_windows()
    return dsd.get_optimizer_state_dict(model, optimizer)


def set_optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                             optim_state_dict: Mapping[str, Any]) -> None:
    """Load an optimizer state dict of :func:`get_optimizer_state_dict`'s form into ``optimizer``
    (``torch.distributed.checkpoint.state_dict.set_optimizer_state_dict``: names to parameters,
    ``Optimizer.load_state_dict``; hyperparameters such as ``lr`` come from the state dict).
    ``optim_state_dict`` itself is not modified.

    Raises:
        TypeError: wrong ``model``/``optimizer`` type, or ``optim_state_dict`` not a mapping.
        ValueError: ``optim_state_dict`` lacks "state"/"param_groups".
    """
    from torch.distributed.checkpoint import state_dict as dsd  # noqa: PLC0415

    _check_optimizer(model, optimizer, "set_optimizer_state_dict")
    if not isinstance(optim_state_dict, Mapping):
        raise TypeError(f"set_optimizer_state_dict: optim_state_dict must be a mapping, got "
                        f"{type(optim_state_dict).__name__}")
    if "state" not in optim_state_dict or "param_groups" not in optim_state_dict:
        raise ValueError("set_optimizer_state_dict: optim_state_dict must have 'state' and 'param_groups' "
                         "(as get_optimizer_state_dict returns)")
    close_init_windows()
    dsd.set_optimizer_state_dict(model, optimizer, dict(optim_state_dict))
    shards_written()
