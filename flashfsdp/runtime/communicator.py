"""The Communicator interface, its Work handles, and the single-rank communicator.

A communicator runs the five collectives the runtime needs, and the all-to-all of ZeRO++ qgZ's
quantised gradient reduction (``quantized_reduce.py``). Each returns a :class:`Work`; its
``wait()`` makes the caller's current CUDA stream wait for the collective (GPU) or blocks until it
finished (CPU). On CPU a Work can also say *when* it finished (:meth:`Work.track_completion`,
:meth:`Work.completion_time`), which the traces use to time collectives that overlap compute.
Implementations: :class:`LocalCommunicator` (W = 1, no process group),
``ProcessGroupCommunicator`` (any torch.distributed group) and ``NcclCommunicator`` (NCCL through
CuPy on dedicated CUDA streams).
"""

from __future__ import annotations

import abc
import time
from typing import Literal

import torch

ReduceOpName = Literal["sum", "avg", "max"]
REDUCE_OPS = ("sum", "avg", "max")


class Work(abc.ABC):
    """Handle of an issued collective."""

    @abc.abstractmethod
    def wait(self) -> None:
        """Make the current stream wait for the collective (GPU), or block until it is done (CPU)."""

    def is_completed(self) -> bool:
        """Whether the collective has finished (non-blocking; traces use it to bound CPU work)."""
        return True

    def set_unit(self, unit: str) -> None:
        """Name the unit this collective serves, for errors about it (an NCCL timeout names the
        collective and the unit); the default ignores it."""

    def track_completion(self) -> None:
        """Start recording when the collective completes, for :meth:`completion_time` (CPU).

        Call it right after issuing, before ``wait()``. The default does nothing (a Work that
        cannot report its completion; traces then bound it, see ``flashfsdp.runtime.trace``).
        """

    def completion_time(self) -> float | None:
        """When the collective completed, in ``time.perf_counter()`` seconds; None if unknown
        (not tracked, not completed yet, or a Work without a completion signal)."""
        return None


class CompletedWork(Work):
    """A Work for a collective that finished when it was issued: its completion time is the
    moment it was created (right after the collective's synchronous copy, if any)."""

    def __init__(self) -> None:
        self._completed_at = time.perf_counter()

    def wait(self) -> None:
        return None

    def completion_time(self) -> float | None:
        return self._completed_at


class Communicator(abc.ABC):
    """Collectives over a fixed group of ``world_size`` ranks; this process is ``rank``.

    All tensors are contiguous and on the communicator's device. Element counts: for
    ``all_gather_into_tensor`` and ``reduce_scatter_tensor``, ``out.numel() == W * inp.numel()``
    and ``inp.numel() == W * out.numel()`` respectively; ``inp`` may alias its own slice of ``out``
    (in-place all-gather).
    """

    rank: int
    world_size: int

    @abc.abstractmethod
    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        """``out[r·n:(r+1)·n] = inp`` of rank r, for every r (n = inp.numel())."""

    @abc.abstractmethod
    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOpName = "sum") -> Work:
        """``out = op over ranks of inp[rank·n:(rank+1)·n]`` (n = out.numel())."""

    @abc.abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName = "sum") -> Work:
        """``tensor = op over ranks of tensor``, in place."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        """``tensor = tensor of rank src``, in place."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Block until every rank reached the barrier."""

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, label: str | None = None) -> Work:
        """Equal-split all-to-all: ``out[j·n:(j+1)·n]`` = ``inp[rank·n:(rank+1)·n]`` of rank j, for
        every j (n = inp.numel() / W; ``out`` and ``inp`` of one dtype and size, contiguous, not
        overlapping). ``label`` names the hop in the flight recorder (kind ``"all_to_all (<label>)"``).
        The communicators here implement it (ZeRO++ qgZ's hops, ``quantized_reduce.py``); a custom
        communicator without it cannot serve ``MixedPrecisionPolicy.reduce_quantization``.

        Raises:
            NotImplementedError: this communicator has no all-to-all.
        """
        raise NotImplementedError(
            f"{type(self).__name__} has no all_to_all_single; implement it to use "
            f"MixedPrecisionPolicy.reduce_quantization (ZeRO++ qgZ) with this communicator")


def check_reduce_op(op: str) -> None:
    """Raise ValueError unless ``op`` is one of ``"sum"``, ``"avg"``, ``"max"``."""
    if op not in REDUCE_OPS:
        raise ValueError(f"reduce op must be one of {REDUCE_OPS}, got {op!r}")


def check_collective_sizes(name: str, big: torch.Tensor, small: torch.Tensor, world_size: int) -> None:
    """Raise ValueError unless ``big.numel() == world_size * small.numel()`` and both are contiguous."""
    if not (big.is_contiguous() and small.is_contiguous()):
        raise ValueError(f"{name}: tensors must be contiguous")
    if big.numel() != world_size * small.numel():
        raise ValueError(
            f"{name}: the large tensor has {big.numel()} elements but world_size * "
            f"{small.numel()} = {world_size * small.numel()} are needed"
        )
    if big.dtype != small.dtype:
        raise TypeError(f"{name}: dtypes differ ({big.dtype} vs {small.dtype})")


def check_all_to_all_sizes(out: torch.Tensor, inp: torch.Tensor, world_size: int) -> None:
    """Raise ValueError / TypeError unless ``out`` and ``inp`` are contiguous, of one dtype and
    size, that size a multiple of ``world_size``, and do not share memory (an all-to-all's
    equal splits)."""
    if not (out.is_contiguous() and inp.is_contiguous()):
        raise ValueError("all_to_all_single: tensors must be contiguous")
    if out.dtype != inp.dtype:
        raise TypeError(f"all_to_all_single: dtypes differ ({out.dtype} vs {inp.dtype})")
    if out.numel() != inp.numel() or inp.numel() % world_size:
        raise ValueError(f"all_to_all_single: input of {inp.numel()} and output of {out.numel()} elements; both "
                         f"must have the same size, a multiple of the world size {world_size}")
    if out.numel() and out.untyped_storage().data_ptr() == inp.untyped_storage().data_ptr():
        lo, hi = out.data_ptr(), out.data_ptr() + out.numel() * out.element_size()
        if lo < inp.data_ptr() + inp.numel() * inp.element_size() and inp.data_ptr() < hi:
            raise ValueError("all_to_all_single: input and output overlap")


def all_to_all_kind(label: str | None) -> str:
    """The flight recorder's kind of an all-to-all: ``"all_to_all"`` or ``"all_to_all (<label>)"``."""
    return "all_to_all" if not label else f"all_to_all ({label})"


class LocalCommunicator(Communicator):
    """The collectives of a group of one rank (W = 1): copies, no process group needed.

    Used when ``torch.distributed`` is not initialised, so that a fully_shard'ed model trains in a
    plain single process.
    """

    rank = 0
    world_size = 1

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        check_collective_sizes("all_gather_into_tensor", out, inp, 1)
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return CompletedWork()

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOpName = "sum") -> Work:
        check_reduce_op(op)
        check_collective_sizes("reduce_scatter_tensor", inp, out, 1)
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return CompletedWork()

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName = "sum") -> Work:
        check_reduce_op(op)
        return CompletedWork()

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        if src != 0:
            raise ValueError(f"broadcast: src must be 0 in a group of one rank, got {src}")
        return CompletedWork()

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, label: str | None = None) -> Work:
        check_all_to_all_sizes(out, inp, 1)
        out.copy_(inp)
        return CompletedWork()

    def barrier(self) -> None:
        return None
