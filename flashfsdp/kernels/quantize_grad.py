"""ZeRO++ qgZ: gradients block-quantised to int4 / int8 in the layout of a hierarchical all-to-all,
and the fused dequantise-reduce(-requantise) step between its hops.

Source: Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training" (arXiv:2306.10209), §3.3 "ZeRO++ quantized gradient communication" (qgZ) and its figure
of the hierarchical all-to-all with "tensor slice reordering"; DeepSpeed implements it as
``all_to_all_quant_reduce`` (``deepspeed/runtime/comm/coalesced_collectives.py``) over the CUDA
kernels ``swizzled_quantize`` (``csrc/quantization/swizzled_quantize.cu``) and
``quantized_reduction`` / ``dequant_reduce`` (``csrc/quantization/quant_reduce.cu``). The
reduce-scatter of the gradients is replaced by: quantise (swizzled) -> all-to-all inside each node
-> dequantise, sum, requantise -> all-to-all across nodes -> dequantise and sum. Each value is
quantised twice whatever the world size (a ring would requantise at every hop), and only the
second all-to-all's chunks, 1/local_size of the first's, cross nodes.

The ops' contracts are :func:`flashfsdp.kernels.quantize_grad` and
:func:`flashfsdp.kernels.dequantize_reduce` (docstrings in :mod:`flashfsdp.kernels.dispatch`); the
chunk format, the block size and the kernels are those of :mod:`flashfsdp.kernels.quantize`
([Note: packed int8 chunks], at ``bits`` 8 or 4); the references are in
:mod:`flashfsdp.kernels.reference`.

[Note: qgZ layout]
W = N·L ranks, N nodes of L ranks, global rank ``g = m·L + l`` (node m, local rank l: the row-major
order of a (nodes, local) device mesh). Every rank packs its gradients with ``flatten`` into the
reduce-scatter input, ``src`` = W segments of S values, segment g for rank g. Let
C = ``packed_nbytes(S, block_size, bits=bits)``.

1. ``quantize_grad(src, P, nodes=N, local_size=L, bits=b)``: ``P`` is [W slots, C] bytes; segment
   g = m·L + l is quantised into slot ``l·N + m`` (:func:`slot_of`). So slots ``[l·N, (l+1)·N)``,
   the bytes ``P[l·N·C : (l+1)·N·C]``, hold the N segments destined to local rank l of every
   node, node by node (DeepSpeed's swizzle: 2 nodes x 4 ranks, segments 0..7 go to slots in the
   order 0 4 1 5 2 6 3 7).
2. All-to-all inside node m (``all_to_all_single`` over its L ranks, equal splits of N·C bytes):
   rank (m, l) receives ``R1`` = [L senders j][N nodes n][C], the chunk at (j, n) being rank
   (m, j)'s quantised segment of rank (n, l).
3. ``dequantize_reduce(R1, Q, senders=L, chunks=N, numel=S, bits=b, out_bits=b2)``: ``Q`` is
   [N chunks][C'] (C' = ``packed_nbytes(S, block_size, bits=b2)``), chunk n = the sum over j of
   chunk (j, n) of R1, dequantised and summed in fp32, quantised again: node m's partial sum of
   rank (n, l)'s segment.
4. All-to-all across nodes (over the N ranks with local rank l, equal splits of C' bytes): rank
   (m, l) receives ``R2`` = [N senders n][C'], chunk n being node n's partial sum of its segment.
   These N·C' bytes per rank, (N-1)·C' of them from other nodes, are the only ones crossing nodes.
5. ``dequantize_reduce(R2, shard, senders=N, chunks=1, numel=S, bits=b2)``: ``shard`` (S values,
   float32 / bfloat16 / float16) = the sum of all W ranks' segment g, the reduce-scatter's output.

With N = 1 (one node) step 1 is plain chunked quantisation (slot g = g), steps 3-4 are skipped and
step 5 runs on R1 with ``senders=L``; with L = 1 the same holds across nodes. Blocks restart at
every chunk, so both hops quantise the same blocks of the segment and ``S`` need not be a multiple
of ``block_size``. Error per element (B = the block of the element, each term that block's scale
as stored): ``|shard - exact| <= sum over the W ranks of scale_1/2 + sum over the N partial sums of
scale_2/2`` plus fp32 rounding of the sums (and the output cast), ``scale = max|x| / QMAX`` of
what that hop quantised; with one hop only the first sum.
"""

