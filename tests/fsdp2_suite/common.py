"""One face for two FSDP2 implementations, so a ported upstream case runs against both.

A case receives an :class:`Impl`: ``impl.fully_shard``, ``impl.MixedPrecisionPolicy`` ... are
torch's (``torch.distributed.fsdp``) or flashfsdp's. Both turn each parameter into a ``DTensor``
sharded on dim 0 (rows split into W chunks, the last ones possibly shorter or empty), so the
helpers below read a sharded parameter the same way for both.

Upstream's ``check_sharded_parity`` compares each local shard with the same shard cut out of the
replicated reference (``distribute_tensor``); :meth:`Impl.check_sharded_parity` does that, and
also records the *types* it saw — parameter and gradient class, placements, global shape and
``to_local()`` shape per parameter (:meth:`Impl.record_types`) — which the runner compares
between flashfsdp and torch for every case (``runner.py``): a drop-in must give client code the
same types, not only the same numbers. Cases record state-dict value types the same way. The
reference is upstream's too: a replicated model whose gradients are averaged over the ranks
after each backward (:func:`average_grads`, what ``replicate``/DDP does).
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


def type_of(value) -> tuple:
    """What client code can read of a value's type: class name, and for a DTensor its placements,
    global shape and local shape; for a plain tensor its shape. Other values: their class name."""
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    if isinstance(value, DTensor):
        return ("DTensor", tuple(str(p) for p in value.placements), tuple(value.shape),
                tuple(value.to_local().shape), str(value.dtype))
    if isinstance(value, torch.Tensor):
        return (type(value).__name__ if type(value) in (torch.Tensor, nn.Parameter) else "Tensor-subclass",
                tuple(value.shape), str(value.dtype))
    return (type(value).__name__,)


class Impl:
    """The public names both implementations share, and how to read their shards (DTensors)."""

    name = ""

    def __init__(self, api):
        """``api``: the module whose public FSDP2 names this implementation uses."""
        self.api = api
        self.type_log: list[tuple] = []
        for attr in ("fully_shard", "FSDPModule", "MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy",
                     "register_fsdp_forward_method"):
            setattr(self, attr, getattr(api, attr, None))

    def __repr__(self) -> str:
        return f"Impl({self.name})"

    # ---------------------------------------------------------------- types, compared with torch's
    def record_types(self, tag: str, values) -> None:
        """Log :func:`type_of` of ``values`` (a tensor, or a mapping / sequence of them) under
        ``tag``; the runner compares each case's log with torch's run of the same case."""
        if isinstance(values, dict):
            self.type_log.append((tag, tuple((k, type_of(v)) for k, v in values.items())))
        elif isinstance(values, (list, tuple)):
            self.type_log.append((tag, tuple(type_of(v) for v in values)))
        else:
            self.type_log.append((tag, type_of(values)))

    def take_type_log(self) -> list[tuple]:
        log, self.type_log = self.type_log, []
        return log

    # ---------------------------------------------------------------- reading shards
    def is_sharded(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is the sharded form (not the unsharded full parameter)."""
        from torch.distributed.tensor import DTensor  # noqa: PLC0415

        return isinstance(param, DTensor)

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's values of a sharded parameter or gradient (a plain tensor)."""
        return tensor.to_local()

    def shard_of(self, full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        """The part of ``full`` (a replicated tensor of ``param``'s full shape) this rank holds.

        ``distribute_tensor``'s chunk, cut from this rank's own copy (``src_data_rank=None``): the
        default scatters rank 0's copy, one collective per tensor, which made the parity checks
        (two per parameter) most of a training case's time on gloo."""
        from torch.distributed.tensor import distribute_tensor  # noqa: PLC0415

        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()

    def full(self, tensor: torch.Tensor, param: torch.Tensor | None = None) -> torch.Tensor:
        """The full value of a sharded parameter or gradient (collective over the ranks)."""
        return tensor.full_tensor() if self.is_sharded(tensor) else tensor

    def full_shape(self, param: torch.Tensor) -> torch.Size:
        return param.shape

    def check_sharded_parity(self, ref_model: nn.Module, model: nn.Module, prefixes_to_ignore=(),
                             rtol: float = FP32["rtol"], atol: float = FP32["atol"]) -> None:
        """Upstream's ``check_sharded_parity``: names equal, each local shard equal to the same shard
        of the reference parameter, and gradients too (None exactly where the reference has None);
        the types of every parameter and gradient are logged (:meth:`record_types`)."""
        ref_named, named = list(ref_model.named_parameters()), list(model.named_parameters())
        assert len(ref_named) == len(named), f"{len(ref_named)} reference parameters, {len(named)} sharded"
        for (ref_name, ref_param), (name, param) in zip(ref_named, named):
            for prefix in prefixes_to_ignore:
                name = name.replace(prefix, "")
            assert ref_name == name, f"parameter order differs: {ref_name} vs {name}"
            assert self.is_sharded(param), f"{name} is not sharded"
            assert self.full_shape(param) == ref_param.shape, f"{name}: shape {self.full_shape(param)} vs {ref_param.shape}"
            self.record_types(f"parity {name}", [param, param.grad])
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
        """The total norm over every rank (a plain tensor), after clipping with the stock
        ``torch.nn.utils.clip_grad_norm_`` (what FSDP2 code calls)."""
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type)
        return norm.full_tensor() if self.is_sharded(norm) else norm

    def count_collectives(self, functional: bool = True) -> contextlib.AbstractContextManager[CollectiveCounts]:
        """Count the all-gathers, reduce-scatters and all-reduces the implementation issues inside;
        ``functional=False``: not DTensor's functional collectives (counted under ``CommDebugMode``,
        whose module tracker hooks every module's inputs and so cannot run inside
        ``torch.autograd.grad`` over leaf inputs, as torch's pipelining runs its backward)."""
        raise NotImplementedError

    def fsdp_modules(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if isinstance(m, self.FSDPModule)]


