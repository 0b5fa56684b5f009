"""Small models for the multi-rank tests, and how each is wrapped into units."""

from __future__ import annotations

import torch
import torch.nn as nn

from flashfsdp.models.llama import Llama, LlamaConfig


class Bias(nn.Module):
    """A unit made of one bias vector of ``n`` elements (MLPStack's has d = 13: not divisible by
    W = 2 or 4, so the last rank's shard is partly padding)."""

    def __init__(self, n: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.bias


class MLPBlock(nn.Module):
    """Linear(d, h) → GELU → Linear(h, d), residual; odd sizes so nothing divides W evenly."""

    def __init__(self, d: int, h: int):
        super().__init__()
        self.up = nn.Linear(d, h)
        self.down = nn.Linear(h, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class MLPStack(nn.Module):
    """Input projection, a stack of MLP blocks, a one-bias unit, an output head.

    The uneven sizes the parity tests need: ``head.bias`` has ``d_out`` = 3 elements, fewer than
    W = 4 (some ranks hold an empty dim-0 chunk of it); ``shift`` is a unit of one 13-element bias; no
    weight has a size divisible by 4.
    """

    def __init__(self, d_in: int = 7, d: int = 13, h: int = 21, n_blocks: int = 3, d_out: int = 3):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(MLPBlock(d, h) for _ in range(n_blocks))
        self.shift = Bias(d)
        self.head = nn.Linear(d, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.shift(h))

    def units(self) -> list[nn.Module]:
        """Modules to fully_shard, innermost first (the root last)."""
        return [*self.blocks, self.shift, self]


def make_mlp(seed: int = 0) -> MLPStack:
    torch.manual_seed(seed)
    return MLPStack()


def make_llama(seed: int = 0) -> Llama:
    config = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=40, max_seq_len=16)
    model = Llama(config)
    model.init_weights(seed)
    return model


def llama_units(model: Llama) -> list[nn.Module]:
    """One unit per block plus the root (which owns the tied embedding, the final norm)."""
    return [*model.layers, model]


def make_batch(kind: str, step: int, global_batch: int, seed: int = 1234):
    """The global batch of step ``step`` (identical on every rank): (inputs, targets)."""
    g = torch.Generator().manual_seed(seed + step)
    if kind == "mlp":
        x = torch.randn(global_batch, 7, generator=g)
        y = torch.randn(global_batch, 3, generator=g)
        return x, y
    tokens = torch.randint(0, 64, (global_batch, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_fn(kind: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if kind == "mlp":
        return torch.nn.functional.mse_loss(out.float(), target)
    return torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), target.reshape(-1))
