"""ProcessGroupCommunicator: the Communicator over any torch.distributed process group.

Gloo on CPU (the multi-rank tests), or NCCL through torch on CUDA (the baseline that
``NcclCommunicator`` must match or beat). Every collective is issued with ``async_op=True``, so on
CPU gloo runs it on its own thread while the caller computes: overlap is real there too.

[Note: completion times]
``track_completion()`` adds a done-callback to the handle's future (``Work.get_future()``). Gloo
marks that future completed on its worker thread once the output is written, before ``wait()``
can return, and runs the callback there: it stamps ``time.perf_counter()`` (the clock of
``flashfsdp.profile()``; one process-wide monotonic clock, the same in every thread). The stamp
is a single attribute store made while holding the GIL, read by the waiting thread only after
``wait()`` returned (or later, when the profile is resolved): no lock is needed. It can be late by
the time gloo's thread takes to acquire the GIL, which the compute thread releases inside every
torch op and ``wait()``; at most about ``sys.getswitchinterval()`` (5 ms) while it runs pure Python.

[Note: gloo reduce-scatter]
torch's gloo backend has no reduce-scatter of its own: ``ProcessGroupGloo::_reduce_scatter_base``
(torch 2.x, ``reduce_scatter_tensor_coalesced``) clones the input, all-reduces the clone and copies
this rank's chunk out: every rank moves the whole input twice (the all-reduce's reduce-scatter and
all-gather phases) and copies it once more, and the handle it returns never reports completion. On
gloo this module reduce-scatters with one all-to-all instead (:class:`_AllToAllSum`): rank r
receives chunk r of every rank's input — (W - 1)/W of the input's bytes, half of an all-reduce's,
no clone — and ``wait()`` sums the W chunks in rank order into the output (``torch.sum`` over them:
fp32 accumulation for a 16-bit dtype, rounded once). At W = 2 every element is the same one
addition as the all-reduce's, so the results are bit for bit those of torch's reduce-scatter; at
W > 2 the sum's order may differ from the all-reduce's ring (within its rounding). The all-to-all's
gloo work has a future, so its completion is timed; the sum that follows at ``wait()`` runs on the
waiting thread as host work (``W·S`` elements read), not communication.

[Note: flight recorder]
Every collective issued here takes an entry of the flight recorder (``flight.py``: kind, group,
bytes; the unit when ``Work.set_unit`` names it) that its ``wait()`` marks waiting, then completed.
A collective whose issue or wait raises (gloo's timeout, a peer's closed connection) raises
``divergence.CollectiveFailure`` instead, naming where every reachable rank is (the backend's
error is its cause). On gloo the wait is watched (``flight_desync.wait``): a collective still
incomplete after the desync window makes the ranks compare their positions through the store, and
one that can never pair raises the same ``CollectiveFailure`` within seconds instead of at the
group's timeout. (Not on NCCL through torch: a wait with a timeout would block the host there;
torch's own watchdog covers it.)
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from . import divergence, flight, flight_desync
from .communicator import (Communicator, ReduceOpName, Work, all_to_all_kind, check_all_to_all_sizes,
                           check_collective_sizes, check_reduce_op)
from .flight_report import collective

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}

# torch >= 2.13 names the tensor collectives *_single; older releases *_into_tensor / *_tensor.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _failure(exc: BaseException, entry) -> divergence.CollectiveFailure:
    """The diagnosed error of a collective whose issue or wait raised ``exc`` (see the Note)."""
    what = collective(entry.as_dict()) if entry is not None else "a collective"
    return divergence.failure(exc, entry, what)


class _TorchWork(Work):
    """Wraps a torch.distributed work handle (``wait()`` syncs the current stream on CUDA) and its
    flight-recorder entry (see [Note: flight recorder])."""

    def __init__(self, work: dist.Work | None, entry=None, watched: bool = False):
        self._work = work
        self._entry = entry
        self._watched = watched  # waited through the desync window (gloo)
        self._completed_at: float | None = None

    def set_unit(self, unit: str) -> None:
        if self._entry is not None:
            self._entry.unit = unit

    def wait(self) -> None:
        if self._work is not None:
            entry = self._entry
            flight.waiting(entry)
            try:
                if self._watched:
                    flight_desync.wait(self._work, entry)
                else:
                    self._work.wait()
            except Exception as exc:  # noqa: BLE001 - a timeout, a dead peer, a desync: diagnosed
                raise _failure(exc, entry) from exc
            flight.completed(entry)
            self._work = None

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def track_completion(self) -> None:
        """Stamp the completion time from the future's done-callback (see the module Note)."""
        if self._work is None:
            return
        try:
            future = self._work.get_future()
        except RuntimeError:  # a backend without futures: the completion stays unknown
            return
        future.add_done_callback(self._stamp)

    def _stamp(self, _future) -> None:
        self._completed_at = time.perf_counter()

    def completion_time(self) -> float | None:
        return self._completed_at


