"""One face for two FSDP2 implementations, so a ported upstream case runs against both.

A case receives an :class:`Impl`: ``impl.fully_shard``, ``impl.MixedPrecisionPolicy`` ... are
torch's (``torch.distributed.fsdp``) or flashfsdp's, and the helpers below read a sharded
parameter the way each implementation stores it:

- torch's ``fully_shard`` turns each parameter into a ``DTensor`` sharded on dim 0 (rows split
  into W chunks, the last ones possibly shorter or empty);
- flashfsdp lays a unit's parameters end to end in one flat buffer split into W equal ranges, so
  a parameter's local piece is a 1-D range of its flattened values (``_flashfsdp_piece``).

Upstream's ``check_sharded_parity`` compares each local shard with the same shard cut out of the
replicated reference (``distribute_tensor``); :meth:`Impl.check_sharded_parity` does that for
both layouts. The reference is upstream's too: a replicated model whose gradients are averaged
over the ranks after each backward (:func:`average_grads`, what ``replicate``/DDP does).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from typing import Iterator

import torch
import torch.distributed as dist
import torch.nn as nn

# FSDP2's tests compare with assertEqual: for fp32, rtol 1.3e-6 and atol 1e-5.
FP32 = dict(rtol=1e-5, atol=1e-5)


@dataclasses.dataclass
class CollectiveCounts:
    """Collectives issued inside :meth:`Impl.count_collectives` (by kind)."""

    all_gather: int = 0
    reduce_scatter: int = 0
    all_reduce: int = 0


class Impl:
    """Base: the public names both implementations share, and how to read their shards."""

    name = ""

    def __init__(self, api):
        """``api``: the module whose public FSDP2 names this implementation uses."""
        self.api = api
        for attr in ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
                     "register_fsdp_forward_method"):
            setattr(self, attr, getattr(api, attr, None))

    def __repr__(self) -> str:
        return f"Impl({self.name})"

    # ---------------------------------------------------------------- reading shards
    def is_sharded(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is the sharded form (not the unsharded full parameter)."""
        raise NotImplementedError

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's values of a sharded parameter or gradient (a plain tensor)."""
        raise NotImplementedError

    def shard_of(self, full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """The part of ``full`` (a replicated tensor of ``param``'s full shape) this rank holds."""
        raise NotImplementedError

    def full(self, tensor: torch.Tensor, param: torch.Tensor | None = None) -> torch.Tensor:
        """The full value of a sharded parameter or gradient (collective over the ranks).

        ``param``: the parameter ``tensor`` is the gradient of (flashfsdp's gradients are plain
        1-D views, the layout is on the parameter).
        """
        raise NotImplementedError

    def full_shape(self, param: torch.Tensor) -> torch.Size:
        raise NotImplementedError

    def check_sharded_parity(self, ref_model: nn.Module, model: nn.Module, prefixes_to_ignore=(),
                             rtol: float = FP32["rtol"], atol: float = FP32["atol"]) -> None:
        """Upstream's ``check_sharded_parity``: names equal, each local shard equal to the same shard
        of the reference parameter, and gradients too (None exactly where the reference has None)."""
        ref_named, named = list(ref_model.named_parameters()), list(model.named_parameters())
        assert len(ref_named) == len(named), f"{len(ref_named)} reference parameters, {len(named)} sharded"
        for (ref_name, ref_param), (name, param) in zip(ref_named, named):
            for prefix in prefixes_to_ignore:
                name = name.replace(prefix, "")
            assert ref_name == name, f"parameter order differs: {ref_name} vs {name}"
            assert self.is_sharded(param), f"{name} is not sharded"
            assert self.full_shape(param) == ref_param.shape, f"{name}: shape {self.full_shape(param)} vs {ref_param.shape}"
            torch.testing.assert_close(self.local(param), self.shard_of(ref_param.detach(), param), rtol=rtol,
                                       atol=atol, msg=lambda m, name=name: f"{name}: {m}")
            if ref_param.grad is None:
                assert param.grad is None, f"{name}: the reference has no gradient but the sharded model has one"
                continue
            assert param.grad is not None, f"{name}: the reference has a gradient but the sharded model has none"
            torch.testing.assert_close(self.local(param.grad), self.shard_of(ref_param.grad, param), rtol=rtol,
                                       atol=atol, msg=lambda m, name=name: f"{name}.grad: {m}")

    def full_params(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """name -> full parameter value (collective)."""
        return {n: self.full(p).detach().clone() for n, p in model.named_parameters()}

    def full_grads(self, model: nn.Module) -> dict[str, torch.Tensor | None]:
        """name -> full gradient or None (collective; every rank must agree which are None)."""
        return {n: None if p.grad is None else self.full(p.grad, p).detach().clone()
                for n, p in model.named_parameters()}

    # ---------------------------------------------------------------- the API
    def clip_grad_norm_(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The total norm over every rank (a plain tensor), after clipping."""
        raise NotImplementedError

    def count_collectives(self) -> contextlib.AbstractContextManager[CollectiveCounts]:
        """Count the all-gathers, reduce-scatters and all-reduces the implementation issues inside."""
        raise NotImplementedError

    def fsdp_modules(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if isinstance(m, self.FSDPModule)]


class TorchImpl(Impl):
    """torch.distributed.fsdp (FSDP2): DTensor parameters sharded on dim 0."""

    name = "torch"

    def __init__(self):
        from torch.distributed import fsdp  # noqa: PLC0415

        super().__init__(fsdp)

    def is_sharded(self, param):
        from torch.distributed.tensor import DTensor  # noqa: PLC0415

        return isinstance(param, DTensor)

    def local(self, tensor):
        return tensor.to_local()

    def shard_of(self, full, param):
        from torch.distributed.tensor import distribute_tensor  # noqa: PLC0415

        return distribute_tensor(full, param.device_mesh, param.placements).to_local()

    def full(self, tensor, param=None):
        return tensor.full_tensor()

    def full_shape(self, param):
        return param.shape

    def clip_grad_norm_(self, model, max_norm, norm_type=2.0):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        return norm.full_tensor() if self.is_sharded(norm) else norm

    def count_collectives(self):
        # torch >= 2.13 names the tensor collectives *_single; older releases *_into_tensor / *_tensor.
        return _counting(dist, {"all_gather": ("all_gather_into_tensor", "all_gather_single"),
                                "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_single"),
                                "all_reduce": ("all_reduce",)})


class FlashImpl(Impl):
    """flashfsdp: each parameter's local piece is a 1-D range of its flattened values."""

    name = "flashfsdp"

    def __init__(self):
        import flashfsdp  # noqa: PLC0415

        super().__init__(flashfsdp)

    def is_sharded(self, param):
        return hasattr(param, "_flashfsdp_piece")

    def local(self, tensor):
        # Reading a piece's own values ends the init window of a meta-initialised model (inside
        # it, a sharded parameter acts as its full-shape tensor; see flashfsdp's init_window.py).
        from flashfsdp.bindings.init_window import close_init_windows  # noqa: PLC0415

        close_init_windows()
        return tensor.detach().reshape(-1)

    def shard_of(self, full, param):
        piece = param._flashfsdp_piece
        n = self.local(param).numel()  # (param.numel() is the full one inside an init window)
        return full.detach().reshape(-1)[piece.param_start : piece.param_start + n]

    def full(self, tensor, param=None):
        param = tensor if param is None else param
        if not self.is_sharded(param):
            return tensor
        piece = param._flashfsdp_piece
        mine = (piece.param_start, tensor.detach().reshape(-1).clone())
        everyone = [None] * dist.get_world_size() if dist.is_initialized() else [mine]
        if dist.is_initialized():
            dist.all_gather_object(everyone, mine)
        flat = torch.full((self.full_shape(param).numel(),), float("nan"), dtype=tensor.dtype)
        for start, values in everyone:
            flat[start : start + values.numel()] = values
        return flat.view(self.full_shape(param))

    def full_shape(self, param):
        return param._flashfsdp_full_shape if self.is_sharded(param) else param.shape

    def clip_grad_norm_(self, model, max_norm, norm_type=2.0):
        return self.api.clip_grad_norm_(model, max_norm, norm_type)

    def count_collectives(self):
        from flashfsdp.runtime.process_group import ProcessGroupCommunicator  # noqa: PLC0415

        return _counting(ProcessGroupCommunicator, {"all_gather": ("all_gather_into_tensor",),
                                                    "reduce_scatter": ("reduce_scatter_tensor",),
                                                    "all_reduce": ("all_reduce",)})


@contextlib.contextmanager
def _counting(owner, attrs_by_kind: dict[str, tuple[str, ...]]) -> Iterator[CollectiveCounts]:
    """Wrap ``owner``'s functions named in ``attrs_by_kind`` (kind -> names) to count calls by kind."""
    counts = CollectiveCounts()
    saved = {}
    for kind, attrs in attrs_by_kind.items():
        for attr in attrs:
            orig = getattr(owner, attr, None)
            if orig is None:
                continue
            saved[attr] = orig

            def counted(*args, _orig=orig, _kind=kind, **kwargs):
                setattr(counts, _kind, getattr(counts, _kind) + 1)
                return _orig(*args, **kwargs)

            setattr(owner, attr, counted)
    try:
        yield counts
    finally:
        for attr, orig in saved.items():
            setattr(owner, attr, orig)


_IMPLS: dict[str, Impl] = {}


def impl_named(name: str) -> Impl:
    """The :class:`Impl` called ``name`` ("torch" or "flashfsdp"), built once per process."""
    if name not in _IMPLS:
        _IMPLS[name] = {"torch": TorchImpl, "flashfsdp": FlashImpl}[name]()
    return _IMPLS[name]


# -------------------------------------------------------------------- the replicated reference
def replicate(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` to train as the replicated reference (see :func:`average_grads`)."""
    return copy.deepcopy(model)


def average_grads(ref_model: nn.Module) -> None:
    """Average the reference's gradients over the ranks, as DDP (upstream's ``replicate``) does."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for p in ref_model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(dist.get_world_size())


def train_step(model: nn.Module, optim: torch.optim.Optimizer, inp, *, average: bool = False,
               set_to_none: bool = True) -> torch.Tensor:
    """One step on ``model(inp).sum()``: ``optim.zero_grad(set_to_none)``, forward, backward,
    ``optim.step()``; with ``average`` (the replicated reference) the gradients are averaged over
    the ranks first (:func:`average_grads`). Returns the loss, detached."""
    optim.zero_grad(set_to_none=set_to_none)
    loss = model(inp).sum()
    loss.backward()
    if average:
        average_grads(model)
    optim.step()
    return loss.detach()


def train_parity(impl, ref: nn.Module, model: nn.Module, make_input, steps: int, lr: float = 1e-2, **tol):
    """Upstream's parity loop: the replicated reference (gradients averaged) vs the sharded model,
    on ``make_input(step)`` for each of ``steps`` steps: losses equal (``tol``: FP32 unless
    given), ``check_sharded_parity`` after backward, then an Adam(``lr``) step on both and
    ``zero_grad()``. Returns the losses."""
    tol = tol or FP32
    ref_optim = torch.optim.Adam(ref.parameters(), lr=lr)
    optim = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for i in range(steps):
        inp = make_input(i)
        ref_loss = ref(inp).sum()
        ref_loss.backward()
        average_grads(ref)
        loss = model(inp).sum()
        loss.backward()
        torch.testing.assert_close(loss, ref_loss, **tol)
        impl.check_sharded_parity(ref, model, **tol)
        ref_optim.step()
        optim.step()
        ref_optim.zero_grad(set_to_none=True)
        optim.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    return losses


def shard_transformer(impl: Impl, model: nn.Module, prepare_block=None, **kwargs) -> int:
    """fully_shard each ``TransformerBlock`` of ``model`` (``prepare_block(block)`` first, e.g.
    composable ``checkpoint``), then ``model``, with ``kwargs``; returns the number of blocks."""
    from torch.testing._internal.distributed._tensor.common_dtensor import TransformerBlock  # noqa: PLC0415

    blocks = [m for m in model.modules() if isinstance(m, TransformerBlock)]
    for block in blocks:
        if prepare_block is not None:
            prepare_block(block)
        impl.fully_shard(block, **kwargs)
    impl.fully_shard(model, **kwargs)
    return len(blocks)


def broadcast_params(model: nn.Module, src: int = 0) -> None:
    """Make every rank's parameters (and buffers) equal to rank ``src``'s."""
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            dist.broadcast(t, src=src)


def rank_seed(rank: int, base: int = 42) -> None:
    """Upstream's per-rank input seed: ``torch.manual_seed(42 + rank + 1)``."""
    torch.manual_seed(base + rank + 1)