from __future__ import annotations

import torch

from flashfsdp.kernels.quantize import (
    BLOCK_SIZE,
    check_bits,
    check_block_size,
    check_count,
    check_disjoint,
    check_packed,
    launch_dequantize_reduce,
    launch_quantize,
    packed_nbytes,
)
from flashfsdp.kernels.validation import check_flat_buffer, check_same_device


def slot_of(rank: int, nodes: int, local_size: int) -> int:
    """The slot of global rank ``rank``'s segment in :func:`flashfsdp.kernels.quantize_grad`'s
    output: ``(rank % local_size) · nodes + rank // local_size`` (see [Note: qgZ layout])."""
    return (rank % local_size) * nodes + rank // local_size


def validate_quantize_grad(src: torch.Tensor, packed: torch.Tensor, nodes: int, local_size: int, bits: int,
                           block_size: int) -> int:
    """Check :func:`flashfsdp.kernels.quantize_grad`'s arguments; return the values per segment (S)."""
    op = "quantize_grad"
    check_bits(op, bits)
    check_block_size(op, block_size)
    world = check_count(op, "nodes", nodes) * check_count(op, "local_size", local_size)
    src = check_flat_buffer(op, "src", src)
    if src.numel() % world:
        raise ValueError(f"{op}: src has {src.numel()} elements, not a multiple of nodes * local_size = {world}")
    n = src.numel() // world
    check_packed(op, packed, world * packed_nbytes(n, block_size, bits=bits),
                 f"{world} segments of {n} values at {bits} bits")
    check_same_device(op, "packed", packed, "src", src)
    check_disjoint(op, "src", src, "packed", packed)
    return n


def validate_dequantize_reduce(packed: torch.Tensor, out: torch.Tensor, senders: int, chunks: int, numel: int,
                               bits: int, out_bits: int | None, block_size: int) -> None:
    """Check :func:`flashfsdp.kernels.dequantize_reduce`'s arguments."""
    op = "dequantize_reduce"
    check_bits(op, bits)
    check_block_size(op, block_size)
    check_count(op, "senders", senders)
    check_count(op, "chunks", chunks)
    check_count(op, "numel", numel, minimum=0)
    check_packed(op, packed, senders * chunks * packed_nbytes(numel, block_size, bits=bits),
                 f"{senders} senders x {chunks} chunks of {numel} values at {bits} bits")
    if out_bits is None:
        if isinstance(out, torch.Tensor) and out.dtype == torch.int8:
            raise TypeError(f"{op}: out is int8 but out_bits is None; pass out_bits=4 or 8 to requantise, "
                            "or a float out for the summed values")
        out = check_flat_buffer(op, "out", out)
        if out.numel() != chunks * numel:
            raise ValueError(f"{op}: out has {out.numel()} elements but chunks * numel = {chunks * numel}")
    else:
        check_bits(op, out_bits, "out_bits")
        check_packed(op, out, chunks * packed_nbytes(numel, block_size, bits=out_bits),
                     f"{chunks} chunks of {numel} values at {out_bits} bits", name="out")
    check_same_device(op, "out", out, "packed", packed)
    check_disjoint(op, "packed", packed, "out", out)


def quantize_grad_triton(src: torch.Tensor, packed: torch.Tensor, *, bits: int, nodes: int = 1,
                         local_size: int = 1, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Triton launcher of :func:`flashfsdp.kernels.quantize_grad` (same arguments, result and errors).

    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    n = validate_quantize_grad(src, packed, nodes, local_size, bits, block_size)
    launch_quantize(src, packed, n=n, chunks=nodes * local_size, nodes=nodes, local_size=local_size, bits=bits,
                    block_size=block_size)
    return packed


def dequantize_reduce_triton(packed: torch.Tensor, out: torch.Tensor, *, senders: int, numel: int, bits: int,
                             chunks: int = 1, out_bits: int | None = None,
                             block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Triton launcher of :func:`flashfsdp.kernels.dequantize_reduce` (same arguments, result and errors).

    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    validate_dequantize_reduce(packed, out, senders, chunks, numel, bits, out_bits, block_size)
    launch_dequantize_reduce(packed, out, n=numel, senders=senders, chunks=chunks, bits=bits, out_bits=out_bits,
                             block_size=block_size)
    return out
