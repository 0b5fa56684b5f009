"""Plain-torch implementations of every kernel op: the specification, and the CPU path.

Each function here is the meaning of the op of the same name in :mod:`flashfsdp.kernels`; the
Triton launchers must agree with it bit for bit (up to the documented exceptions in the tests).
They check their arguments with :mod:`flashfsdp.kernels.validation`, so both paths raise the same
errors. They run on any device torch supports, with torch ops per tensor (``copy_``, batched as
``torch._foreach_copy_`` where the cast is the whole job).

Arithmetic contract shared by all ops: values are converted to fp32, multiplied by ``scale`` in
fp32 (``x.float() * scale``), added in fp32 where the op accumulates, and rounded once to the
destination dtype with round-to-nearest-even (``Tensor.to`` / ``Tensor.copy_``). Where a float64
tensor takes part, the same happens in float64 (only this path serves float64).
"""

from __future__ import annotations

from typing import Sequence

import torch

from flashfsdp._torch_private import foreach_add_, foreach_copy_, foreach_mul, foreach_norm, foreach_zero_
from flashfsdp.kernels.quantize import (
    BLOCK_SIZE,
    QMAX_BY_BITS,
    packed_nbytes,
    payload_nbytes,
    scales_offset,
    validate_dequantize,
    validate_quantize,
)
from flashfsdp.kernels.quantize_grad import slot_of, validate_dequantize_reduce, validate_quantize_grad
from flashfsdp.kernels.validation import (
    validate_accumulate_grad_shard,
    validate_flatten,
    validate_unflatten,
)


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """fp32, or float64 when any of ``dtypes`` is float64."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _scaled_fp32(x: torch.Tensor, scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x.to(dtype) * scale`` as a 1-D tensor (never aliasing ``x`` when it is scaled)."""
    x = x.reshape(-1).to(dtype)
    return x if scale == 1.0 else x * scale


@torch.no_grad()
def flatten(
    tensors: Sequence[torch.Tensor | None],
    offsets: Sequence[int],
    out: torch.Tensor,
    *,
    scale: float = 1.0,
    numels: Sequence[int] | None = None,
) -> torch.Tensor:
    """Reference of :func:`flashfsdp.kernels.flatten`: ``out[o_i : o_i + n_i] = cast(t_i * scale)``.

    Every element of ``out`` that no tensor covers (gaps, ``None`` entries) is set to 0.
    Returns ``out``.
    """
    offsets, items, scale = validate_flatten(tensors, offsets, out, scale, numels)
    # The ranges are disjoint (validated): sorted, with the gaps between them, they cut ``out``
    # into consecutive parts, whose views one split makes (a Python slice per tensor costs more
    # than the copy of a small one); the gaps are zeroed, the ranges filled, each by one call.
    entries = sorted((o, n, i) for i, (t, o, n) in enumerate(zip(tensors, offsets, items.sizes))
                     if t is not None and n > 0)
    sizes, filled, end = [], [], 0
    for o, n, i in entries:
        if o > end:
            sizes.append(o - end)
            filled.append(None)
        sizes.append(n)
        filled.append(i)
        end = o + n
    if out.numel() > end:
        sizes.append(out.numel() - end)
        filled.append(None)
    parts = out.split_with_sizes(sizes) if sizes else ()
    gaps = [part for part, i in zip(parts, filled) if i is None]
    if gaps:
        foreach_zero_(gaps)
    views = [part for part, i in zip(parts, filled) if i is not None]
    sources = [tensors[i] for _, _, i in entries]
    if entries and scale == 1.0:
        # x.float().to(out.dtype) == x.to(out.dtype) for these dtypes: copy_ casts (RNE) in one pass,
        # and the foreach form saves a Python round trip per tensor.
        foreach_copy_(views, [t if t.dim() == 1 else t.reshape(-1) for t in sources])
    else:
        for view, tensor in zip(views, sources):
            view.copy_(_scaled_fp32(tensor, scale, _compute_dtype(tensor.dtype, out.dtype)))
    return out


