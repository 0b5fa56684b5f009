"""The quantised all-gather of a unit (ZeRO++ qwZ): int8 payload + scales, one collective per group.

Source: Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training" (arXiv:2306.10209), §3.1: the weights are all-gathered block-wise quantised to int8 and
dequantised on arrival; the master weights, the gradients and their reduce-scatter are untouched.

With ``all_gather_dtype=torch.int8`` a group's unshard (``ShardedUnit.unshard``) is:

1. copy-in [all-gather stream]: :meth:`FlatParam.quantize_in` quantises the fp32 (any floating)
   master shard straight into this rank's chunk of an int8 buffer of W packed chunks
   (``flashfsdp.kernels.quantize``, [Note: packed int8 chunks]): one pass, no cast to
   ``param_dtype`` first;
2. one all-gather of that int8 buffer in place (values and scales travel together);
3. at ``AllGatherResult.wait()``: once the all-gather is done, one ``dequantize_int8`` pass writes
   every rank's values, cast to ``param_dtype``, into the gathered buffer (on CUDA on the
   all-gather stream, which the compute stream then waits on), copied out into the unsharded
   parameters as after a plain all-gather; the int8 buffer is freed.

Bytes on the wire per value: 1 + 4/256 (0.508x of bf16's 2, 0.254x of fp32's 4). The only extra
pass against a plain all-gather is the dequantisation (it reads 1 byte and writes ``param_dtype``
per value; the plain path's copy-in cast is replaced by the quantisation). Transient memory: the
int8 buffer, about T bytes, until the wait.

Not quantised: the backward all-gather from a post-forward (secondary) sharding
(``reshard_after_forward=<int>``, ZeRO++ hpZ) gathers the dequantised values it kept, in
``param_dtype``, within its k ranks; groups of non-floating parameters.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from flashfsdp.kernels import dequantize_int8
from flashfsdp.kernels.quantize import packed_nbytes

from .communicator import Communicator, LocalCommunicator, Work
from .flat_param import FlatParam
from .layout import ShardLayout
from .streams import DeviceStreams

ALL_GATHER_DTYPES = (torch.int8,)
_BACKENDS = {"gloo", "nccl"}  # torch.distributed backends that all-gather int8
_DEVICES = {"cpu", "cuda", "meta"}


def communicator_all_gathers_int8(comm: Communicator) -> bool:
    """Whether ``comm`` all-gathers int8 tensors: the single-rank communicator, NCCL through CuPy,
    a torch.distributed group on gloo or NCCL, or any Communicator whose ``all_gather_dtypes``
    attribute lists ``torch.int8`` (how a custom communicator declares it)."""
    if torch.int8 in getattr(comm, "all_gather_dtypes", ()):
        return True
    # by class name (subclasses too): the runtime imports neither torch.distributed nor CuPy for it
    kinds = {cls.__name__ for cls in type(comm).__mro__}
    if isinstance(comm, LocalCommunicator) or "NcclCommunicator" in kinds:
        return True
    backend = getattr(comm, "backend", None)
    if "ProcessGroupCommunicator" not in kinds or not isinstance(backend, str):
        return False
    # a mixed backend reads "cpu:gloo,cuda:nccl"
    return all(part.split(":")[-1] in _BACKENDS for part in backend.split(","))


def check_all_gather_dtype(dtype: object, comm: Communicator, device: torch.device, unit: str) -> torch.dtype | None:
    """Return ``dtype`` if the unit ``unit`` can all-gather in it over ``comm`` on ``device``.

    Raises:
        ValueError: ``dtype`` is not None or ``torch.int8``; int8 on a device other than CPU or
            CUDA; int8 over a communicator that does not all-gather int8 (see
            :func:`communicator_all_gathers_int8`). Each message names ``all_gather_dtype``.
    """
    if dtype is None:
        return None
    if dtype not in ALL_GATHER_DTYPES:
        raise ValueError(f"unit '{unit}': all_gather_dtype must be torch.int8 or None, got {dtype!r}")
    if device.type not in _DEVICES:
        raise ValueError(
            f"unit '{unit}': all_gather_dtype=torch.int8 needs CPU or CUDA tensors, the unit is on {device}; "
            f"leave all_gather_dtype=None there")
    if not communicator_all_gathers_int8(comm):
        raise ValueError(
            f"unit '{unit}': all_gather_dtype=torch.int8 but its communicator {type(comm).__name__}"
            f"{_backend_note(comm)} does not all-gather int8; use gloo or NCCL (communicator='process_group' "
            f"or 'nccl'), list torch.int8 in a custom communicator's all_gather_dtypes, or leave all_gather_dtype=None")
    return dtype


def _backend_note(comm: Communicator) -> str:
    backend = getattr(comm, "backend", None)
    return f" (backend {backend!r})" if backend is not None else ""


class QuantizedAllGather:
    """One group's int8 all-gather in flight: the buffer of W packed chunks, this rank's chunk
    quantised in (copy-in) on creation.

    Args:
        group: the FlatParam whose shard is quantised and whose unsharded buffer (allocated) is
            written by :meth:`dequantize`.
        comm: the all-gather's communicator (W chunks, this rank's at ``comm.rank``).

    Attributes:
        packed: the all-gather's output (int8, ``W · packed_nbytes(S)`` bytes).
        local: this rank's chunk of ``packed``, the all-gather's input.
    """

    def __init__(self, group: FlatParam, comm: Communicator):
        self.group = group
        self.chunks = comm.world_size
        chunk = packed_nbytes(group.layout.shard_size)
        self.packed = torch.empty(self.chunks * chunk, dtype=torch.int8, device=group.device)
        self.local = self.packed[comm.rank * chunk : (comm.rank + 1) * chunk]
        group.quantize_in(self.local)

    def dequantize(self) -> None:
        """Write every rank's values into the group's gathered buffer (``param_dtype``; the
        unsharded one where the layout is zero-copy, else copy-out follows); free the int8
        buffer. Call it once the all-gather completed."""
        dequantize_int8(self.packed, self.group.gathered, chunks=self.chunks)
        self.packed = self.local = None


def group_all_gather_nbytes(layout: ShardLayout, param_itemsize: int, quantized: bool) -> int:
    """Bytes one all-gather of a group with ``layout`` writes over its W ranks: W packed int8
    chunks (``packed_nbytes(S)`` each: values and a scale per block) when ``quantized``, else the
    W·S-element gathered buffer at ``param_itemsize`` bytes per element. The one formula the
    runtime's counters and ``flashfsdp.estimate`` both use."""
    if quantized:
        return layout.world_size * packed_nbytes(layout.shard_size)
    return layout.gathered_size * param_itemsize


