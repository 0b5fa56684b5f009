"""Shared parts of the flat-optimizer tests: a sharded model, a training loop, the error measure."""

from __future__ import annotations

import torch
import torch.nn as nn

from flashfsdp import fully_shard
from flashfsdp.runtime.sharding_spec import local_of
from tests.models import loss_fn, make_batch, make_mlp


def sharded_mlp(seed: int = 0, extra: bool = False) -> nn.Module:
    """tests.models' MLPStack with a unit per block, the shift bias and the root; with ``extra``, a
    plain (ignored) parameter that belongs to no unit."""
    model = make_mlp(seed)
    ignored = set()
    if extra:
        model.scale = nn.Parameter(torch.ones(3))
        ignored = {model.scale}
    for unit in [*model.blocks, model.shift]:
        fully_shard(unit)
    return fully_shard(model, ignored_params=ignored)


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: int, rank: int = 0, world_size: int = 1,
          before_step=None) -> None:
    """``steps`` steps on this rank's part of the MLP batches; ``before_step(step)`` runs between
    backward and ``optim.step()`` (to drop or freeze gradients)."""
    for step in range(steps):
        x, y = make_batch("mlp", step, 4 * world_size)
        x, y = x[rank::world_size], y[rank::world_size]
        out = model(x)
        if hasattr(model, "scale"):
            out = out * model.scale
        loss_fn("mlp", out, y).backward()
        if before_step is not None:
            before_step(step)
        optim.step()
        optim.zero_grad()


def rel_err(a, b) -> float:
    """max |a - b| / max |b| over two lists of tensors (0 when both are all zero); of DTensors,
    this rank's local chunks (both sides sharded alike; every rank's result is checked)."""
    a, b = [local_of(x) for x in a], [local_of(y) for y in b]
    num = max(((x.detach() - y.detach()).abs().max().item() for x, y in zip(a, b, strict=True) if x.numel()),
              default=0.0)
    den = max((y.detach().abs().max().item() for y in b if y.numel()), default=0.0)
    return num / den if den else num


def state_tensors(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every state tensor of ``optim``, in parameter order and key order (of a DTensor, this rank's
    local chunk), flattened."""
    params = [p for g in optim.param_groups for p in g["params"]]
    return [local_of(optim.state[p][k]).reshape(-1).float() for p in params if p in optim.state for k in sorted(optim.state[p])]