@torch.no_grad()
def unflatten(flat: torch.Tensor, offsets: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
    """Reference of :func:`flashfsdp.kernels.unflatten`: ``outs[i][...] = cast(flat[o_i : o_i + n_i])``."""
    offsets, items = validate_unflatten(flat, offsets, outs)
    pairs = [(out, flat[offset : offset + size].view(out.shape))
             for out, offset, size in zip(outs, offsets, items.sizes) if size > 0]
    if pairs:
        foreach_copy_([out for out, _ in pairs], [source for _, source in pairs])


@torch.no_grad()
def accumulate_grad_shard(
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    scale: float = 1.0,
    accumulate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of :func:`flashfsdp.kernels.accumulate_grad_shard`.

    ``dst = cast(dst.float() + src.float() * scale)`` (or without the ``dst`` term when
    ``accumulate`` is false). Returns ``(sum(dst**2) as 0-dim fp32, any(~isfinite(dst)) as 0-dim
    bool)``, both measured on the stored values. This is the CPU production path, so it makes as
    few passes as it can: an fp32 ``dst`` is updated in place; the squared norm is one fp32
    cascade sum (torch's CPU reduction; relative error ~1e-9 at millions of elements, where a
    dot product or ``vector_norm`` drifts by ~1e-4); the inf/nan scan runs only when that norm
    is not finite (a finite sum of squares has no inf/nan term) on CPU; on another device the scan
    always runs, so that no host synchronisation is needed. Runs under ``torch.no_grad()``, as the
    Triton path does: the ops write buffers outside autograd.
    """
    scale = validate_accumulate_grad_shard(src, dst, scale)
    compute = _compute_dtype(src.dtype, dst.dtype)
    update = _scaled_fp32(src, scale, compute)
    if dst.dtype == compute and dst.is_contiguous():
        stored = dst.view(-1)
        if accumulate:
            stored.add_(update)
        else:
            stored.copy_(update)
    else:
        if accumulate:
            update = dst.reshape(-1).to(compute) + update
        dst.copy_(update.view(dst.shape))
        stored = dst.reshape(-1).to(compute)
    norm_sq = stored.square().sum()
    if dst.device.type == "cpu" and torch.isfinite(norm_sq):  # free on CPU; a host sync elsewhere
        nonfinite = torch.zeros((), dtype=torch.bool, device=dst.device)
    else:
        nonfinite = ~torch.isfinite(stored).all()
    return norm_sq, nonfinite


@torch.no_grad()
def accumulate_grad_shards(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    *,
    scale: float = 1.0,
    accumulate: bool = True,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Reference of :func:`flashfsdp.kernels.accumulate_grad_shards`: :func:`accumulate_grad_shard`
    of every pair, the same values in ``dsts``. Where every pair is fp32 and contiguous (the CPU
    production path of a bucket of small units) the update is one multi-tensor op per step — the
    same element-wise operations, so the same bits — and the squared norms come from one
    ``torch._foreach_norm`` (squared: relative error ~1e-6, as the single op's); the inf/nan scan
    runs only for a shard whose norm is not finite."""
    if len(srcs) != len(dsts):
        raise ValueError(f"accumulate_grad_shards: {len(srcs)} srcs but {len(dsts)} dsts")
    checked = [validate_accumulate_grad_shard(s, d, scale) for s, d in zip(srcs, dsts)]
    scale = checked[0] if checked else scale
    fast = all(s.dtype == torch.float32 and d.dtype == torch.float32 and d.is_contiguous() and s.device == d.device
               for s, d in zip(srcs, dsts))
    if not fast or not dsts:
        return [accumulate_grad_shard(s, d, scale=scale, accumulate=accumulate) for s, d in zip(srcs, dsts)]
    stored = [d.view(-1) for d in dsts]
    updates = [s.reshape(-1) for s in srcs]
    if scale != 1.0:
        updates = foreach_mul(updates, scale)
    if accumulate:
        foreach_add_(stored, updates)
    else:
        foreach_copy_(stored, updates)
    norms = foreach_norm(stored)
    squares = foreach_mul(norms, norms)
    finite = torch.isfinite(torch.stack(squares))
    flags = torch.unbind(~finite)
    if not bool(finite.all()):
        flags = tuple(~torch.isfinite(t).all() if not ok else flag
                      for t, ok, flag in zip(stored, finite.tolist(), flags))
    return list(zip(squares, flags))


def _quantize_rows(rows: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` of ``rows`` (fp32, one block a row): ``scale = max|x| / qmax`` per row,
    ``q = clamp(round_half_even(x / scale), ±qmax)`` as fp32 integers (0 where the scale is 0 or not
    finite). The max propagates nan, so a block holding one gets a nan scale."""
    # qmax as a tensor on rows' device: torch on CUDA turns a division by a Python scalar into a
    # product with its reciprocal, which is not IEEE division (the kernels' div_rn) in the last bit.
    scale = rows.abs().amax(dim=1) / torch.full((), qmax, dtype=rows.dtype, device=rows.device)
    usable = (scale > 0) & (scale < torch.inf)
    all_usable = bool(usable.all())
    y = rows / (scale if all_usable else torch.where(usable, scale, 1.0))[:, None]
    if not all_usable:
        y = torch.where(usable[:, None], y, 0.0)
    return y.round_().clamp_(-qmax, qmax), scale


def _quantize_chunks(x: torch.Tensor, rows: torch.Tensor, block_size: int, bits: int) -> None:
    """Quantise each row of ``x`` ([chunks, n] fp32, one chunk a row) into the same row of ``rows``
    ([chunks, packed_nbytes(n)] int8, one packed chunk a row; see [Note: packed int8 chunks])."""
    chunks, n = x.shape
    if n == 0:
        return
    qmax, full = QMAX_BY_BITS[bits], n - n % block_size
    whole = full // block_size
    start, payload = scales_offset(n, bits), payload_nbytes(n, bits)
    # the full blocks as a view (no copy for one fp32 chunk), the partial last block on its own
    parts = [(x[:, :full].reshape(chunks * whole, block_size), 0, full), (x[:, full:], full, n)]
    quantized = [(*_quantize_rows(blocks, qmax), lo, hi) for blocks, lo, hi in parts if hi > lo]
    scales = torch.cat([scale.view(chunks, -1) for _, scale, _, _ in quantized], dim=1)
    if bits == 8:  # each part's values straight into place
        for q, _, lo, hi in quantized:
            rows[:, lo:hi].copy_(q.view(chunks, hi - lo))
    else:
        q = torch.cat([q.view(chunks, hi - lo) for q, _, lo, hi in quantized], dim=1).to(torch.int16)
        if n % 2:
            q = torch.nn.functional.pad(q, (0, 1))
        rows[:, :payload].copy_(q[:, 1::2] * 16 + (q[:, 0::2] & 15))
    rows[:, payload:start].zero_()
    rows[:, start:].copy_(scales.view(torch.int8).view(chunks, -1))


def _dequantize_chunks(rows: torch.Tensor, n: int, block_size: int, bits: int) -> torch.Tensor:
    """The values of the packed chunks ``rows`` ([chunks, packed_nbytes(n)] int8) as a new
    [chunks, n] fp32 tensor: ``q * scale``, one rounding."""
    chunks, start = rows.shape[0], scales_offset(n, bits)
    scales = rows[:, start:].contiguous().view(torch.float32)  # [chunks, blocks]
    if bits == 8:
        values = rows[:, :n].to(torch.float32)
    else:
        b = rows[:, :payload_nbytes(n, bits)].to(torch.int16)
        values = torch.stack([((b & 15) ^ 8) - 8, b >> 4], dim=2).view(chunks, -1)[:, :n].to(torch.float32)
    full = n - n % block_size
    whole = full // block_size
    if whole:  # the product in fp32 (in place)
        values[:, :full].view(chunks, whole, block_size).mul_(scales[:, :whole, None])
    if n > full:
        values[:, full:].mul_(scales[:, whole:])
    return values


@torch.no_grad()
def quantize_int8(src: torch.Tensor, packed: torch.Tensor, *, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Reference of :func:`flashfsdp.kernels.quantize_int8`: per block, ``scale = max|x| / 127``
    and ``q = round_half_even(x / scale)`` in fp32, packed as in [Note: packed int8 chunks]."""
    block_size = validate_quantize(src, packed, block_size)
    _quantize_chunks(src.to(torch.float32).view(1, -1), packed.view(1, -1), block_size, 8)
    return packed


@torch.no_grad()
def dequantize_int8(packed: torch.Tensor, out: torch.Tensor, *, chunks: int = 1,
                    block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Reference of :func:`flashfsdp.kernels.dequantize_int8`: ``out = cast(q.float() * scale)``
    chunk by chunk, the product in fp32, rounded once to ``out.dtype`` (nearest even)."""
    n, block_size = validate_dequantize(packed, out, chunks, block_size)
    if n:
        out.view(chunks, n).copy_(_dequantize_chunks(packed.view(chunks, -1), n, block_size, 8))
    return out


@torch.no_grad()
def quantize_grad(src: torch.Tensor, packed: torch.Tensor, *, bits: int, nodes: int = 1, local_size: int = 1,
                  block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Reference of :func:`flashfsdp.kernels.quantize_grad`: segment g of ``src`` quantised as one
    chunk into slot :func:`~flashfsdp.kernels.quantize_grad.slot_of` ``(g)`` of ``packed``."""
    n = validate_quantize_grad(src, packed, nodes, local_size, bits, block_size)
    world = nodes * local_size
    if n == 0:
        return packed
    slots = [slot_of(g, nodes, local_size) for g in range(world)]
    rows = packed.view(world, -1)
    x = src.to(torch.float32).view(world, n)
    if slots == sorted(slots):
        _quantize_chunks(x, rows, block_size, bits)
    else:
        staged = torch.empty_like(rows)
        _quantize_chunks(x, staged, block_size, bits)
        rows[slots] = staged
    return packed


@torch.no_grad()
def dequantize_reduce(packed: torch.Tensor, out: torch.Tensor, *, senders: int, numel: int, bits: int,
                      chunks: int = 1, out_bits: int | None = None, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Reference of :func:`flashfsdp.kernels.dequantize_reduce`: ``total[c] = sum over j in order of
    deq(packed chunk j·chunks + c)`` in fp32 (from zero), then ``out[c] = cast(total[c])`` or, with
    ``out_bits``, ``total`` quantised into the packed ``out``."""
    validate_dequantize_reduce(packed, out, senders, chunks, numel, bits, out_bits, block_size)
    if numel == 0:
        return out
    received = packed.view(senders, chunks, packed_nbytes(numel, block_size, bits=bits))
    total = torch.zeros(chunks, numel, dtype=torch.float32, device=packed.device)
    for j in range(senders):
        total += _dequantize_chunks(received[j], numel, block_size, bits)
    if out_bits is None:
        out.view(chunks, numel).copy_(total)
    else:
        _quantize_chunks(total, out.view(chunks, -1), block_size, out_bits)
    return out
