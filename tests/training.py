"""Training loops shared by the multi-rank tests: flashfsdp, torch FSDP2 and the replicated reference.

Every loop trains the same model from the same seed on the same global batches with AdamW. The
sharded loops give rank r rows [r·B, (r+1)·B) of each global batch of W·B rows; the reference
trains one process on the whole global batch. Losses are reported as the global mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import flashfsdp
from tests.models import llama_units, loss_fn, make_batch, make_llama, make_mlp

MICRO_BATCH = 2
LR = 1e-2


def make_model(kind: str) -> nn.Module:
    return make_mlp() if kind == "mlp" else make_llama()


def units_of(kind: str, model: nn.Module) -> list[nn.Module]:
    return model.units() if kind == "mlp" else llama_units(model)


def local_rows(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    b = x.shape[0] // world_size
    return x[rank * b : (rank + 1) * b]


def gather_full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Assemble every parameter's full value from the ranks' local pieces (all_gather_object).

    Independent of the runtime's own gathering: it only reads each piece's recorded range.
    """
    mine = {}
    for name, p in model.named_parameters():
        piece = getattr(p, "_flashfsdp_piece", None)
        if piece is None:
            mine[name] = (0, tuple(p.shape), p.detach().reshape(-1).clone())
        else:
            mine[name] = (piece.param_start, tuple(p._flashfsdp_full_shape), p.detach().clone())
    world = dist.get_world_size() if dist.is_initialized() else 1
    everyone = [None] * world
    if world > 1:
        dist.all_gather_object(everyone, mine)
    else:
        everyone = [mine]
    full = {}
    for rank_pieces in everyone:
        for name, (start, shape, data) in rank_pieces.items():
            buf = full.setdefault(name, torch.full((int(torch.Size(shape).numel()),), float("nan")))
            buf[start : start + data.numel()] = data.float()
    # ".inner." comes from the activation-checkpointing wrapper; the reference has no wrapper.
    return {name.replace(".inner.", "."): buf.view(everyone[0][name][1]) for name, buf in full.items()}


def train_flashfsdp(kind: str, rank: int, world_size: int, steps: int = 5, *, mp_policy=None,
                    grad_accum: int = 1, max_norm: float | None = None, checkpoint: bool = False,
                    reshard_after_forward: bool = True, global_batch: int | None = None,
                    load_from: str | None = None, save_to: str | None = None,
                    full_state_dict: bool = False) -> dict:
    """Train with flashfsdp; return global-mean losses, norms and the full parameters.

    Optional: ``global_batch`` rows per step independent of W (default ``MICRO_BATCH·W``);
    ``load_from`` a ``flashfsdp.checkpoint`` directory first and continue from its step (the result's
    "loaded" holds what ``load`` returned); ``save_to`` a checkpoint after the last step (extra: the
    losses); ``full_state_dict`` adds ``flashfsdp.get_full_state_dict(model)`` (rank 0; {} elsewhere).
    """
    model = make_model(kind)
    kwargs = {"reshard_after_forward": reshard_after_forward}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    for unit in units_of(kind, model):
        flashfsdp.fully_shard(unit, **kwargs)
    if checkpoint:
        _checkpoint_blocks(kind, model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms, result = [], [], {}
    start = 0
    if load_from is not None:
        result["loaded"] = flashfsdp.checkpoint.load(load_from, model, opt)
        start = result["loaded"]["step"]
    for step in range(start, start + steps):
        x, y = make_batch(kind, step, (global_batch or MICRO_BATCH * world_size) * grad_accum)
        x, y = local_rows(x, rank, world_size), local_rows(y, rank, world_size)
        total = torch.zeros(())
        for micro in range(grad_accum):
            model.set_requires_gradient_sync(micro == grad_accum - 1)
            xm, ym = x.chunk(grad_accum)[micro], y.chunk(grad_accum)[micro]
            loss = loss_fn(kind, model(xm), ym) / grad_accum
            loss.backward()
            total += loss.detach()
        if max_norm is not None:
            norms.append(flashfsdp.clip_grad_norm_(model, max_norm).item())
        opt.step()
        opt.zero_grad()
        if world_size > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world_size)
    if save_to is not None:
        flashfsdp.checkpoint.save(save_to, model, opt, step=start + steps, extra={"losses": losses})
    if full_state_dict:
        result["full_state_dict"] = flashfsdp.get_full_state_dict(model)
    return {"losses": losses, "norms": norms, "params": gather_full_params(model), **result}


def train_reference(kind: str, world_size: int, steps: int = 5, *, grad_accum: int = 1,
                    max_norm: float | None = None, dtype: torch.dtype | None = None,
                    state_dict: bool = False) -> dict:
    """The replicated reference: one process, the whole global batch, AdamW.

    ``state_dict`` adds the trained model's ``state_dict()`` (cloned) under "state_dict".
    """
    model = make_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(steps):
        x, y = make_batch(kind, step, MICRO_BATCH * world_size * grad_accum)
        loss = loss_fn(kind, model(x), y)
        loss.backward()
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    result = {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    if state_dict:
        result["state_dict"] = {k: v.clone() for k, v in model.state_dict().items()}
    return result


def train_torch_fsdp2(kind: str, rank: int, world_size: int, steps: int = 5, *, mp_policy=None) -> dict:
    """Train with ``torch.distributed.fsdp.fully_shard`` on the same seeds and batches."""
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    model = make_model(kind)
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for unit in units_of(kind, model):
        fully_shard(unit, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        x, y = make_batch(kind, step, MICRO_BATCH * world_size)
        loss = loss_fn(kind, model(local_rows(x, rank, world_size)), local_rows(y, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def _checkpoint_blocks(kind: str, model: nn.Module) -> None:
    """Route each block's call through non-reentrant activation checkpointing."""
    parent = model.blocks if kind == "mlp" else model.layers
    for i, block in enumerate(list(parent)):
        parent[i] = _Checkpointed(block)


class _Checkpointed(nn.Module):
    """Calls ``torch.utils.checkpoint.checkpoint(inner, x)``: the FSDP hooks run inside it."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, *args):
        from torch.utils.checkpoint import checkpoint  # noqa: PLC0415

        return checkpoint(self.inner, *args, use_reentrant=False)
