"""NcclCommunicator: NCCL through CuPy, enqueued on the caller's current CUDA stream.

The runtime issues copy-in + all-gather under its dedicated all-gather stream and packing +
reduce-scatter under its reduce-scatter stream (``flashfsdp.runtime.streams``); this communicator
enqueues each NCCL call on whatever torch stream is current, by raw handle, and returns a Work
that holds a CUDA event recorded after the call. ``Work.wait()`` makes the *waiting* stream wait on
that event (no CPU synchronisation) and keeps the tensors referenced until then, so that no
``record_stream`` is needed. Memory comes from PyTorch's caching allocator (the tensors are
torch tensors).

The NCCL unique id travels through the torch.distributed store that ``init_process_group`` (and so
torchrun) already set up: no second rendezvous. Its store key is the group's ranks plus a
per-process counter of communicators created so far, so every rank of a group must create its
NcclCommunicators in the same order (as it does when every rank makes the same ``fully_shard``
calls in the same order); a rank that creates one more or one fewer waits on a key the others
never set.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from .communicator import Communicator, ReduceOpName, Work, check_collective_sizes, check_reduce_op

# ncclDataType_t and ncclRedOp_t values from nccl.h (stable across NCCL 2.x).
_NCCL_DTYPES = {
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
    torch.int32: 2,
    torch.int64: 4,
    torch.uint8: 1,
    torch.int8: 0,
}
_NCCL_OPS = {"sum": 0, "max": 2, "avg": 4}
_id_counter = itertools.count()


def _import_nccl():
    try:
        from cupy.cuda import nccl  # noqa: PLC0415
    except Exception as exc:  # ImportError, or CuPy failing to find a CUDA driver
        raise RuntimeError(
            "NcclCommunicator needs CuPy built with NCCL: install flashfsdp with the extra that "
            "matches your CUDA (pip install 'flashfsdp[cuda12]' or 'flashfsdp[cuda13]'); "
            f"importing cupy.cuda.nccl failed with: {exc}"
        ) from exc
    if not getattr(nccl, "available", True):
        raise RuntimeError("NcclCommunicator: CuPy was built without NCCL; install nvidia-nccl-cu12/cu13")
    return nccl


class _NcclWork(Work):
    def __init__(self, event: torch.cuda.Event, keepalive: tuple[torch.Tensor, ...]):
        self._event = event
        self._keepalive = keepalive

    def wait(self) -> None:
        torch.cuda.current_stream().wait_event(self._event)
        self._keepalive = ()

    def is_completed(self) -> bool:
        return self._event.query()


class NcclCommunicator(Communicator):
    """Collectives through ``cupy.cuda.nccl.NcclCommunicator`` over a torch.distributed group.

    Every rank of ``group`` must construct its NcclCommunicators in the same order (the unique
    id's store key counts them per process; see the module docstring).

    Args:
        group: the process group whose ranks form the NCCL communicator (default: world). Only its
            store is used, to pass the NCCL unique id.
        device: the CUDA device of this rank (default: ``torch.cuda.current_device()``).

    Raises:
        RuntimeError: without CUDA (``torch.cuda.is_available()`` false), without CuPy/NCCL, or if
            torch.distributed is not initialised; each message says what to do instead.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | int | None = None):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "NcclCommunicator needs a CUDA device, but torch.cuda.is_available() is False on this "
                "machine; on CPU use communicator='process_group' (gloo), which 'auto' picks for CPU modules"
            )
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "NcclCommunicator: torch.distributed is not initialised; call "
                "torch.distributed.init_process_group() first (its store carries the NCCL unique id)"
            )
        nccl = _import_nccl()
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.world_size = dist.get_world_size(self.group)
        if device is None:
            device = torch.cuda.current_device()
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        store = dist.distributed_c10d._get_default_store()
        ranks = dist.get_process_group_ranks(self.group)
        key = f"flashfsdp/nccl_uid/{'_'.join(map(str, ranks[:8]))}_{len(ranks)}/{next(_id_counter)}"
        if self.rank == 0:
            uid = nccl.get_unique_id()
            store.set(key, bytes(bytearray(b & 0xFF for b in uid)))
        raw = store.get(key)
        uid = tuple(b if b < 128 else b - 256 for b in raw)
        import cupy  # noqa: PLC0415

        with cupy.cuda.Device(self.device.index):
            self._comm = nccl.NcclCommunicator(self.world_size, uid, self.rank)

    def _enqueue(self, call, *tensors: torch.Tensor) -> Work:
        for t in tensors:
            if t.device != self.device:
                raise ValueError(f"NcclCommunicator: tensor on {t.device}, communicator on {self.device}")
        stream = torch.cuda.current_stream(self.device)
        call(stream.cuda_stream)
        event = torch.cuda.Event()
        event.record(stream)
        return _NcclWork(event, tensors)

    @staticmethod
    def _dtype(t: torch.Tensor) -> int:
        try:
            return _NCCL_DTYPES[t.dtype]
        except KeyError:
            raise TypeError(f"NcclCommunicator: dtype {t.dtype} has no NCCL counterpart") from None

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        check_collective_sizes("all_gather_into_tensor", out, inp, self.world_size)
        return self._enqueue(
            lambda s: self._comm.allGather(inp.data_ptr(), out.data_ptr(), inp.numel(), self._dtype(inp), s),
            out, inp,
        )

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOpName = "sum") -> Work:
        check_reduce_op(op)
        check_collective_sizes("reduce_scatter_tensor", inp, out, self.world_size)
        return self._enqueue(
            lambda s: self._comm.reduceScatter(inp.data_ptr(), out.data_ptr(), out.numel(), self._dtype(out), _NCCL_OPS[op], s),
            out, inp,
        )

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName = "sum") -> Work:
        check_reduce_op(op)
        return self._enqueue(
            lambda s: self._comm.allReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), self._dtype(tensor), _NCCL_OPS[op], s),
            tensor,
        )

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        return self._enqueue(
            lambda s: self._comm.broadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), self._dtype(tensor), src, s),
            tensor,
        )

    def barrier(self) -> None:
        flag = torch.zeros(1, device=self.device)
        self.all_reduce(flag).wait()
        torch.cuda.current_stream(self.device).synchronize()
