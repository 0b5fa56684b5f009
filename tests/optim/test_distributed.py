"""The flat optimizers at W = 2 (gloo): parity with torch.optim on the same DTensor parameters, and
the state dict (DTensors of the parameters' placements, as torch's) handed to torch's AdamW and
back, on ranks whose dim-0 chunks are uneven or padded."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

import flashfsdp.optim as fo
from tests.harness import run_distributed
from tests.optim.common import rel_err, sharded_mlp, state_tensors, train


def _parity(rank, world_size, flat_cls, torch_cls, kwargs):
    models = [sharded_mlp(), sharded_mlp()]
    optims = [flat_cls(models[0].parameters(), **kwargs), torch_cls(models[1].parameters(), **kwargs)]
    for model, optim in zip(models, optims):
        train(model, optim, 3, rank, world_size)
    flat_sd, torch_sd = optims[0].state_dict(), optims[1].state_dict()
    for (pid, st), p in zip(sorted(flat_sd["state"].items()), models[0].parameters()):
        for key, value in st.items():
            ref = torch_sd["state"][pid][key]
            assert type(value) is type(ref), (key, type(value), type(ref))
            if isinstance(ref, DTensor) and ref.shape == p.shape:
                assert value.placements == p.placements and value.to_local().shape == p.to_local().shape
    handed = torch_cls(models[0].parameters(), **kwargs)
    handed.load_state_dict(flat_sd)
    back = flat_cls(models[0].parameters(), **kwargs)
    back.load_state_dict(handed.state_dict())
    for model, optim in zip(models, (back, optims[1])):
        train(model, optim, 2, rank, world_size)
    return (rel_err(list(models[0].parameters()), list(models[1].parameters())),
            rel_err(state_tensors(back), state_tensors(optims[1])))


def _both(rank, world_size):
    return [_parity(rank, world_size, fo.AdamW, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
            _parity(rank, world_size, fo.SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True))]


def test_parity_and_round_trip_at_world_size_2():
    results = run_distributed(_both, 2)
    for rank, per_optim in enumerate(results):
        for name, (params_err, state_err) in zip(("AdamW", "SGD"), per_optim):
            assert params_err <= 1e-6 and state_err <= 1e-6, (rank, name, params_err, state_err)
