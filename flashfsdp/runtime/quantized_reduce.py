"""ZeRO++ qgZ: a unit's gradient reduce-scatter as a quantised hierarchical all-to-all.

Source: Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training" (arXiv:2306.10209), §3.3 (qgZ); DeepSpeed's ``all_to_all_quant_reduce``. The kernels and
their layout are :mod:`flashfsdp.kernels.quantize_grad` ([Note: qgZ layout]); this module runs
them between the communicators.

With ``MixedPrecisionPolicy(reduce_quantization=QuantizedReduce(bits, local_size))`` a unit's
reduction (``reduce.py``: the packed input, W segments of R = S + F elements in ``reduce_dtype``,
S the shard and F the flags and padding) is, instead of one reduce-scatter, on the W = N·L ranks
(N "nodes" of L = ``local_size`` consecutive ranks; ``comm_factory.node_communicators``):

1. the flags reduce-scattered exactly (see [Note: exact flags]), issued first;
2. ``quantize_grad`` of the W segments (their flags zeroed) into [W slots][C] bytes, slot order
   l·N + m;
3. all-to-all inside the node (flight recorder ``"all_to_all (qgZ intra)"``, N·C bytes to each
   local rank), then ``dequantize_reduce(senders=L, chunks=N, out_bits=bits)``: the node's partial
   sums requantised;
4. all-to-all across the nodes (``"all_to_all (qgZ inter)"``, C bytes to each node: the only
   bytes that cross nodes), then ``dequantize_reduce(senders=N)`` into the output's first S
   elements, in ``reduce_dtype``: the reduce-scatter's result, which the reduction then
   accumulates as ever. With N = 1 or L = 1 there is one hop (the first or the second) over all
   W ranks, dequantised at once.

The first hop is issued with the reduction; the rest runs when the reduction is waited for
(``QuantizedWork.wait``), on the reduce-scatter stream. Error per element: the kernels' bound
(the half block scales of the W quantised segments plus those of the N requantised partial sums).

[Note: exact flags]
The F elements after the shard hold one flag per parameter (it got a gradient on a rank; their
sums say which gradients are None on every rank) and zero padding. Quantised next to gradients of
larger magnitude a flag could round to 0, so they do not go through the quantiser: they are cut
out of the packed input (F·W elements, W·4·F bytes in fp32: a handful of bytes per parameter) and
reduce-scattered unquantised over the whole group (flight recorder ``"reduce_scatter (qgZ
flags)"`` — an ordinary reduce-scatter entry), into the output's last F elements, and zeroed in
the packed input before it is quantised. Their sums are exact (small integers).

[Note: what qgZ refuses]
``fully_shard`` refuses ``reduce_quantization`` (ValueError naming the unit): under HSDP (a
replicate dimension: its all-reduce of the reduced shard would stay unquantised, so the bytes
across replicas would not shrink; flashfsdp refuses rather than quantise half the reduction —
shard over the whole mesh, whose outer dimension then plays the nodes), where ``local_size``
does not divide the unit's W, and with a communicator that has no ``all_to_all_single``. An
opted-in unit reduces alone, never in a bucket (``bucket.reduce_class``), and its reduction does
not use a separate reduce-scatter group (``set_separate_reduce_scatter_group``): its hops run on
the node groups. The estimator and the simulator do not model qgZ yet.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from flashfsdp.kernels import dequantize_reduce, quantize_grad
from flashfsdp.kernels.quantize import packed_nbytes

from .communicator import Communicator, Work

QGZ_BITS = (4, 8)


@dataclass(frozen=True)
class QuantizedReduce:
    """ZeRO++ qgZ for a unit's gradient reduction (``MixedPrecisionPolicy.reduce_quantization``).

    Attributes:
        bits: 4 (ZeRO++'s choice) or 8: the width of the quantised gradients on both hops.
        local_size: L, the ranks per "node": the unit's W ranks are W / L nodes of L consecutive
            ranks (the groups of ``reshard_after_forward=L``); must divide W (``fully_shard``
            checks).
        block_size: values per fp32 scale, a power of two in [32, 4096] (default 256).

    Raises:
        TypeError: a field that is not an int.
        ValueError: ``bits`` not 4 or 8, ``local_size`` < 1, a bad ``block_size``.
    """

    bits: int = 4
    local_size: int = 1
    block_size: int = 256

    def __post_init__(self) -> None:
        for name in ("bits", "local_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise TypeError(f"QuantizedReduce.{name} must be an int, got {value!r}")
        if self.bits not in QGZ_BITS:
            raise ValueError(f"QuantizedReduce.bits must be 4 or 8, got {self.bits}")
        if self.local_size < 1:
            raise ValueError(f"QuantizedReduce.local_size must be >= 1 (ranks per node), got {self.local_size}")
        if not 32 <= self.block_size <= 4096 or self.block_size & (self.block_size - 1):
            raise ValueError(f"QuantizedReduce.block_size must be a power of two in [32, 4096], got {self.block_size}")


def check_reduce_quantization(value: object, comm: Communicator, replicate_comm: Communicator | None,
                              unit: str) -> QuantizedReduce | None:
    """``value`` if a unit over ``comm`` can reduce with it (see [Note: what qgZ refuses]).

    Raises:
        TypeError: ``value`` neither None nor a :class:`QuantizedReduce`.
        ValueError: HSDP (``replicate_comm``), ``local_size`` not dividing W, or a communicator
            without an all-to-all; each message names the unit and ``reduce_quantization``.
    """
    if value is None:
        return None
    if not isinstance(value, QuantizedReduce):
        raise TypeError(f"unit '{unit}': reduce_quantization must be a QuantizedReduce or None, got {value!r}")
    if replicate_comm is not None:
        raise ValueError(
            f"unit '{unit}': reduce_quantization (ZeRO++ qgZ) is refused under HSDP: the all-reduce across the "
            f"{replicate_comm.world_size} replicas would stay unquantised; shard over the whole mesh (its outer "
            f"dimension then plays the nodes, QuantizedReduce(local_size=<inner size>)) or drop reduce_quantization")
    if comm.world_size % value.local_size:
        raise ValueError(
            f"unit '{unit}': reduce_quantization=QuantizedReduce(local_size={value.local_size}) must divide the "
            f"unit's world size {comm.world_size} (ranks per node)")
    if type(comm).all_to_all_single is Communicator.all_to_all_single:
        raise ValueError(f"unit '{unit}': reduce_quantization needs a communicator with all_to_all_single; "
                         f"{type(comm).__name__} has none")
    return value


class QuantizedReducer:
    """A unit's qgZ reduction: its :class:`QuantizedReduce` and the communicators it runs on.

    Args:
        config: the settings.
        comm: the unit's communicator (W ranks; the flags' reduce-scatter runs on it).
        intra, inter: ``comm_factory.node_communicators(comm, config.local_size, ...)``.
    """

    def __init__(self, config: QuantizedReduce, comm: Communicator, intra: Communicator, inter: Communicator):
        self.config, self.comm, self.intra, self.inter = config, comm, intra, inter
        self.world_size = comm.world_size
        self.local_size = config.local_size
        self.nodes = comm.world_size // config.local_size

    def reduce_scatter(self, out: torch.Tensor, packed: torch.Tensor, shard_numel: int) -> "QuantizedWork":
        """Issue the reduction of ``packed`` (W segments of R = ``out.numel()`` elements, floating)
        into ``out`` (R elements, ``packed``'s dtype): ``out[:S]`` the dequantised sum of the
        segments' first S = ``shard_numel`` elements, ``out[S:]`` the exact sum of the rest (see
        the module docstring). ``packed``'s tails are zeroed. ``wait()`` the returned Work before
        reading ``out``.

        Raises:
            ValueError: sizes that do not match (``packed`` not W·R elements, S > R).
        """
        W, R, S = self.world_size, out.numel(), shard_numel
        if packed.numel() != W * R or not 0 <= S <= R or packed.dtype != out.dtype:
            raise ValueError(f"qgZ reduce_scatter: packed of {packed.numel()} {packed.dtype} elements, output of {R} "
                             f"{out.dtype}, shard of {S}: need W·R = {W * R} elements of one dtype and S <= R")
        segments = packed.view(W, R)
        flags_work, tails = None, None
        if S < R:  # [Note: exact flags]
            tails = torch.empty((W, R - S), dtype=packed.dtype, device=packed.device)
            tails.copy_(segments[:, S:])
            tails = tails.view(-1)
            segments[:, S:].zero_()
            flags_work = self.comm.reduce_scatter_tensor(out[S:], tails, op="sum")
        bits, N, L = self.config.bits, self.nodes, self.local_size
        quantized = torch.empty(W * packed_nbytes(R, self.config.block_size, bits=bits), dtype=torch.int8,
                                device=packed.device)
        quantize_grad(packed, quantized, bits=bits, nodes=N, local_size=L, block_size=self.config.block_size)
        two_hops = N > 1 and L > 1
        first, label = (self.inter, "qgZ inter") if N > 1 and L == 1 else (self.intra, "qgZ intra")
        received = torch.empty_like(quantized)
        work = first.all_to_all_single(received, quantized, label=label)
        return QuantizedWork(self, work, flags_work, received, out, S, R, two_hops, keep=(quantized, tails))


class QuantizedWork(Work):
    """The qgZ reduction in flight: the first hop (and the flags' reduce-scatter) issued;
    ``wait()`` (on the reduce-scatter stream) finishes the first hop, reduces, runs the second hop
    and writes the output. After ``wait()`` it holds no tensor."""

    def __init__(self, reducer: QuantizedReducer, work: Work, flags_work: Work | None, received: torch.Tensor,
                 out: torch.Tensor, shard_numel: int, segment: int, two_hops: bool, keep: tuple):
        self._reducer, self._work, self._flags = reducer, work, flags_work
        self._received, self._out, self._keep = received, out, keep
        self._shard_numel, self._segment, self._two_hops = shard_numel, segment, two_hops
        self._unit: str | None = None
        self._completed_at: float | None = None

    def set_unit(self, unit: str) -> None:
        self._unit = unit
        for work in (self._work, self._flags):
            if work is not None:
                work.set_unit(unit)

    def is_completed(self) -> bool:
        return self._out is None

    def completion_time(self) -> float | None:
        return self._completed_at

    def wait(self) -> None:
        if self._out is None:
            return
        reducer, cfg = self._reducer, self._reducer.config
        S, R, out = self._shard_numel, self._segment, self._out
        if self._flags is not None:
            self._flags.wait()
        self._work.wait()
        received, senders = self._received, reducer.world_size
        if self._two_hops:
            N, L = reducer.nodes, reducer.local_size
            partial = torch.empty(N * packed_nbytes(R, cfg.block_size, bits=cfg.bits), dtype=torch.int8,
                                  device=out.device)
            dequantize_reduce(received, partial, senders=L, chunks=N, numel=R, bits=cfg.bits, out_bits=cfg.bits,
                              block_size=cfg.block_size)
            received = torch.empty_like(partial)
            second = reducer.inter.all_to_all_single(received, partial, label="qgZ inter")
            if self._unit is not None:
                second.set_unit(self._unit)
            second.wait()
            senders = N
        total = torch.empty(R, dtype=out.dtype, device=out.device)
        dequantize_reduce(received, total, senders=senders, chunks=1, numel=R, bits=cfg.bits,
                          block_size=cfg.block_size)
        out[:S].copy_(total[:S])
        self._received = self._out = self._keep = self._work = self._flags = None
        self._completed_at = time.perf_counter()
