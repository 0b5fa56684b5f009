"""What the ported FSDP1 cases share: the wrapper of either implementation, a small nested model,
the replicated reference, and reading full parameters.

A case receives the FSDP2 suite's ``Impl`` (``tests/fsdp2_suite/common.py``); :func:`api` gives
its FSDP1 names (``torch.distributed.fsdp`` or ``flashfsdp.fsdp1``).
Every wrapper is built with ``device_id=torch.device("cpu")`` (torch's FSDP1 computes on CPU
only when told so).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn

FP32 = dict(rtol=1e-5, atol=1e-5)
CPU = torch.device("cpu")


def api(impl):
    """The implementation's FSDP1 namespace: ``torch.distributed.fsdp`` or ``flashfsdp.fsdp1``
    (``FullyShardedDataParallel``, ``ShardingStrategy``, ``MixedPrecision``, ``CPUOffload``,
    ``StateDictType``, the configs, and ``wrap``'s policies)."""
    if impl.name == "torch":
        return impl.api
    import flashfsdp.fsdp1  # noqa: PLC0415

    return flashfsdp.fsdp1


def FSDP(impl):
    """The implementation's ``FullyShardedDataParallel`` class."""
    return api(impl).FullyShardedDataParallel


def wrap(impl, module: nn.Module, **kwargs) -> nn.Module:
    """``FullyShardedDataParallel(module, device_id=cpu, **kwargs)`` of ``impl``."""
    kwargs.setdefault("device_id", CPU)
    return FSDP(impl)(module, **kwargs)


class Block(nn.Module):
    """A residual block: two linears around a LayerNorm (a buffer too, for buffer tests)."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin1, self.norm, self.lin2 = nn.Linear(dim, dim), nn.LayerNorm(dim), nn.Linear(dim, dim)
        self.register_buffer("scale", torch.full((dim,), 0.5))

    def reset_parameters(self) -> None:
        """The block's own state (its buffer); the linears and the norm reset their own."""
        self.scale.fill_(0.5)

    def forward(self, x):
        return x + self.lin2(torch.relu(self.norm(self.lin1(x)))) * self.scale


class Net(nn.Module):
    """in (8) -> 2 Blocks (16) -> head (4): 1,004 parameters, odd sizes for uneven shards."""

    def __init__(self, dim: int = 16, blocks: int = 2):
        super().__init__()
        self.inp = nn.Linear(8, dim)
        self.blocks = nn.Sequential(*[Block(dim) for _ in range(blocks)])
        self.head = nn.Linear(dim, 4, bias=False)

    def forward(self, x):
        return self.head(self.blocks(self.inp(x)))


def make_net(seed: int = 0, **kwargs) -> Net:
    torch.manual_seed(seed)
    return Net(**kwargs)


def batch(step: int, rank: int, world_size: int, rows: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's slice, the global batch) of step ``step``: the same global batch on every rank."""
    gen = torch.Generator().manual_seed(1000 + step)
    whole = torch.randn(rows * world_size, 8, generator=gen)
    return whole[rank * rows : (rank + 1) * rows], whole


def full_params(impl, model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> full value of every parameter (through ``summon_full_params``, clean names)."""
    with FSDP(impl).summon_full_params(model, writeback=False):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def reference_step(ref: nn.Module, whole: torch.Tensor, world_size: int) -> torch.Tensor:
    """Backward of the replicated reference on the global batch, scaled as FSDP's gradient mean
    over ranks of each rank's ``model(x).sum()``; returns the mean loss."""
    loss = ref(whole).sum() / world_size
    loss.backward()
    return loss.detach()


def train_against_reference(rank: int, world_size: int, impl, model: nn.Module, fsdp_model: nn.Module,
                            ref: nn.Module, steps: int = 3, lr: float = 1e-2, tol=FP32, clip: float | None = None):
    """Adam steps on ``fsdp_model`` and on the replicated reference ``ref`` (the same model before
    wrapping): each step's loss (summed over ranks) and the full parameters must match. Returns
    (losses, norms, final full parameters)."""
    optim = torch.optim.Adam(fsdp_model.parameters(), lr=lr)
    ref_optim = torch.optim.Adam(ref.parameters(), lr=lr)
    losses, norms = [], []
    for step in range(steps):
        local, whole = batch(step, rank, world_size)
        loss = fsdp_model(local).sum()
        loss.backward()
        ref_loss = reference_step(ref, whole, world_size)
        if clip is not None:
            norms.append(fsdp_model.clip_grad_norm_(clip).detach().float())
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
            torch.testing.assert_close(norms[-1], ref_norm, **tol)
        optim.step()
        ref_optim.step()
        optim.zero_grad()
        ref_optim.zero_grad()
        summed = loss.detach().clone()
        dist.all_reduce(summed)
        torch.testing.assert_close(summed / world_size, ref_loss, **tol)
        losses.append(summed)
        got, want = full_params(impl, fsdp_model), dict(ref.named_parameters())
        assert list(got) == list(want), f"parameter names {list(got)} vs the reference's {list(want)}"
        for name, value in got.items():
            torch.testing.assert_close(value, want[name].detach(), **tol,
                                       msg=lambda m, n=name: f"step {step}, {n}: {m}")
    return losses, norms, full_params(impl, fsdp_model)


def wrapped_paths(impl, model: nn.Module) -> list[str]:
    """The paths of the wrappers in ``model``, without ``_fsdp_wrapped_module`` segments."""
    cls = FSDP(impl)
    return [n.replace("_fsdp_wrapped_module.", "").replace("._fsdp_wrapped_module", "")
            for n, m in model.named_modules() if isinstance(m, cls)]


def replicate(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model)
