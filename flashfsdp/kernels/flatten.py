"""flatten as one Triton launch: many tensors -> one flat buffer, with cast, scale and zeroed gaps.

The op's contract is :func:`flashfsdp.kernels.flatten` (docstring in
:mod:`flashfsdp.kernels.dispatch`); its reference is :func:`flashfsdp.kernels.reference.flatten`.

Design:
- One launch for the whole list. The host lists *segments*: every non-empty tensor, plus every
  range of ``out`` no tensor covers (gaps, ``None`` entries), which the kernel writes as zeros in
  the same pass. No separate memset, no per-tensor launch.
- Mixed input dtypes in one launch: each segment row carries its input's dtype code and the
  kernel loads through a pointer of that dtype (one uniform branch per program, so no
  divergence). The output dtype is ``out``'s, a compile-time constant.
- Work split: one program per ``BLOCK`` elements of each segment, found by binary search over the
  table's prefix sum of blocks ([Note: segment tables] in :mod:`flashfsdp.kernels.segments`), so
  huge and tiny tensors in one list balance.
- 64-bit element arithmetic (program id, offsets and numels are int64), so buffers past 2^31
  elements or bytes are fine.
- A full block of a 16-byte-aligned segment takes an unmasked path with alignment hints
  (16-byte vector loads and stores); the last, partial block of a segment is masked.
- fp32 -> bf16 rounds to nearest even in integer arithmetic (:func:`round_to_bfloat16`), so the
  interpreter gives the GPU's bits.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from flashfsdp.kernels.segments import ZERO_CODE, gap_segments, segment_table
from flashfsdp.kernels.triton_helpers import cast_from_float32, find_segment, load_as_float32
from flashfsdp.kernels.triton_support import tl, triton
from flashfsdp.kernels.validation import ScannedItems, validate_flatten

BLOCK = 4096  # elements per program: 16 per thread at 8 warps, four 16-byte vectors of fp32
NUM_WARPS = 8


@triton.jit
def flatten_kernel(table_ptr, n_segments, out_ptr, scale, BLOCK: tl.constexpr, APPLY_SCALE: tl.constexpr):
    """Program ``pid`` writes one block of one segment: ``out[off + i] = cast(src[i] * scale)``."""
    pid = tl.program_id(0).to(tl.int64)
    address, code, aligned, flat_offset, numel, start = find_segment(table_ptr, n_segments, pid, BLOCK)
    idx = start + tl.arange(0, BLOCK)
    if aligned & (start + BLOCK <= numel):
        x = load_as_float32(address, code, idx, None, True)
        if APPLY_SCALE:
            x = x * scale
        dst = tl.multiple_of(out_ptr + flat_offset, 16)
        tl.store(dst + idx, cast_from_float32(x, out_ptr.dtype.element_ty))
    else:
        mask = idx < numel
        x = load_as_float32(address, code, idx, mask, False)
        if APPLY_SCALE:
            x = x * scale
        tl.store(out_ptr + flat_offset + idx, cast_from_float32(x, out_ptr.dtype.element_ty), mask=mask)


def flatten_triton(
    tensors: Sequence[torch.Tensor | None],
    offsets: Sequence[int],
    out: torch.Tensor,
    *,
    scale: float = 1.0,
    numels: Sequence[int] | None = None,
) -> torch.Tensor:
    """Triton launcher of :func:`flashfsdp.kernels.flatten` (same arguments, result and errors).

    Non-contiguous tensors are copied with ``.contiguous()`` first (one extra read and write of
    those tensors). Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    offsets, items, scale = validate_flatten(tensors, offsets, out, scale, numels)
    return flatten_validated(tensors, offsets, items, out, scale)


def flatten_validated(tensors: Sequence[torch.Tensor | None], offsets: list[int], items: ScannedItems,
                      out: torch.Tensor, scale: float) -> torch.Tensor:
    """:func:`flatten_triton` after :func:`validate_flatten` returned ``(offsets, items, scale)``
    (``items.addresses`` is modified: the copies' addresses replace the non-contiguous tensors');
    returns ``out``."""
    addresses = items.addresses
    copies = []  # contiguous copies of non-contiguous tensors, alive until the launch is enqueued
    for i in items.noncontiguous:
        copies.append(tensors[i].contiguous())
        addresses[i] = copies[-1].data_ptr()
    launch_flatten(flatten_table(offsets, items, out), out, scale)
    return out


def flatten_table(offsets: list[int], items: ScannedItems, out: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """The segment table (:func:`~flashfsdp.kernels.segments.segment_table`: ``(table, n_blocks)``)
    of a validated flatten whose every tensor ``i`` is read at ``items.addresses[i]`` (contiguous);
    ``None`` when ``out`` has no element to write (nothing to launch)."""
    # One segment per non-empty entry (a None entry is a zero segment: address 0, ZERO_CODE), then
    # the ranges no entry covers, as zero segments too.
    sizes = np.asarray(items.sizes, dtype=np.int64)
    nonempty = sizes > 0
    starts = np.asarray(offsets, dtype=np.int64)[nonempty]
    lengths = sizes[nonempty]
    gap_starts, gap_lengths = gap_segments(starts, lengths, out.numel())
    if not len(lengths) and not len(gap_lengths):
        return None
    return segment_table(
        np.concatenate((np.asarray(items.addresses, dtype=np.int64)[nonempty], np.zeros_like(gap_starts))),
        np.concatenate((np.asarray(items.codes, dtype=np.int64)[nonempty], np.full_like(gap_starts, ZERO_CODE))),
        np.concatenate((starts, gap_starts)),
        np.concatenate((lengths, gap_lengths)),
        out, BLOCK,
    )


def launch_flatten(prepared: tuple[torch.Tensor, int] | None, out: torch.Tensor, scale: float) -> None:
    """Launch :func:`flatten_kernel` over ``prepared`` (:func:`flatten_table`'s result, built for a
    buffer of ``out``'s dtype, size, device and address modulo 16) with a checked ``scale``;
    nothing for ``None``."""
    if prepared is None:
        return
    table, n_blocks = prepared
    # No multiply-add to fuse here; passing enable_fp_fusion keeps Triton 3.9 from warning about
    # its changing default.
    flatten_kernel[(n_blocks,)](
        table, table.shape[0], out, scale,
        BLOCK=BLOCK, APPLY_SCALE=scale != 1.0, num_warps=NUM_WARPS, enable_fp_fusion=False,
    )
