"""Shard(k) parameters (k != 0): their chunks moved between full tensors and rank-major flat buffers.

A parameter sharded along dim k (see [Note: Shard(k) parameters] in ``layout.py``) has, on rank r,
the contiguous chunk ``torch.chunk(p, W, dim=k)[r]`` at offset o in that rank's part of a
rank-major buffer (the gathered buffer, the reduce-scatter input). In the full parameter that chunk
is ``prod(shape[:k])`` runs of elements, which the segment tables of the ``flatten`` / ``unflatten``
kernels (one run per segment) do not express; so these parameters are moved here with torch ops,
as FSDP2 does for them (``torch.cat`` / ``torch.chunk`` along the shard dim, one extra copy):
at most two strided copies per parameter and direction — the ranks holding a full chunk of k_i
rows in one copy (the buffer viewed ``(ranks, pre, k_i, post)`` against the full tensor viewed
``(pre, ranks, k_i, post)``), and the one rank with a shorter, non-empty chunk in another.
Dim-0 parameters never come here (their chunks are runs: one kernel launch for all of them).

The full tensor is viewed ``(pre, d_k, post)``; it must be contiguous (the unsharded parameters,
full state-dict values and gradients are). Copies cast to the destination's dtype.
"""

from __future__ import annotations

from typing import Iterator

import torch

from .layout import ShardLayout


def _pieces(layout: ShardLayout, i: int, flat: torch.Tensor, full: torch.Tensor, ranks: range, stride: int,
            base: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Pairs ``(flat side, full side)`` of views of the same shape covering the chunks of
    parameter ``i`` of ``ranks``; rank r's part of ``flat`` starts at ``(r - base) · stride``."""
    shape, dim = layout.shapes[i], layout.dims[i]
    d, k = shape[dim], layout.chunk_rows(i)
    pre = post = 1
    for n in shape[:dim]:
        pre *= n
    for n in shape[dim + 1:]:
        post *= n
    full3 = full.view(pre, d, post)
    o = layout.offsets[i]
    nfull = min(d // k, ranks.stop) if k else 0
    lo = ranks.start
    if nfull > lo:  # ranks lo..nfull-1 hold k rows each
        n = nfull - lo
        rows = flat[(lo - base) * stride : (nfull - base) * stride].view(n, stride)[:, o : o + pre * k * post].view(n, pre, k, post)
        yield rows.permute(1, 0, 2, 3), full3[:, lo * k : nfull * k].view(pre, n, k, post)
    r = max(nfull, lo)
    if r < ranks.stop and k and d - r * k > 0:  # the one rank with fewer rows
        rows = d - r * k
        start = (r - base) * stride + o
        yield flat[start : start + pre * rows * post].view(pre, rows, post), full3[:, r * k : d]


def chunks_to_full(flat: torch.Tensor, layout: ShardLayout, i: int, full: torch.Tensor,
                   stride: int | None = None) -> None:
    """Copy every rank's chunk of parameter ``i`` from a rank-major buffer into ``full``.

    Args:
        flat: W·stride elements (any dtype): rank r's chunk at ``r·stride + layout.offsets[i]``.
        layout: the group's layout; ``layout.dims[i]`` is the shard dim.
        i: the parameter.
        full: a contiguous tensor of ``layout.shapes[i]`` (or of its numel), written in place.
        stride: elements per rank in ``flat`` (default: the shard size S).
    """
    stride = layout.shard_size if stride is None else stride
    for src, dst in _pieces(layout, i, flat, full, range(layout.world_size), stride, 0):
        dst.copy_(src)


def full_to_chunks(full: torch.Tensor, layout: ShardLayout, i: int, flat: torch.Tensor, stride: int | None = None,
                   ranks: range | None = None, scale: float = 1.0) -> None:
    """Write chunk r of ``full`` (parameter ``i``, contiguous, full shape or its numel) for every
    rank r of ``ranks`` (default: all W) into a rank-major buffer, rank r's part at
    ``(r - ranks.start)·stride`` (``stride`` default S), cast to ``flat``'s dtype and multiplied by
    ``scale`` (after the cast: pass powers of two, which are exact). The padding after each chunk
    is left as it is (the caller zeroes it)."""
    stride = layout.shard_size if stride is None else stride
    ranks = range(layout.world_size) if ranks is None else ranks
    for dst, src in _pieces(layout, i, flat, full, ranks, stride, ranks.start):
        dst.copy_(src)
        if scale != 1.0:
            dst.mul_(scale)
