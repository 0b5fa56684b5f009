"""Client code run against torch's FSDP2 and against flashfsdp with only the import swapped.

Every test in this directory runs code the way a client library or a training script writes it
(nanoGPT, torchtitan, PEFT, Lightning Fabric, a transformers Mixtral, torchao) on W = 2 gloo ranks, once with
``torch.distributed.fsdp`` and once with ``flashfsdp`` as the FSDP2 module, on the same seeds.
A test is parametrised by :data:`IMPLS`: its ``torch`` case checks torch's FSDP2 against the
contract below and against an unsharded reference (so the test itself is shown to hold, and able
to fail); its ``flashfsdp`` case runs torch's FSDP2 first in the same ranks and then requires
flashfsdp to give the same types and the same values.

The contract is what client code relies on after ``fully_shard`` (see :func:`fsdp2_contract`):
every parameter an ``nn.Parameter`` holding a ``DTensor`` sharded ``(Shard(0),)`` (``(Shard(k),)``
where ``shard_placement_fn`` says so) on a 1-D mesh of W ranks, with the module's global shape and
``torch.chunk``'s slice along the shard dim as its local shape; gradients DTensors of the same
layout; ``state_dict()`` values DTensors too.

accelerate's FSDP2 path (``FullyShardedDataParallelPlugin(fsdp_version=2)``) has no case here: accelerate
enables FSDP only on accelerator devices; on CPU (``Accelerator(cpu=True)``, gloo) it sets up
``MULTI_CPU`` and wraps the model in DDP, the FSDP plugin unused.
"""

from __future__ import annotations

import copy
import importlib

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tests.harness import run_distributed

IMPLS = ("torch", "flashfsdp")
W = 2
# flashfsdp against torch's FSDP2, and either against the unsharded reference (fp32, W = 2).
TOL = dict(rtol=1e-5, atol=1e-6)


def fsdp_api(impl: str):
    """The module a client imports its FSDP2 names from: ``torch.distributed.fsdp`` or ``flashfsdp``."""
    return importlib.import_module({"torch": "torch.distributed.fsdp", "flashfsdp": "flashfsdp"}[impl])


def run(fn, *args, timeout: float = 240):
    """``fn(rank, W, *args)`` on W gloo ranks (the suite's forkserver spawner); results by rank."""
    return run_distributed(fn, W, *args, timeout=timeout)


def against_torch(impl: str, scenario, *args, **tol):
    """Run ``scenario(api, *args)`` with torch's FSDP2; for ``impl == "flashfsdp"`` run it again with
    flashfsdp (same process, same seeds) and require the same results (summaries equal, tensors to
    ``tol``, default :data:`TOL`). Returns torch's results. ``scenario`` checks itself against the
    FSDP2 contract and the unsharded reference, so the ``torch`` case proves the scenario holds."""
    want = scenario(fsdp_api("torch"), *args)
    if impl != "torch":
        got = scenario(fsdp_api(impl), *args)
        assert_close_tree(got, want, f"{impl} against torch's FSDP2", **tol)
    return want


# ------------------------------------------------------------------ types
def describe(t: torch.Tensor | None) -> dict | None:
    """What client code can observe of a tensor's type and layout (None for None)."""
    if t is None:
        return None
    dtensor = isinstance(t, DTensor)
    return {
        "type": type(t).__name__,
        "parameter": isinstance(t, nn.Parameter),
        "dtensor": dtensor,
        "placements": tuple(repr(p) for p in t.placements) if dtensor else None,
        "mesh_shape": tuple(t.device_mesh.shape) if dtensor else None,
        "shape": tuple(t.shape),
        "local_shape": tuple(t.to_local().shape) if dtensor else None,
        "dtype": str(t.dtype),
    }


def params_summary(model: nn.Module) -> dict:
    return {name: describe(p) for name, p in model.named_parameters()}


def grads_summary(model: nn.Module) -> dict:
    return {name: describe(p.grad) for name, p in model.named_parameters()}


def state_dict_summary(state_dict: dict) -> dict:
    return {name: describe(v) for name, v in state_dict.items()}