class TorchImpl(Impl):
    """torch.distributed.fsdp (FSDP2)."""

    name = "torch"

    def __init__(self):
        from torch.distributed import fsdp  # noqa: PLC0415

        super().__init__(fsdp)

    def count_collectives(self, functional: bool = True):
        # torch >= 2.13 names the tensor collectives *_single; older releases *_into_tensor / *_tensor.
        return _counting((dist, _TORCH_COLLECTIVES))


class FlashImpl(Impl):
    """flashfsdp: the same DTensor parameters over each unit's flat shard."""

    name = "flashfsdp"

    def __init__(self):
        import flashfsdp  # noqa: PLC0415

        super().__init__(flashfsdp)

    def local(self, tensor):
        # Reading a chunk's own values ends the init window of a meta-initialised model (inside
        # it, a sharded parameter acts as its full-shape tensor; see flashfsdp's init_window.py).
        from flashfsdp.runtime.init_window import close_init_windows  # noqa: PLC0415

        close_init_windows()
        return super().local(tensor)

    def count_collectives(self, functional: bool = True):
        from flashfsdp.runtime.process_group import ProcessGroupCommunicator  # noqa: PLC0415

        # the units' collectives go through their communicators (flashfsdp's control-plane
        # collectives, e.g. the same-model check, through torch.distributed: not counted, as they
        # were not before); DTensor's (the stock clip_grad_norm_'s all-reduce) are functional
        # collectives, counted under CommDebugMode and added when the block ends
        counting = _counting((ProcessGroupCommunicator, {"all_gather": ("all_gather_into_tensor",),
                                                         "reduce_scatter": ("reduce_scatter_tensor",),
                                                         "all_reduce": ("all_reduce",)}))
        return _with_functional(counting) if functional else counting


@contextlib.contextmanager
def _with_functional(counting) -> Iterator[CollectiveCounts]:
    """``counting``'s counts plus the functional collectives (DTensor's) issued inside, added at exit."""
    from torch.distributed.tensor.debug import CommDebugMode  # noqa: PLC0415

    functional = {"all_gather": ("all_gather_into_tensor",), "reduce_scatter": ("reduce_scatter_tensor",),
                  "all_reduce": ("all_reduce",)}
    with counting as counts, CommDebugMode() as mode:
        yield counts
    by_op = mode.get_comm_counts()
    for kind, names in functional.items():
        for ns in (torch.ops.c10d_functional, torch.ops._c10d_functional):
            for name in names:
                op = getattr(ns, name, None)
                if op is not None:
                    setattr(counts, kind, getattr(counts, kind) + by_op.get(op, 0))


_TORCH_COLLECTIVES = {"all_gather": ("all_gather_into_tensor", "all_gather_single"),
                      "reduce_scatter": ("reduce_scatter_tensor", "reduce_scatter_single"),
                      "all_reduce": ("all_reduce",)}


@contextlib.contextmanager
def _counting(*targets: tuple[object, dict[str, tuple[str, ...]]]) -> Iterator[CollectiveCounts]:
    """Wrap each ``(owner, {kind: attribute names})`` target's functions to count calls by kind.
    Only the outermost counted call counts (a communicator's collective that calls
    ``torch.distributed``'s is one collective)."""
    counts = CollectiveCounts()
    saved = []
    depth = [0]
    for owner, attrs_by_kind in targets:
        for kind, attrs in attrs_by_kind.items():
            for attr in attrs:
                orig = getattr(owner, attr, None)
                if orig is None:
                    continue
                saved.append((owner, attr, orig))

                def counted(*args, _orig=orig, _kind=kind, **kwargs):
                    if depth[0] == 0:
                        setattr(counts, _kind, getattr(counts, _kind) + 1)
                    depth[0] += 1
                    try:
                        return _orig(*args, **kwargs)
                    finally:
                        depth[0] -= 1

                setattr(owner, attr, counted)
    try:
        yield counts
    finally:
        for owner, attr, orig in reversed(saved):
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