class ProcessGroupCommunicator(Communicator):
    """Collectives over a torch.distributed group, asynchronous (``async_op=True``).

    Args:
        group: the process group; ``None`` means the default (world) group.

    Raises:
        RuntimeError: if torch.distributed is not initialised.
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ProcessGroupCommunicator: torch.distributed is not initialised; call "
                "torch.distributed.init_process_group() first (torchrun sets up the environment)"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        self.backend = dist.get_backend(self.group)
        self.ranks = tuple(dist.get_process_group_ranks(self.group))  # for the flight recorder
        self.channel = f"data:{getattr(self.group, 'group_name', self.ranks)}"
        self._watched = self.backend == "gloo"
        # gloo has no AVG for every collective on every release: emulate it with SUM then divide.
        self._native_avg = self.backend == "nccl"

    def _issue(self, kind: str, nbytes: int, call, *args, **kwargs):
        """(torch's work handle of ``call(*args, **kwargs)``, its flight entry); a failure to issue
        is diagnosed (see [Note: flight recorder])."""
        entry = flight.record(kind, self.ranks, nbytes, channel=self.channel)
        try:
            return call(*args, group=self.group, async_op=True, **kwargs), entry
        except Exception as exc:  # noqa: BLE001 - a dead peer, a broken group: diagnosed
            raise _failure(exc, entry) from exc

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        check_collective_sizes("all_gather_into_tensor", out, inp, self.world_size)
        return _TorchWork(*self._issue("all_gather", _nbytes(inp), all_gather_single, out, inp), self._watched)

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOpName = "sum") -> Work:
        check_reduce_op(op)
        check_collective_sizes("reduce_scatter_tensor", inp, out, self.world_size)
        if self.backend == "gloo" and op != "max":  # see the Note: gloo reduce-scatter
            received = torch.empty_like(inp)
            work, entry = self._issue("reduce_scatter", _nbytes(inp), dist.all_to_all_single, received, inp)
            return _AllToAllSum(work, received, out, self.world_size, self.world_size if op == "avg" else 1, entry,
                                self._watched)
        if self.backend == "gloo":  # max: torch's own (an all-reduce of a clone), see the Note
            buffer = inp.clone()
            work, entry = self._issue("reduce_scatter", _nbytes(inp), dist.all_reduce, buffer, op=_OPS[op])
            return _AllReduceChunk(work, buffer, out, self.rank, 1, entry, self._watched)
        if op == "avg" and not self._native_avg:
            work, entry = self._issue("reduce_scatter", _nbytes(inp), reduce_scatter_single, out, inp, op=_OPS["sum"])
            return _DivideAfter(work, out, self.world_size, entry, self._watched)
        return _TorchWork(*self._issue("reduce_scatter", _nbytes(inp), reduce_scatter_single, out, inp, op=_OPS[op]),
                          self._watched)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName = "sum") -> Work:
        check_reduce_op(op)
        if op == "avg" and not self._native_avg:
            work, entry = self._issue("all_reduce", _nbytes(tensor), dist.all_reduce, tensor, op=_OPS["sum"])
            return _DivideAfter(work, tensor, self.world_size, entry, self._watched)
        return _TorchWork(*self._issue("all_reduce", _nbytes(tensor), dist.all_reduce, tensor, op=_OPS[op]),
                          self._watched)

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        global_src = dist.get_global_rank(self.group, src) if self.group is not dist.group.WORLD else src
        return _TorchWork(*self._issue("broadcast", _nbytes(tensor), dist.broadcast, tensor, src=global_src),
                          self._watched)

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, label: str | None = None) -> Work:
        """``dist.all_to_all_single`` with equal splits (gloo or NCCL); recorded as
        ``"all_to_all (<label>)"`` with the bytes this rank sends (see the base class)."""
        check_all_to_all_sizes(out, inp, self.world_size)
        return _TorchWork(*self._issue(all_to_all_kind(label), _nbytes(inp), dist.all_to_all_single, out, inp),
                          self._watched)

    def barrier(self) -> None:
        dist.barrier(group=self.group)


class _AllReduceChunk(_TorchWork):
    """gloo's reduce-scatter: an all-reduce of a copy of the input in flight; ``wait()`` copies this
    rank's chunk of it into the output, divided by ``divisor`` (W for AVG, emulated with SUM)
    unless it is 1 (see the Note: gloo reduce-scatter). After ``wait()`` it holds no tensor: the
    handle may outlive the step (a profile records it), the gradient shard must not."""

    def __init__(self, work: dist.Work, buffer: torch.Tensor, out: torch.Tensor, rank: int, divisor: int, entry=None,
                 watched: bool = False):
        super().__init__(work, entry, watched)
        self._buffer, self._out, self._rank, self._divisor = buffer, out, rank, divisor

    def wait(self) -> None:
        if self._work is not None:
            super().wait()
            n = self._out.numel()
            self._out.copy_(self._buffer.view(-1)[self._rank * n : (self._rank + 1) * n].view_as(self._out))
            if self._divisor != 1:
                self._out.div_(self._divisor)
            self._buffer = self._out = None  # a profile may keep this handle: let the tensors go


class _AllToAllSum(_TorchWork):
    """gloo's reduce-scatter as an all-to-all in flight (see the Note: gloo reduce-scatter):
    ``wait()`` sums the W received chunks in rank order into the output, divided by ``divisor``
    (W for AVG, emulated with SUM) unless it is 1. After ``wait()`` it holds no tensor."""

    def __init__(self, work: dist.Work, received: torch.Tensor, out: torch.Tensor, world_size: int, divisor: int,
                 entry=None, watched: bool = False):
        super().__init__(work, entry, watched)
        self._received, self._out, self._world_size, self._divisor = received, out, world_size, divisor

    def wait(self) -> None:
        if self._work is not None:
            super().wait()
            chunks = self._received.view(self._world_size, -1)
            out = self._out.view(-1)
            if self._world_size == 2:  # one addition, as the all-reduce makes it
                torch.add(chunks[0], chunks[1], out=out)
            else:
                torch.sum(chunks, dim=0, out=out)
            if self._divisor != 1:
                self._out.div_(self._divisor)
            self._received = self._out = None  # a profile may keep this handle: let the tensors go


class _DivideAfter(_TorchWork):
    """A SUM collective whose ``wait()`` then divides the result by W (AVG emulation)."""

    def __init__(self, work: dist.Work, result: torch.Tensor, world_size: int, entry=None, watched: bool = False):
        super().__init__(work, entry, watched)
        self._result = result
        self._world_size = world_size

    def wait(self) -> None:
        if self._work is not None:
            super().wait()
            self._result.div_(self._world_size)
            self._result = None
