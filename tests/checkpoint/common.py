"""Helpers of the checkpoint tests: small sharded models and their values."""

from __future__ import annotations

import torch

import flashfsdp
from tests.models import make_mlp


def sharded_mlp(seed: int = 0):
    """The test MLP from ``seed``, every unit fully_shard'ed (at the current world size)."""
    model = make_mlp(seed)
    for unit in model.units():
        flashfsdp.fully_shard(unit)
    return model


def local_values(model) -> dict[str, torch.Tensor]:
    """Every parameter as this rank holds it (a DTensor: its local chunk), cloned, by name."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_values(model, values: dict[str, torch.Tensor]) -> None:
    """``model``'s parameters equal ``values`` exactly (this rank's chunks of DTensors)."""
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), values[name], rtol=0, atol=0, msg=name)
