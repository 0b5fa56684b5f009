"""Bad input to the flat optimizers: torch's argument errors, a gradient of the wrong size on a
sharded parameter (named), an optimizer built before fully_shard (refused as for torch's)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import flashfsdp.optim as fo
from flashfsdp import fully_shard
from tests.optim.common import sharded_mlp


@pytest.mark.parametrize("cls, kwargs, message", [
    (fo.AdamW, dict(lr=-1.0), "Invalid learning rate"),
    (fo.AdamW, dict(betas=(1.5, 0.9)), "Invalid beta parameter"),
    (fo.AdamW, dict(fused=True, differentiable=True), "differentiable"),
    (fo.SGD, dict(lr=0.1, nesterov=True), "Nesterov momentum requires a momentum"),
])
def test_constructor_arguments_are_checked_as_torch_checks_them(cls, kwargs, message):
    with pytest.raises((ValueError, RuntimeError), match=message):
        cls(sharded_mlp().parameters(), **kwargs)


@pytest.mark.parametrize("cls", [fo.AdamW, fo.SGD])
def test_gradient_of_another_size_names_the_parameter(cls):
    model = sharded_mlp()
    optim = cls(model.parameters(), lr=0.1)
    model(torch.randn(2, 7)).sum().backward()
    model.blocks[1].up.weight.grad.data = torch.zeros(5)  # .data bypasses autograd's own size check
    with pytest.raises(RuntimeError, match=r"the gradient of blocks\.1\.up\.weight has 5 local elements but the "
                                           r"parameter's chunk has 273; a \.grad assigned by hand must have the "
                                           r"parameter's shape \(21, 13\) and placements"):
        optim.step()


def test_optimizer_built_before_fully_shard_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optim = fo.AdamW(model.parameters())
    fully_shard(model[0])
    fully_shard(model)
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"AdamW.step: the optimizer holds 4 parameter\(s\) that fully_shard replaced"):
        optim.step()