def chunk_shape(shape, rank: int, world_size: int = W, dim: int = 0) -> tuple:
    """The local shape of ``Shard(dim)`` over ``world_size`` ranks (``torch.chunk``'s slices along
    ``dim``; empty past the last chunk)."""
    if not shape:
        return ()
    d = shape[dim]
    rows = -(-d // world_size)
    start = min(rank * rows, d)
    return (*shape[:dim], min(rows, d - start), *shape[dim + 1:])


def local_chunk(full: torch.Tensor, rank: int, world_size: int = W, dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s slice of ``full`` under ``Shard(dim)``: what its ``to_local()`` must hold."""
    rows = -(-full.shape[dim] // world_size)
    return full[(slice(None),) * dim + (slice(rank * rows, (rank + 1) * rows),)]


def fsdp2_contract(named_tensors, rank: int, world_size: int = W, *, parameter: bool = True,
                   dims: dict | None = None) -> dict:
    """What :func:`describe` must give for each ``(name, full tensor)`` once sharded by FSDP2: for
    parameters (``parameter=True``), and for gradients and ``state_dict()`` values (plain DTensors).
    ``dims`` maps names to the shard dim ``shard_placement_fn`` gave them (default 0)."""
    dims = dims or {}
    return {
        name: {
            "type": "DTensor", "parameter": parameter, "dtensor": True,
            "placements": (f"Shard(dim={dims.get(name, 0)})",), "mesh_shape": (world_size,), "shape": tuple(t.shape),
            "local_shape": chunk_shape(t.shape, rank, world_size, dims.get(name, 0)), "dtype": str(t.dtype),
        }
        for name, t in named_tensors
    }


def assert_same(got, want, what: str) -> None:
    """``got == want`` for summaries (dicts by name), failing with the first entries that differ."""
    if got == want:
        return
    if isinstance(got, dict) and isinstance(want, dict):
        lines = [f"  {k}: got {got.get(k, '<missing>')}, want {want.get(k, '<missing>')}"
                 for k in list(want) + [k for k in got if k not in want] if got.get(k) != want.get(k)]
        raise AssertionError(f"{what}: {len(lines)} entries differ\n" + "\n".join(lines[:8]))
    raise AssertionError(f"{what}: got {got!r}, want {want!r}")


def assert_sharded_by(model: nn.Module, api) -> None:
    """Every unit of ``model`` is ``api``'s ``FSDPModule``: a client that reached ``fully_shard``
    through its own import (patched in the test) really ran the implementation under test."""
    units = [name for name, m in model.named_modules() if isinstance(m, api.FSDPModule)]
    assert units and "" in units, f"{api.__name__}: the root is not one of its FSDPModules (units: {units})"


def assert_params_contract(model: nn.Module, ref: nn.Module, rank: int, dims: dict | None = None) -> None:
    """Every parameter is an ``nn.Parameter`` DTensor ``(Shard(0),)`` (``(Shard(k),)`` where ``dims``
    maps its name to k) with the reference's shape."""
    assert_same(params_summary(model), fsdp2_contract(ref.named_parameters(), rank, dims=dims),
                "parameters after fully_shard")


def assert_grads_contract(model: nn.Module, ref: nn.Module, rank: int, dims: dict | None = None) -> None:
    """Every gradient (where the reference has one) is a DTensor of its parameter's placement
    (``(Shard(0),)``, or ``(Shard(k),)`` where ``dims`` maps its name to k) and shape."""
    want = fsdp2_contract(((n, p) for n, p in ref.named_parameters() if p.grad is not None), rank, parameter=False,
                          dims=dims)
    want = {n: want.get(n) for n, _ in ref.named_parameters()}
    assert_same(grads_summary(model), want, "gradients")


# ------------------------------------------------------------------ values
def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard, detached (what a client reads with ``to_local()``)."""
    return t.to_local().detach() if isinstance(t, DTensor) else t.detach()


def local_params(model: nn.Module) -> dict:
    return {name: local(p).clone() for name, p in model.named_parameters()}


def local_grads(model: nn.Module) -> dict:
    return {name: None if p.grad is None else local(p.grad).clone() for name, p in model.named_parameters()}


def assert_close_tree(got, want, what: str, **tol) -> None:
    """Nested dicts/lists of tensors (and plain values) equal: tensors to ``tol`` (default :data:`TOL`)."""
    tol = tol or TOL
    if isinstance(want, dict):
        assert isinstance(got, dict) and set(got) == set(want), f"{what}: keys {sorted(got)} vs {sorted(want)}"
        for k in want:
            assert_close_tree(got[k], want[k], f"{what}[{k}]", **tol)
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{what}: {got!r} vs {want!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close_tree(g, w, f"{what}[{i}]", **tol)
    elif isinstance(want, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}, want a tensor"
        torch.testing.assert_close(got, want, **tol, msg=lambda m: f"{what}: {m}")
    else:
        assert got == want, f"{what}: got {got!r}, want {want!r}"


def assert_shards_of(model_values: dict, ref: nn.Module, rank: int, what: str, *, grads: bool = False,
                     dims: dict | None = None) -> None:
    """Each local shard in ``model_values`` (by name) is rank ``rank``'s rows of the reference's
    parameter (``grads``: of its gradient); its slice along dim k where ``dims`` maps its name to k."""
    dims = dims or {}
    want = {}
    for name, p in ref.named_parameters():
        full = p.grad if grads else p
        want[name] = None if full is None else local_chunk(full.detach(), rank, dim=dims.get(name, 0))
    assert_close_tree(model_values, want, what)


def average_grads(ref: nn.Module, *, divide: bool = True) -> None:
    """The unsharded reference's gradients summed over the ranks, then divided by W (DDP's mean;
    ``divide=False``: the sum, FSDP2 under ``set_gradient_divide_factor(1.0)``)."""
    for p in ref.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            if divide:
                p.grad.div_(dist.get_world_size())


def replicate(model: nn.Module) -> nn.Module:
    """The unsharded reference: a deep copy taken before ``fully_shard``."""
    return copy.deepcopy(model)


def same_on_all_ranks(value: torch.Tensor) -> bool:
    """Whether a (small) tensor is bitwise the same on every rank."""
    gathered = [torch.empty_like(value) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, value.contiguous())
    return all(torch.equal(g, value) for g in gathered)


# ------------------------------------------------------------------ a nanoGPT-shaped model
class Block(nn.Module):
    """nanoGPT's block: pre-norm causal self-attention and a GELU MLP, biases and norms (1-D) included."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(d), nn.LayerNorm(d)
        # No bias on the qkv projection: the key bias's gradient is rounding noise (softmax ignores
        # it), which Adam would scale up to lr-sized steps that differ between any two summation orders.
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn_proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp_proj(nn.functional.gelu(self.c_fc(self.ln_2(x))))


class TinyGPT(nn.Module):
    """nanoGPT's GPT at toy size: token and position embeddings, blocks, a final LayerNorm and an
    lm_head tied to the token embedding. Odd sizes (vocab 37, d 12), so that W = 2 shards are uneven."""

    def __init__(self, vocab: int = 37, d: int = 12, heads: int = 2, layers: int = 2, seq: int = 8):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.h = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        self.vocab, self.seq = vocab, seq

    def forward(self, idx, targets=None):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1))


def tiny_gpt(seed: int = 0, **kwargs) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT(**kwargs)


def batches(model: TinyGPT, rank: int, steps: int, batch: int = 2) -> list:
    """Per-rank (idx, targets) token batches, different on each rank, the same for both implementations."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return [(torch.randint(model.vocab, (batch, model.seq), generator=gen),
             torch.randint(model.vocab, (batch, model.seq), generator=gen)) for _ in range(steps)]


def shard_gpt(model: TinyGPT, api, **kwargs) -> TinyGPT:
    """torchtitan's / nanoGPT-FSDP2's wrapping: each block, then the root (embeddings, ln_f, tied head)."""
    for block in model.h:
        api.fully_shard(block, **kwargs)
    api.fully_shard(model, **kwargs)
    assert_sharded_by(model, api)
    return model
