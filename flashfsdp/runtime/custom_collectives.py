"""FSDP2's custom collectives (``FSDPModule.set_custom_all_gather`` / ``set_custom_reduce_scatter``)
as flashfsdp :class:`Communicator`\\ s.

torch's ``AllGather`` / ``ReduceScatter`` objects (``torch.distributed.fsdp._fully_shard._fsdp_api``)
are called as FSDP2 calls them: ``allocate(size, dtype=, device=)`` gives the collective's buffers
(the all-gather output, whose rank slice is the input; the reduce-scatter input and output), then
``comm(output_tensor=, input_tensor=, group=, [op=,] async_op=True)`` runs it over the unit's
process group and returns a ``dist.Work`` (or None when it ran synchronously). The unit's own
buffers are copied into the allocated one and back (one copy each way). Every other collective
goes to the unit's communicator. A unit with a custom collective runs it alone: it joins no
bucket (``bucket.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashfsdp._torch_private import custom_collective_types

from .communicator import Communicator, ReduceOpName, Work, check_collective_sizes, check_reduce_op

_OPS = {"sum": "SUM", "avg": "AVG", "max": "MAX"}


def _group_of(comm: Communicator, what: str) -> dist.ProcessGroup:
    """The torch process group ``comm`` runs over (what FSDP2 hands a custom collective).

    Raises:
        ValueError: ``comm`` has none (a single process without torch.distributed, or a
            user-given Communicator without a ``group``).
    """
    group = getattr(comm, "group", None)
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"{what}: the unit's communicator {type(comm).__name__} runs over no torch.distributed process group, "
            f"which the custom collective is called with; initialise torch.distributed and use flashfsdp's "
            f"communicators (communicator='auto')")
    return group


def _allocated(comm, size: int, like: torch.Tensor, what: str) -> torch.Tensor:
    """``comm.allocate((size,), ...)``, checked: a contiguous 1-D tensor of ``like``'s dtype and device."""
    buffer = comm.allocate((size,), dtype=like.dtype, device=like.device)
    if (not isinstance(buffer, torch.Tensor) or buffer.shape != (size,) or buffer.dtype != like.dtype
            or buffer.device != like.device or not buffer.is_contiguous()):
        raise ValueError(f"{what}: {type(comm).__name__}.allocate(({size},), dtype={like.dtype}, device={like.device}) "
                         f"must return a contiguous tensor of that size, dtype and device, got "
                         f"{getattr(buffer, 'shape', type(buffer).__name__)}")
    return buffer


class _CustomWork(Work):
    """The custom collective's ``dist.Work`` (None: it ran synchronously), then ``out.copy_(result)``."""

    def __init__(self, work, result: torch.Tensor | None = None, out: torch.Tensor | None = None):
        self._work, self._result, self._out = work, result, out

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._out is not None:
            self._out.copy_(self._result)
            self._out = None

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


class _Delegating(Communicator):
    """The unit's communicator, one collective replaced by the user's object."""

    def __init__(self, base: Communicator, user, what: str):
        self.base, self.user = base, user
        self.rank, self.world_size = base.rank, base.world_size
        self.group = _group_of(base, what)

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        return self.base.all_gather_into_tensor(out, inp)

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOpName = "sum") -> Work:
        return self.base.reduce_scatter_tensor(out, inp, op)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName = "sum") -> Work:
        return self.base.all_reduce(tensor, op)

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        return self.base.broadcast(tensor, src)

    def barrier(self) -> None:
        self.base.barrier()

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, label: str | None = None) -> Work:
        return self.base.all_to_all_single(out, inp, label)


class CustomAllGather(_Delegating):
    """A communicator whose all-gather is a torch FSDP2 ``AllGather`` object (see the module docstring)."""

    def __init__(self, base: Communicator, user):
        if not isinstance(user, custom_collective_types()[0]):
            raise TypeError(f"set_custom_all_gather: expected torch's AllGather "
                            f"(torch.distributed.fsdp._fully_shard._fsdp_api), got {type(user).__name__}")
        super().__init__(base, user, "set_custom_all_gather")

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        check_collective_sizes("all_gather_into_tensor", out, inp, self.world_size)
        buffer = _allocated(self.user, out.numel(), out, "set_custom_all_gather")
        own = buffer.narrow(0, self.rank * inp.numel(), inp.numel())
        own.copy_(inp)
        work = self.user(output_tensor=buffer, input_tensor=own, group=self.group, async_op=True)
        return _CustomWork(work, buffer, out)


class CustomReduceScatter(_Delegating):
    """A communicator whose reduce-scatter is a torch FSDP2 ``ReduceScatter`` object (see the module
    docstring)."""

    def __init__(self, base: Communicator, user):
        if not isinstance(user, custom_collective_types()[1]):
            raise TypeError(f"set_custom_reduce_scatter: expected torch's ReduceScatter "
                            f"(torch.distributed.fsdp._fully_shard._fsdp_api), got {type(user).__name__}")
        super().__init__(base, user, "set_custom_reduce_scatter")

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOpName = "sum") -> Work:
        check_reduce_op(op)
        check_collective_sizes("reduce_scatter_tensor", inp, out, self.world_size)
        buffer = _allocated(self.user, inp.numel(), inp, "set_custom_reduce_scatter")
        buffer.copy_(inp)
        output = _allocated(self.user, out.numel(), out, "set_custom_reduce_scatter")
        work = self.user(output_tensor=output, input_tensor=buffer, group=self.group,
                         op=getattr(dist.ReduceOp, _OPS[op]), async_op=True)
        return _CustomWork(work, output, out)


def custom_all_gather(unit, comm) -> None:
    """``unit``'s all-gathers through torch's ``AllGather`` ``comm`` (``set_custom_all_gather``)."""
    unit.ag_comm = CustomAllGather(unit.comm, comm)


def custom_reduce_scatter(unit, comm) -> None:
    """``unit``'s reduce-scatters through torch's ``ReduceScatter`` ``comm``, over the group they ran
    on (a separate reduce-scatter group's too; ``set_custom_reduce_scatter``)."""
    rs_comm = unit.rs_comm
    base = rs_comm.base if isinstance(rs_comm, CustomReduceScatter) else (rs_comm or unit.comm)
    unit.rs_comm = CustomReduceScatter(base, comm)
