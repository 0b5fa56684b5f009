"""MixedPrecisionPolicy in a single process (W = 1): input and output casts, also when
``torch.utils.checkpoint`` recomputes a unit's forward in backward. Multi-rank mixed-precision
parity (bf16 compute, bf16 reduction) is in ``test_parity.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import flashfsdp
from flashfsdp import MixedPrecisionPolicy
from tests.training import Checkpointed

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


class _Net(nn.Module):
    """fp32 input projection and head (the root's unit) around a block (its own unit)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.block(self.inp(x)).float())


def _grads_after_one_step(checkpoint: bool | str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = _Net()
    flashfsdp.fully_shard(model.block, mp_policy=BF16)
    flashfsdp.fully_shard(model)
    if checkpoint:
        model.block = Checkpointed(model.block, reentrant=checkpoint == "reentrant")
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).sum().backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_recomputation_casts_inputs_like_the_forward(mode):
    """fp32 activations into a bf16 unit under activation checkpointing: the recomputation in
    backward casts them too, and the gradients equal those without checkpointing."""
    want = _grads_after_one_step(False)
    got = _grads_after_one_step("reentrant" if mode == "reentrant" else True)
    assert len(got) == len(want) == 8
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


class _Probe(nn.Module):
    """Records the dtypes of its inputs; returns a tuple of a float and an integer tensor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x, ids):
        self.seen.append((x.dtype, ids.dtype))
        return self.lin(x.to(self.lin.weight.dtype)), ids + 1


def test_output_dtype_casts_floating_outputs():
    probe = flashfsdp.fully_shard(_Probe(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                          output_dtype=torch.float16))
    out, ids = probe(torch.randn(2, 4), torch.arange(2))
    assert out.dtype == torch.float16 and ids.dtype == torch.int64
    out.float().sum().backward()
    assert probe.lin.weight.grad.dtype == torch.float32  # fp32 master gradient


@pytest.mark.parametrize("cast", [True, False])
def test_cast_forward_inputs(cast):
    probe = flashfsdp.fully_shard(_Probe(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                          cast_forward_inputs=cast))
    out, _ = probe(torch.randn(2, 4), torch.arange(2))
    assert probe.seen == [(torch.bfloat16 if cast else torch.float32, torch.int64)]
    assert out.dtype == torch.bfloat16  # no output_dtype: the compute dtype


def test_recomputation_casts_outputs_like_the_forward():
    """A checkpointed function that saves a tensor computed from a unit's cast output for backward
    (tanh saves its result): the recomputation must produce it in the same dtype."""
    from torch.utils.checkpoint import checkpoint  # noqa: PLC0415

    torch.manual_seed(0)
    block = nn.Linear(4, 4)
    ref = nn.Linear(4, 4)
    ref.load_state_dict(block.state_dict())
    flashfsdp.fully_shard(block, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, output_dtype=torch.float32))
    x = torch.randn(3, 4, requires_grad=True)
    out = checkpoint(lambda h: torch.tanh(block(h)), x, use_reentrant=False)
    assert out.dtype == torch.float32
    out.sum().backward()
    want = torch.tanh(nn.functional.linear(x.bfloat16(), ref.weight.bfloat16(), ref.bias.bfloat16()).float())
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert block.weight.grad is not None and x.grad is not None
