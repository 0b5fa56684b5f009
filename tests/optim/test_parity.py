"""flashfsdp.optim.AdamW / SGD against torch.optim's on the same flashfsdp sharded parameters
(W = 1): fp32 within 1e-6 relative over several steps, with every flag, missing gradients, frozen
parameters, groups of different hyperparameters, a tensor lr and parameters of no unit."""

from __future__ import annotations

import pytest
import torch

import flashfsdp.optim as fo
from flashfsdp.runtime.param_tags import tag_of
from tests.optim.common import rel_err, sharded_mlp, state_tensors, train

TOL = 1e-6
STEPS = 3


def _pair(flat_cls, torch_cls, groups=None, extra=False, before_step=None, **kwargs):
    """Train two identical models, one per optimizer; return (models, optimizers)."""
    models = [sharded_mlp(extra=extra), sharded_mlp(extra=extra)]
    optims = []
    for model, cls in zip(models, (flat_cls, torch_cls)):
        params = groups(model) if groups else model.parameters()
        optims.append(cls(params, **kwargs))
        train(model, optims[-1], STEPS, before_step=before_step and (lambda s, m=model: before_step(m, s)))
    return models, optims


def _assert_parity(models, optims):
    assert rel_err(list(models[0].parameters()), list(models[1].parameters())) <= TOL
    assert rel_err(state_tensors(optims[0]), state_tensors(optims[1])) <= TOL


@pytest.mark.parametrize("kwargs", [
    dict(lr=1e-2),
    dict(lr=1e-2, weight_decay=0.1, amsgrad=True),
    dict(lr=1e-2, maximize=True, betas=(0.8, 0.9), eps=1e-6),
    dict(lr=torch.tensor(1e-2)),
    dict(lr=1e-2, fused=False),
])
def test_adamw_matches_torch(kwargs):
    torch_kwargs = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in kwargs.items() if k != "fused"}
    models = [sharded_mlp(), sharded_mlp()]
    optims = [fo.AdamW(models[0].parameters(), **kwargs), torch.optim.AdamW(models[1].parameters(), **torch_kwargs)]
    for model, optim in zip(models, optims):
        train(model, optim, STEPS)
    _assert_parity(models, optims)


@pytest.mark.parametrize("kwargs", [
    dict(lr=1e-2),
    dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=0.01),
    dict(lr=1e-2, momentum=0.9, nesterov=True, maximize=True),
    dict(lr=1e-2, momentum=0.9, fused=False),
])
def test_sgd_matches_torch(kwargs):
    models, optims = _pair(fo.SGD, torch.optim.SGD, **kwargs)
    _assert_parity(models, optims)


def _drop_and_freeze(model, step):
    """Step 1: block 0's up.bias gets no gradient; from step 2, block 1 is frozen."""
    if step == 1:
        model.blocks[0].up.bias.grad = None
    if step == 2:
        model.blocks[1].requires_grad_(False)


def test_missing_gradients_and_frozen_parameters():
    models, optims = _pair(fo.AdamW, torch.optim.AdamW, before_step=_drop_and_freeze, lr=1e-2)
    _assert_parity(models, optims)
    steps = [optims[0].state[p]["step"].item() for p in (models[0].blocks[0].up.bias, models[0].blocks[0].up.weight)]
    assert steps == [STEPS - 1, STEPS]


def _two_groups(model):
    """Weights with decay, biases without, the shift unit with its own lr (interleaved groups)."""
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias") and not n.startswith("shift")]
    return [dict(params=decay), dict(params=no_decay, weight_decay=0.0),
            dict(params=list(model.shift.parameters()), lr=3e-2)]


def test_groups_with_different_hyperparameters_and_plain_parameters():
    models, optims = _pair(fo.AdamW, torch.optim.AdamW, groups=_two_groups, lr=1e-2, weight_decay=0.1)
    _assert_parity(models, optims)
    models, optims = _pair(fo.SGD, torch.optim.SGD, extra=True, lr=1e-2, momentum=0.9)
    assert tag_of(models[0].scale) is None and tag_of(models[0].shift.bias) is not None
    _assert_parity(models, optims)
