"""ProcessGroupCommunicator: the Communicator over any torch.distributed process group.

Gloo on CPU (the multi-rank tests), or NCCL through torch on CUDA (the baseline that
``NcclCommunicator`` must match or beat). Every collective is issued with ``async_op=True``, so on
CPU gloo runs it on its own thread while the caller computes: overlap is real there too.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .communicator import Communicator, ReduceOpName, Work, check_collective_sizes, check_reduce_op

_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX}

# torch >= 2.13 names the tensor collectives *_single; older releases *_into_tensor / *_tensor.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _TorchWork(Work):
    """Wraps a torch.distributed work handle (``wait()`` syncs the current stream on CUDA)."""

    def __init__(self, work: dist.Work | None):
        self._work = work

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()


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
        # gloo has no AVG for every collective on every release: emulate it with SUM then divide.
        self._native_avg = self.backend == "nccl"

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        check_collective_sizes("all_gather_into_tensor", out, inp, self.world_size)
        return _TorchWork(all_gather_single(out, inp, group=self.group, async_op=True))

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOpName = "sum") -> Work:
        check_reduce_op(op)
        check_collective_sizes("reduce_scatter_tensor", inp, out, self.world_size)
        if op == "avg" and not self._native_avg:
            return _DivideAfter(reduce_scatter_single(out, inp, op=_OPS["sum"], group=self.group, async_op=True), out, self.world_size)
        return _TorchWork(reduce_scatter_single(out, inp, op=_OPS[op], group=self.group, async_op=True))

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName = "sum") -> Work:
        check_reduce_op(op)
        if op == "avg" and not self._native_avg:
            return _DivideAfter(dist.all_reduce(tensor, op=_OPS["sum"], group=self.group, async_op=True), tensor, self.world_size)
        return _TorchWork(dist.all_reduce(tensor, op=_OPS[op], group=self.group, async_op=True))

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        global_src = dist.get_global_rank(self.group, src) if self.group is not dist.group.WORLD else src
        return _TorchWork(dist.broadcast(tensor, src=global_src, group=self.group, async_op=True))

    def barrier(self) -> None:
        dist.barrier(group=self.group)


class _DivideAfter(_TorchWork):
    """A SUM collective whose ``wait()`` then divides the result by W (AVG emulation)."""

    def __init__(self, work: dist.Work, result: torch.Tensor, world_size: int):
        super().__init__(work)
        self._result = result
        self._world_size = world_size

    def wait(self) -> None:
        if self._work is not None:
            super().wait()
            self._result.div_(self._world_size)
