"""Training loops shared by the multi-rank tests: flashfsdp, torch FSDP2 and the replicated reference.

Every loop trains the same model from the same seed on the same global batches with AdamW. The
sharded loops give rank r rows [r·B, (r+1)·B) of each global batch of W·B rows; the reference
trains one process on the whole global batch. Losses are reported as the global mean.
``repeat_batch`` trains on step 0's batch at every step: the tokens are random, so only then does
the model learn something (it memorises the batch) and the loss falls clearly.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import flashfsdp
from flashfsdp.runtime.communicator import Communicator
from tests.models import llama_units, loss_fn, make_batch, make_llama, make_mlp

MICRO_BATCH = 2
LR = 1e-2


def make_model(kind: str) -> nn.Module:
    return make_mlp() if kind == "mlp" else make_llama()


def units_of(kind: str, model: nn.Module) -> list[nn.Module]:
    return model.units() if kind == "mlp" else llama_units(model)


class CountingCommunicator(Communicator):
    """Delegates every collective to a real communicator and records each reduce-scatter's input
    size and dtype (``reduce_scatter_numels``, ``reduce_scatter_dtypes``), so tests can count the
    gradient communication."""

    def __init__(self, inner: Communicator):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.group = getattr(inner, "group", None)
        self.reduce_scatter_numels: list[int] = []
        self.reduce_scatter_dtypes: list[torch.dtype] = []

    def all_gather_into_tensor(self, out, inp):
        return self.inner.all_gather_into_tensor(out, inp)

    def reduce_scatter_tensor(self, out, inp, op="sum"):
        self.reduce_scatter_numels.append(inp.numel())
        self.reduce_scatter_dtypes.append(inp.dtype)
        return self.inner.reduce_scatter_tensor(out, inp, op)

    def all_reduce(self, tensor, op="sum"):
        return self.inner.all_reduce(tensor, op)

    def broadcast(self, tensor, src):
        return self.inner.broadcast(tensor, src)

    def barrier(self):
        self.inner.barrier()


def local_rows(x: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    b = x.shape[0] // world_size
    return x[rank * b : (rank + 1) * b]


def _rows_held(t: torch.Tensor) -> tuple[int, tuple[int, ...], torch.Tensor]:
    """(first dim-0 row, full shape, local values) of what this rank holds of ``t``: of a DTensor
    sharded on dim 0, its local chunk at the row ``torch.chunk`` over the mesh dimension puts it
    (``Replicate`` dimensions hold the same chunk on every replica); of a plain tensor, all of it.
    Worked out from the placements and the mesh coordinate only, not from the runtime's layout."""
    if not isinstance(t, DTensor):
        return 0, tuple(t.shape), t.detach().clone()
    start, coordinate = 0, t.device_mesh.get_coordinate()
    for dim, placement in enumerate(t.placements):
        if isinstance(placement, Shard):
            assert placement.dim == 0, f"only dim-0 sharding is expected, got {t.placements}"
            k = -(-t.shape[0] // t.device_mesh.size(dim))
            start = min(coordinate[dim] * k, t.shape[0])
        else:
            assert isinstance(placement, Replicate), f"unexpected placement {placement}"
    return start, tuple(t.shape), t.to_local().detach().clone()


def _assemble(held_by_rank) -> torch.Tensor:
    """A full tensor (float32) from every rank's ``_rows_held``; NaN where no rank held rows."""
    shape = held_by_rank[0][1]
    full = torch.full(shape, float("nan"))
    for start, _, data in held_by_rank:
        if data.dim() == 0:
            full = data.float().clone()
        elif data.numel():
            full[start : start + data.shape[0]] = data.float()
    return full


def gather_full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Assemble every parameter's full value from the ranks' local chunks (all_gather_object).

    Independent of the runtime's own gathering: it only reads each DTensor parameter's local
    tensor and places it at the rows FSDP2's dim-0 chunking gives its mesh coordinate. Reading
    the parameters' own values ends an init window (a meta-device model initialised in place).
    """
    from flashfsdp.runtime.init_window import close_init_windows  # noqa: PLC0415

    close_init_windows()
    mine = {name: _rows_held(p) for name, p in model.named_parameters()}
    everyone = _everyone(mine)
    # ".inner." comes from the activation-checkpointing wrapper; the reference has no wrapper.
    return {name.replace(".inner.", "."): _assemble([held[name] for held in everyone]) for name in mine}


def _everyone(mine: object) -> list:
    """Every rank's ``mine`` (all_gather_object), or ``[mine]`` without a process group."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return [mine]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return everyone


def gather_full_optimizer_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """name -> {state key: full tensor} assembled from every rank's optimizer state of its chunks.

    Collective. Independent of the runtime's own state dicts: it only reads each state DTensor's
    local tensor, placed as :func:`gather_full_params` places a parameter's; scalars (``step``)
    are taken as they are.
    """
    mine = {name: {k: _rows_held(v) for k, v in opt.state[p].items()} for name, p in model.named_parameters()}
    everyone = _everyone(mine)
    return {name: {key: _assemble([held[name][key] for held in everyone]) if entries[key][2].dim()
                   else entries[key][2] for key in entries}
            for name, entries in mine.items()}


def train_flashfsdp(kind: str, rank: int, world_size: int, steps: int = 5, *, mp_policy=None,
                    grad_accum: int = 1, max_norm: float | None = None, norm_type: float = 2.0,
                    checkpoint: bool | str = False, reshard_after_forward: bool | int | None = True,
                    global_batch: int | None = None, load_from: str | None = None, save_to: str | None = None,
                    full_state_dict: bool = False, lr: float = LR, repeat_batch: bool = False,
                    use_mesh: bool = False, communicator: Communicator | None = None,
                    keep_unsharded_between_micro_batches: bool = False, shard_kwargs: dict | None = None) -> dict:
    """Train with flashfsdp; return global-mean losses, norms and the full parameters.

    Optional: ``global_batch`` rows per step independent of W (default ``MICRO_BATCH·W``);
    ``load_from`` a ``flashfsdp.checkpoint`` directory first and continue from its step (the result's
    "loaded" holds what ``load`` returned); ``save_to`` a checkpoint after the last step (extra: the
    losses); ``full_state_dict`` adds ``flashfsdp.get_full_state_dict(model)`` (rank 0; {} elsewhere);
    ``checkpoint``: True or "reentrant" routes each block through activation checkpointing
    (non-reentrant / reentrant); ``use_mesh`` shards over ``init_device_mesh("cpu", (W,))``;
    ``communicator`` is passed to every fully_shard call (a :class:`CountingCommunicator` adds
    "reduce_scatters": how many each micro-batch's backward issued);
    ``keep_unsharded_between_micro_batches`` calls ``set_reshard_after_backward(False)`` on all but
    the last micro-batch and adds "unsharded_after_no_sync": per such micro-batch, whether every
    unit still held its unsharded parameters after backward. ``shard_kwargs``: more arguments of
    every fully_shard call (e.g. a 2-D ``mesh``, an ``offload_policy``).
    """
    model = make_model(kind)
    kwargs = {"reshard_after_forward": reshard_after_forward, **(shard_kwargs or {})}
    if mp_policy is not None:
        kwargs["mp_policy"] = mp_policy
    if use_mesh:
        from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

        kwargs["mesh"] = init_device_mesh("cpu", (world_size,))
    if communicator is not None:
        kwargs["communicator"] = communicator
    for unit in units_of(kind, model):
        flashfsdp.fully_shard(unit, **kwargs)
    if checkpoint:
        _checkpoint_blocks(kind, model, reentrant=checkpoint == "reentrant")
    states = [m._flashfsdp_state for m in model.modules() if hasattr(m, "_flashfsdp_state")]
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, norms, result = [], [], {}
    counting = communicator if isinstance(communicator, CountingCommunicator) else None
    if counting is not None:
        result["reduce_scatters"] = []
    if keep_unsharded_between_micro_batches:
        result["unsharded_after_no_sync"] = []
    start = 0
    if load_from is not None:
        result["loaded"] = flashfsdp.checkpoint.load(load_from, model, opt)
        start = result["loaded"]["step"]
    for step in range(start, start + steps):
        x, y = make_batch(kind, 0 if repeat_batch else step, (global_batch or MICRO_BATCH * world_size) * grad_accum)
        x, y = local_rows(x, rank, world_size), local_rows(y, rank, world_size)
        total = torch.zeros(())
        for micro in range(grad_accum):
            last = micro == grad_accum - 1
            model.set_requires_gradient_sync(last)
            if keep_unsharded_between_micro_batches:
                model.set_reshard_after_backward(last)
            issued = len(counting.reduce_scatter_numels) if counting is not None else 0
            xm, ym = x.chunk(grad_accum)[micro], y.chunk(grad_accum)[micro]
            loss = loss_fn(kind, model(xm), ym) / grad_accum
            loss.backward()
            total += loss.detach()
            if counting is not None:
                result["reduce_scatters"].append(len(counting.reduce_scatter_numels) - issued)
            if keep_unsharded_between_micro_batches and not last:
                result["unsharded_after_no_sync"].append(
                    all(s.unit.memory_bytes()["unsharded"] > 0 and s.holds_unsharded for s in states))
        if max_norm is not None:
            norms.append(flashfsdp.clip_grad_norm_(model, max_norm, norm_type).item())
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
                    max_norm: float | None = None, norm_type: float = 2.0, dtype: torch.dtype | None = None,
                    state_dict: bool = False, lr: float = LR, repeat_batch: bool = False) -> dict:
    """The replicated reference: one process, the whole global batch, AdamW.

    ``state_dict`` adds the trained model's ``state_dict()`` (cloned) under "state_dict".
    """
    model = make_model(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses, norms = [], []
    for step in range(steps):
        x, y = make_batch(kind, 0 if repeat_batch else step, MICRO_BATCH * world_size * grad_accum)
        loss = loss_fn(kind, model(x), y)
        loss.backward()
        if max_norm is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    result = {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}
    if state_dict:
        result["state_dict"] = {k: v.clone() for k, v in model.state_dict().items()}
    return result


def train_torch_fsdp2(kind: str, rank: int, world_size: int, steps: int = 5, *, mp_policy=None,
                      lr: float = LR, repeat_batch: bool = False, shard_kwargs: dict | None = None) -> dict:
    """Train with ``torch.distributed.fsdp.fully_shard`` on the same seeds and batches
    (``shard_kwargs``: more arguments of every fully_shard call, e.g. a 2-D ``mesh``)."""
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    model = make_model(kind)
    kwargs = {**({} if mp_policy is None else {"mp_policy": mp_policy}), **(shard_kwargs or {})}
    for unit in units_of(kind, model):
        fully_shard(unit, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for step in range(steps):
        x, y = make_batch(kind, 0 if repeat_batch else step, MICRO_BATCH * world_size)
        loss = loss_fn(kind, model(local_rows(x, rank, world_size)), local_rows(y, rank, world_size))
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world_size)
    params = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    return {"losses": losses, "params": params}


def _checkpoint_blocks(kind: str, model: nn.Module, reentrant: bool = False) -> None:
    """Route each block's call through activation checkpointing (non-reentrant by default)."""
    parent = model.blocks if kind == "mlp" else model.layers
    for i, block in enumerate(list(parent)):
        parent[i] = Checkpointed(block, reentrant)


class Checkpointed(nn.Module):
    """Calls ``torch.utils.checkpoint.checkpoint(inner, *args, use_reentrant=reentrant)``: the
    FSDP hooks of ``inner`` run inside it, and again in the recomputation during backward."""

    def __init__(self, inner: nn.Module, reentrant: bool = False):
        super().__init__()
        self.inner = inner
        self.reentrant = reentrant

    def forward(self, *args):
        from torch.utils.checkpoint import checkpoint  # noqa: PLC0415

        return checkpoint(self.inner, *args, use_reentrant=self.reentrant)
