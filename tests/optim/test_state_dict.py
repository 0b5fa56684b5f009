"""State dicts of the flat optimizers: torch's layout, interchangeable with torch.optim in both
directions (also through torch.save and flashfsdp's get/set_optimizer_state_dict), training on
exactly as an uninterrupted run."""

from __future__ import annotations

import io

import pytest
import torch

import flashfsdp
import flashfsdp.optim as fo
from tests.optim.common import rel_err, sharded_mlp, state_tensors, train

KW = {fo.AdamW: dict(lr=1e-2, weight_decay=0.1, amsgrad=True), fo.SGD: dict(lr=1e-2, momentum=0.9)}
TORCH = {fo.AdamW: torch.optim.AdamW, fo.SGD: torch.optim.SGD}


def _reference(cls):
    """Two plus two steps of torch's optimizer, uninterrupted."""
    model = sharded_mlp()
    optim = TORCH[cls](model.parameters(), **KW[cls])
    train(model, optim, 2)
    train(model, optim, 2)
    return model, optim


def _handover(first_cls, second_cls, via):
    """Two steps with ``first_cls``, its state loaded into a new ``second_cls`` by ``via``, two more."""
    model = sharded_mlp()
    flat = fo.AdamW if fo.AdamW in (first_cls, second_cls) else fo.SGD
    first = first_cls(model.parameters(), **KW[flat])
    train(model, first, 2)
    second = second_cls(model.parameters(), **KW[flat])
    via(model, first, second)
    train(model, second, 2)
    return model, second


def _plain(model, first, second):
    second.load_state_dict(first.state_dict())


def _saved(model, first, second):
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    second.load_state_dict(torch.load(buf, weights_only=False))


def _flashfsdp(model, first, second):
    flashfsdp.set_optimizer_state_dict(model, second, flashfsdp.get_optimizer_state_dict(model, first))


@pytest.mark.parametrize("cls", [fo.AdamW, fo.SGD])
@pytest.mark.parametrize("via", [_plain, _saved, _flashfsdp])
def test_round_trips_with_torch(cls, via):
    ref_model, ref_optim = _reference(cls)
    pairs = ((cls, TORCH[cls]), (TORCH[cls], cls)) + (((cls, cls),) if via is _plain else ())
    for first, second in pairs:
        model, optim = _handover(first, second, via)
        assert rel_err(list(model.parameters()), list(ref_model.parameters())) <= 1e-6, (first, second)
        assert rel_err(state_tensors(optim), state_tensors(ref_optim)) <= 1e-6, (first, second)


@pytest.mark.parametrize("cls", [fo.AdamW, fo.SGD])
def test_layout_is_torchs(cls):
    ref_model, ref_optim = _reference(cls)
    model = sharded_mlp()
    optim = cls(model.parameters(), **KW[cls])
    train(model, optim, 2)
    ours, theirs = optim.state_dict(), ref_optim.state_dict()
    assert ours["param_groups"] == theirs["param_groups"]
    assert sorted(ours["state"]) == sorted(theirs["state"]) == list(range(len(list(model.parameters()))))
    for i, entries in ours["state"].items():
        assert sorted(entries) == sorted(theirs["state"][i])
        for key, value in entries.items():
            assert value.shape == theirs["state"][i][key].shape and value.dtype == theirs["state"][i][key].dtype


def test_state_replaced_by_hand_is_stepped_as_given():
    """A state tensor assigned into ``optim.state`` between steps is taken over (the cached plan
    notices that it no longer holds its view), as torch's optimizers use what ``state`` holds."""
    runs = []
    for cls in (fo.AdamW, torch.optim.AdamW):
        model = sharded_mlp()
        optim = cls(model.parameters(), **KW[fo.AdamW])
        train(model, optim, 2)
        p = model.blocks[2].down.weight
        optim.state[p]["exp_avg"] = torch.full_like(p, 0.5)
        train(model, optim, 2)
        runs.append((model, optim))
    (model, optim), (ref_model, ref_optim) = runs
    assert rel_err(list(model.parameters()), list(ref_model.parameters())) <= 1e-6
    assert rel_err(state_tensors(optim), state_tensors(ref_optim)) <= 1e-6