def all_gather_nbytes(groups: Sequence[FlatParam], all_gather_dtype: torch.dtype | None) -> int:
    """Bytes one unshard of a unit's ``groups`` all-gathers over the ranks they are sharded over
    (the collectives' outputs; :func:`group_all_gather_nbytes` per group, the floating groups
    quantised when ``all_gather_dtype`` is set)."""
    return sum(group_all_gather_nbytes(g.layout, g.param_dtype.itemsize,
                                       all_gather_dtype is not None and g.param_dtype.is_floating_point)
               for g in groups)


def finish_quantized(gathers: Sequence[QuantizedAllGather], works: Sequence[Work],
                     streams: DeviceStreams | None) -> "torch.cuda.Event | None":
    """Wait for the int8 all-gathers and dequantise them; on CUDA both on the all-gather stream,
    returning the event recorded after them there (the compute stream waits on it), else None.

    The int8 buffers were allocated on the all-gather stream and are freed after a dequantisation
    enqueued on it, so their reuse is stream-ordered (see [Note: memory safety without
    record_stream] in ``streams.py``).
    """
    stream = streams.all_gather if streams is not None else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(), torch.no_grad():
        for work in works:
            work.wait()
        for gather in gathers:
            gather.dequantize()
        return streams.record(stream) if stream is not None else None
