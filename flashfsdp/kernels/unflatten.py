"""unflatten as one Triton launch: one flat buffer -> many tensors, with cast.

The op's contract is :func:`flashfsdp.kernels.unflatten` (docstring in
:mod:`flashfsdp.kernels.dispatch`); its reference is :func:`flashfsdp.kernels.reference.unflatten`.

Same scheme as :mod:`flashfsdp.kernels.flatten`, mirrored: one segment per non-empty output, the
table giving the output's address and dtype code and its range of ``flat``; one program per
``BLOCK`` elements of a segment, found by binary search; int64 offsets; unmasked 16-byte vector
accesses for full blocks of aligned segments; stores through a pointer of each output's dtype,
fp32 -> bf16 rounded to nearest even in integer arithmetic.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from flashfsdp.kernels.segments import segment_table
from flashfsdp.kernels.triton_helpers import find_segment, store_from_float32
from flashfsdp.kernels.triton_support import tl, triton
from flashfsdp.kernels.validation import ScannedItems, validate_unflatten

BLOCK = 4096  # elements per program: 16 per thread at 8 warps
NUM_WARPS = 8


@triton.jit
def unflatten_kernel(table_ptr, n_segments, flat_ptr, BLOCK: tl.constexpr):
    """Program ``pid`` copies one block of one segment: ``dst[i] = cast(flat[off + i])``."""
    pid = tl.program_id(0).to(tl.int64)
    address, code, aligned, flat_offset, numel, start = find_segment(table_ptr, n_segments, pid, BLOCK)
    idx = start + tl.arange(0, BLOCK)
    if aligned & (start + BLOCK <= numel):
        src = tl.multiple_of(flat_ptr + flat_offset, 16)
        x = tl.load(src + idx).to(tl.float32)
        store_from_float32(address, code, idx, x, None, True)
    else:
        mask = idx < numel
        x = tl.load(flat_ptr + flat_offset + idx, mask=mask).to(tl.float32)
        store_from_float32(address, code, idx, x, mask, False)


def unflatten_triton(flat: torch.Tensor, offsets: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
    """Triton launcher of :func:`flashfsdp.kernels.unflatten` (same arguments, result and errors).

    A non-contiguous output is written through a contiguous temporary, copied back into it after
    the launch (stream-ordered, no host sync). Runs on CUDA tensors, or on CPU tensors under
    ``TRITON_INTERPRET=1``.
    """
    offsets, items = validate_unflatten(flat, offsets, outs)
    unflatten_validated(flat, offsets, items, outs)


def unflatten_validated(flat: torch.Tensor, offsets: list[int], items: ScannedItems,
                        outs: Sequence[torch.Tensor]) -> None:
    """:func:`unflatten_triton` after :func:`validate_unflatten` returned ``(offsets, items)``
    (``items.addresses`` is modified: the temporaries' addresses replace the non-contiguous
    outputs')."""
    addresses = items.addresses
    write_backs = []  # (non-contiguous output, its contiguous temporary)
    for i in items.noncontiguous:
        temporary = torch.empty(outs[i].shape, dtype=outs[i].dtype, device=outs[i].device)
        write_backs.append((outs[i], temporary))
        addresses[i] = temporary.data_ptr()
    launch_unflatten(unflatten_table(flat, offsets, items), flat)
    for out, temporary in write_backs:
        out.copy_(temporary)


def unflatten_table(flat: torch.Tensor, offsets: list[int], items: ScannedItems) -> tuple[torch.Tensor, int] | None:
    """The segment table (:func:`~flashfsdp.kernels.segments.segment_table`: ``(table, n_blocks)``)
    of a validated unflatten whose every output ``i`` is written at ``items.addresses[i]``
    (contiguous); ``None`` when no output has an element (nothing to launch)."""
    sizes = np.asarray(items.sizes, dtype=np.int64)
    nonempty = sizes > 0
    if not nonempty.any():
        return None
    return segment_table(
        np.asarray(items.addresses, dtype=np.int64)[nonempty], np.asarray(items.codes, dtype=np.int64)[nonempty],
        np.asarray(offsets, dtype=np.int64)[nonempty], sizes[nonempty], flat, BLOCK,
    )


def launch_unflatten(prepared: tuple[torch.Tensor, int] | None, flat: torch.Tensor) -> None:
    """Launch :func:`unflatten_kernel` over ``prepared`` (:func:`unflatten_table`'s result, built
    for a buffer of ``flat``'s dtype, size, device and address modulo 16); nothing for ``None``."""
    if prepared is None:
        return
    table, n_blocks = prepared
    unflatten_kernel[(n_blocks,)](  # enable_fp_fusion: see flatten.launch_flatten
        table, table.shape[0], flat, BLOCK=BLOCK, num_warps=NUM_WARPS, enable_fp_fusion=False
    )
