"""flashfsdp.checkpoint (DCP underneath) with the flat optimizers: a checkpoint saved with
flashfsdp.optim.AdamW loads into torch.optim.AdamW and the other way round, and training goes on
exactly as without the interruption."""

from __future__ import annotations

import pytest
import torch

import flashfsdp
import flashfsdp.optim as fo
from tests.optim.common import rel_err, sharded_mlp, state_tensors, train

KW = dict(lr=1e-2, weight_decay=0.1)


@pytest.mark.parametrize("first, second", [(fo.AdamW, torch.optim.AdamW), (torch.optim.AdamW, fo.AdamW)])
def test_checkpoint_hands_over_between_flat_and_torch(tmp_path, first, second):
    ref_model = sharded_mlp()
    ref_optim = torch.optim.AdamW(ref_model.parameters(), **KW)
    train(ref_model, ref_optim, 2)
    train(ref_model, ref_optim, 2)

    model = sharded_mlp()
    optim = first(model.parameters(), **KW)
    train(model, optim, 2)
    flashfsdp.checkpoint.save(tmp_path / "ckpt", model, optim, step=2)
    resumed = sharded_mlp(seed=1)  # other initial values: all of them must come from the checkpoint
    resumed_optim = second(resumed.parameters(), **KW)
    flashfsdp.checkpoint.load(tmp_path / "ckpt", resumed, resumed_optim)
    train(resumed, resumed_optim, 2)
    assert rel_err(list(resumed.parameters()), list(ref_model.parameters())) <= 1e-6
    assert rel_err(state_tensors(resumed_optim), state_tensors(ref_optim)) <= 1e-6
