"""Triton device functions shared by the kernels: segment lookup, dtype-coded loads and stores, casts.

The table layout and dtype codes are defined once, on the host side, in
:mod:`flashfsdp.kernels.segments` (see [Note: segment tables] there); this module mirrors them
as ``tl.constexpr`` values for the device code.
"""

from __future__ import annotations

import torch

from flashfsdp.kernels import segments
from flashfsdp.kernels.triton_support import tl, triton

_COLUMNS = tl.constexpr(segments.TABLE_COLUMNS)
_ADDRESS = tl.constexpr(segments.ADDRESS)
_CODE = tl.constexpr(segments.CODE)
_FLAT_OFFSET = tl.constexpr(segments.FLAT_OFFSET)
_NUMEL = tl.constexpr(segments.NUMEL)
_FIRST_BLOCK = tl.constexpr(segments.FIRST_BLOCK)
_FLOAT32 = tl.constexpr(segments.DTYPE_CODES[torch.float32])
_BFLOAT16 = tl.constexpr(segments.DTYPE_CODES[torch.bfloat16])
_FLOAT16 = tl.constexpr(segments.DTYPE_CODES[torch.float16])
_ALIGNED_FLAG = tl.constexpr(segments.ALIGNED_FLAG)
_ALIGNMENT_BYTES = tl.constexpr(segments.ALIGNMENT_BYTES)


@triton.jit
def find_segment(table_ptr, n_segments, pid, BLOCK: tl.constexpr):
    """Look up program ``pid``'s segment in a segment table.

    Returns ``(address, code, aligned, flat_offset, numel, start)``: the row's columns with the
    alignment flag split off ``code``, and ``start``, the first element of the segment this
    program serves (a multiple of ``BLOCK``). All int64 scalars, ``aligned`` an int1.
    """
    lo = pid * 0
    hi = lo + n_segments
    # Invariant: FIRST_BLOCK[lo] <= pid < FIRST_BLOCK[hi] (row n_segments standing for +inf).
    while hi - lo > 1:
        mid = (lo + hi) // 2
        below = tl.load(table_ptr + mid * _COLUMNS + _FIRST_BLOCK) <= pid
        lo = tl.where(below, mid, lo)
        hi = tl.where(below, hi, mid)
    row = table_ptr + lo * _COLUMNS
    address = tl.load(row + _ADDRESS)
    coded = tl.load(row + _CODE)
    flat_offset = tl.load(row + _FLAT_OFFSET)
    numel = tl.load(row + _NUMEL)
    start = (pid - tl.load(row + _FIRST_BLOCK)) * BLOCK
    return address, coded & (_ALIGNED_FLAG - 1), (coded & _ALIGNED_FLAG) != 0, flat_offset, numel, start


@triton.jit
def as_pointer(address, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    """An int64 byte address as a ``dtype`` pointer; with ``ALIGNED``, promise 16-byte alignment.

    The promise (``tl.multiple_of``) lets the compiler emit 16-byte vector accesses; the caller
    must only make it when the segment table's ALIGNED flag holds.
    """
    pointer = address.to(tl.pointer_type(dtype))
    if ALIGNED:
        pointer = tl.multiple_of(pointer, _ALIGNMENT_BYTES)
    return pointer


@triton.jit
def round_to_bfloat16(x):
    """fp32 -> bf16 rounding to nearest, ties to even, in integer arithmetic.

    Same bits as PyTorch's ``c10::round_to_nearest_even`` (and the GPU's ``cvt.rn.bf16.f32``) for
    every non-NaN input, including overflow to inf; a NaN stays a quiet NaN of the same sign.
    Written out because the Triton interpreter truncates on ``.to(tl.bfloat16)``, which would make
    the CPU tests check a different rounding than the GPU does.
    """
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = (bits >> 16) | 0x40
    bf16_bits = tl.where(x != x, quiet_nan, rounded)
    return bf16_bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def cast_from_float32(x, dtype: tl.constexpr):
    """fp32 values -> ``dtype`` (fp32, bf16 or fp16), rounding to nearest even."""
    if dtype == tl.bfloat16:
        y = round_to_bfloat16(x)
    else:
        y = x.to(dtype)
    return y


@triton.jit
def load_as_float32(address, code, idx, mask, ALIGNED: tl.constexpr):
    """Load ``idx`` elements of the tensor at ``address`` whose dtype ``code`` says, as fp32.

    ``ZERO_CODE`` (a gap) gives zeros without a load. ``mask`` may be None (a full block).
    """
    if code == _FLOAT32:
        x = tl.load(as_pointer(address, tl.float32, ALIGNED) + idx, mask=mask)
    elif code == _BFLOAT16:
        x = tl.load(as_pointer(address, tl.bfloat16, ALIGNED) + idx, mask=mask).to(tl.float32)
    elif code == _FLOAT16:
        x = tl.load(as_pointer(address, tl.float16, ALIGNED) + idx, mask=mask).to(tl.float32)
    else:
        x = tl.zeros_like(idx).to(tl.float32)
    return x


@triton.jit
def store_from_float32(address, code, idx, x, mask, ALIGNED: tl.constexpr):
    """Store fp32 values ``x`` at ``idx`` into the tensor at ``address``, cast to its dtype ``code``."""
    if code == _FLOAT32:
        tl.store(as_pointer(address, tl.float32, ALIGNED) + idx, x, mask=mask)
    elif code == _BFLOAT16:
        tl.store(as_pointer(address, tl.bfloat16, ALIGNED) + idx, round_to_bfloat16(x), mask=mask)
    else:
        tl.store(as_pointer(address, tl.float16, ALIGNED) + idx, x.to(tl.float16), mask=mask)
