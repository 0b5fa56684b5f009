"""Argument checks shared by the Triton and the reference implementation of every kernel op.

Both paths call the same checks, so a bad argument raises the same exception with the same message
whichever backend runs. Every message starts with the op's name and names the offending argument,
e.g. ``flatten: offsets[3]=120 overlaps tensors[2] which covers [100, 130)``.

Errors:
- ``TypeError`` for an argument of the wrong kind: not a tensor, an offset that is not an int, a
  dtype outside :data:`SUPPORTED_DTYPES`.
- ``ValueError`` for a value of the right kind but wrong: a scale not finite in fp32, length
  mismatches, negative / out-of-range / overlapping offsets, a non-contiguous or non-1-D flat
  buffer, tensors on different devices, an input whose memory overlaps an output's without being
  exactly the output's slice at its offset.
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple, Sequence

import numpy as np
import torch

from flashfsdp.kernels.segments import DTYPE_CODES, SMALL_RANGE_COUNT, ZERO_CODE

# The float dtypes every op reads and writes. The kernels compute in fp32; an op with a float64
# tensor runs the reference instead, which then computes in float64 (no precision lost on
# ``model.double()``). fp8 formats are a later addition.
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_ITEMSIZE_BY_CODE = {DTYPE_CODES[dtype]: dtype.itemsize for dtype in SUPPORTED_DTYPES}


def check_dtype(op: str, name: str, tensor: torch.Tensor) -> None:
    """Raise ``TypeError`` unless ``tensor.dtype`` is one of :data:`SUPPORTED_DTYPES`."""
    if tensor.dtype not in SUPPORTED_DTYPES:
        kind = "floating" if tensor.dtype.is_floating_point else "non-floating"
        raise TypeError(
            f"{op}: {name} has {kind} dtype {tensor.dtype}; only floating dtypes "
            f"float32, bfloat16, float16 and float64 are supported"
        )


def check_tensor(op: str, name: str, value: object) -> torch.Tensor:
    """Raise ``TypeError`` unless ``value`` is a ``torch.Tensor`` with a supported dtype."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    check_dtype(op, name, value)
    return value


def check_flat_buffer(op: str, name: str, value: object) -> torch.Tensor:
    """Check a flat buffer argument: a supported-dtype tensor that is 1-D and contiguous."""
    tensor = check_tensor(op, name, value)
    if tensor.dim() != 1:
        raise ValueError(f"{op}: {name} must be 1-D, got shape {tuple(tensor.shape)}")
    if not tensor.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (stride 1), got stride {tensor.stride()}")
    return tensor


def check_same_device(op: str, name: str, tensor: torch.Tensor, ref_name: str, ref: torch.Tensor) -> None:
    """Raise ``ValueError`` if ``tensor`` and ``ref`` live on different devices."""
    if tensor.device != ref.device:
        raise ValueError(f"{op}: {name} is on {tensor.device} but {ref_name} is on {ref.device}")


_FP32_MAX = float(torch.finfo(torch.float32).max)


def check_scale(op: str, scale: object) -> float:
    """Return ``scale`` as a Python float: ``TypeError`` if it is not a real number, ``ValueError``
    if it is not finite *in fp32*, the precision every op multiplies in (an inf or nan scale would
    turn zeroed gaps into nan: 0 * inf)."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"{op}: scale must be a Python float, got {type(scale).__name__}")
    if not math.isfinite(scale) or abs(scale) > _FP32_MAX:
        raise ValueError(f"{op}: scale must be finite in float32 (|scale| <= {_FP32_MAX:.6e}), got {scale}")
    return float(scale)


def _as_int_list(op: str, name: str, values: Sequence[int]) -> list[int]:
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    values = list(values)
    if all(type(value) is int for value in values):  # the common case, without a per-item call
        return values
    result = []
    for i, value in enumerate(values):
        if isinstance(value, bool):
            raise TypeError(f"{op}: {name}[{i}] must be an int, got bool")
        try:
            result.append(operator.index(value))
        except TypeError:
            raise TypeError(f"{op}: {name}[{i}] must be an int, got {type(value).__name__}") from None
    return result


def check_ranges(
    op: str,
    items_name: str,
    offsets: list[int],
    numels: list[int],
    buffer_name: str,
    buffer_numel: int,
    *,
    disjoint: bool = True,
) -> None:
    """Check that the element ranges ``[offsets[i], offsets[i] + numels[i])`` fit (and are disjoint).

    Each range must lie inside ``[0, buffer_numel]``; with ``disjoint``, non-empty ranges must not
    overlap each other. Offsets need not be sorted: the check sorts them (numpy, so a unit of
    thousands of tensors costs microseconds; a unit of a few tensors is checked in plain Python,
    whose per-call cost is a fraction of numpy's). Raises ``ValueError`` naming the first bad entry.
    """
    if len(offsets) <= SMALL_RANGE_COUNT:
        _check_few_ranges(op, items_name, offsets, numels, buffer_name, buffer_numel, disjoint)
        return
    sizes = np.asarray(numels, dtype=np.int64)
    try:
        starts = np.asarray(offsets, dtype=np.int64)
    except OverflowError:  # an offset beyond int64: out of range of any buffer
        starts = np.asarray([min(max(o, -1), buffer_numel + 1) for o in offsets], dtype=np.int64)
    # Compared as start > numel - size, never as start + size > numel: the sum of an offset near
    # 2^63 and a size wraps around in int64 and would pass.
    out_of_range = (starts < 0) | (starts > buffer_numel - sizes)
    if out_of_range.any():
        i = int(np.argmax(out_of_range))
        if offsets[i] < 0:
            raise ValueError(f"{op}: offsets[{i}]={offsets[i]} is negative")
        raise ValueError(
            f"{op}: offsets[{i}]={offsets[i]} with {items_name}[{i}] of {numels[i]} elements ends at "
            f"{offsets[i] + numels[i]}, past {buffer_name}.numel()={buffer_numel}"
        )
    if not disjoint:
        return
    ends = starts + sizes  # in range now: no wrap-around
    nonempty = np.flatnonzero(sizes > 0)
    order = nonempty[np.argsort(starts[nonempty], kind="stable")]
    overlapping = starts[order[1:]] < ends[order[:-1]]
    if overlapping.any():
        k = int(np.argmax(overlapping))
        prev, cur = int(order[k]), int(order[k + 1])
        raise ValueError(
            f"{op}: offsets[{cur}]={offsets[cur]} overlaps {items_name}[{prev}] which covers "
            f"[{offsets[prev]}, {offsets[prev] + numels[prev]})"
        )


# Up to SMALL_RANGE_COUNT ranges, check_ranges (and segments.gap_segments) run in plain Python: each
# numpy call costs microseconds of its own, which dominated the per-unit host time of small units.

def _check_few_ranges(op: str, items_name: str, offsets: list[int], numels: list[int], buffer_name: str,
                      buffer_numel: int, disjoint: bool) -> None:
    """:func:`check_ranges` in plain Python (exact integers: no wrap-around), same errors, same order."""
    for i, (start, size) in enumerate(zip(offsets, numels)):
        if start < 0:
            raise ValueError(f"{op}: offsets[{i}]={start} is negative")
        if start > buffer_numel - size:
            raise ValueError(
                f"{op}: offsets[{i}]={start} with {items_name}[{i}] of {size} elements ends at "
                f"{start + size}, past {buffer_name}.numel()={buffer_numel}"
            )
    if not disjoint:
        return
    order = sorted([i for i, size in enumerate(numels) if size > 0], key=offsets.__getitem__)
    for prev, cur in zip(order, order[1:]):
        if offsets[cur] < offsets[prev] + numels[prev]:
            raise ValueError(
                f"{op}: offsets[{cur}]={offsets[cur]} overlaps {items_name}[{prev}] which covers "
                f"[{offsets[prev]}, {offsets[prev] + numels[prev]})"
            )


class ScannedItems(NamedTuple):
    """What one validation pass over a multi-tensor op's items learned (one entry per item).

    Attributes:
        sizes: elements of each item (``numels[i]`` for a ``None`` entry).
        addresses: ``data_ptr()`` of each item (0 for ``None``).
        codes: the item's dtype code (``segments.DTYPE_CODES``; ``ZERO_CODE`` for ``None``).
        noncontiguous: indices of the non-empty tensors that are not contiguous.
    """

    sizes: list[int]
    addresses: list[int]
    codes: list[int]
    noncontiguous: list[int]


def _scan_items(
    op: str,
    items_name: str,
    items: Sequence[torch.Tensor | None],
    offsets: list[int],
    buffer_name: str,
    buffer: torch.Tensor,
    numels: list[int] | None = None,
    allow_none: bool = False,
) -> ScannedItems:
    """Check every item of a multi-tensor op against the flat ``buffer`` in one pass.

    Items must be supported-dtype tensors on ``buffer``'s device whose memory does not overlap
    ``buffer``'s unless they are exactly the slice at their offset (or ``None`` with
    ``allow_none``, sized by ``numels``). This loop is the launchers' host cost per tensor (a unit
    can have thousands), so it reads each attribute once, compares byte ranges instead of
    storages, and builds messages only on failure.
    """
    device = buffer.device
    lo = buffer.data_ptr()
    hi = lo + buffer.numel() * buffer.element_size()
    codes_of, itemsizes = DTYPE_CODES, _ITEMSIZE_BY_CODE
    sizes, addresses, codes, noncontiguous = [], [], [], []
    for i, item in enumerate(items):
        if item is None and allow_none:
            size = 0 if numels is None else numels[i]
            if size < 0:
                raise ValueError(f"{op}: numels[{i}]={size} is negative")
            sizes.append(size)
            addresses.append(0)
            codes.append(ZERO_CODE)
            continue
        if not isinstance(item, torch.Tensor) or item.dtype not in codes_of or item.device != device:
            check_tensor(op, f"{items_name}[{i}]", item)
            check_same_device(op, f"{items_name}[{i}]", item, buffer_name, buffer)
        code = codes_of[item.dtype]
        size = item.numel()
        if numels is not None and numels[i] != size:
            raise ValueError(f"{op}: numels[{i}]={numels[i]} but {items_name}[{i}] has {size} elements")
        address = item.data_ptr()
        if size:
            if item.is_contiguous():
                overlaps = address < hi and address + size * itemsizes[code] > lo
            else:
                noncontiguous.append(i)
                start, stop = _byte_range(item)
                overlaps = start < hi and stop > lo
            if overlaps:
                _check_aliasing(op, f"{items_name}[{i}]", item, buffer_name, buffer, offsets[i])
        sizes.append(size)
        addresses.append(address)
        codes.append(code)
    return ScannedItems(sizes, addresses, codes, noncontiguous)


def _byte_range(tensor: torch.Tensor) -> tuple[int, int]:
    """``[first byte, past the last byte)`` of the memory a non-empty tensor's elements span."""
    extent = 1 + sum((n - 1) * stride for n, stride in zip(tensor.shape, tensor.stride()))
    start = tensor.data_ptr()
    return start, start + extent * tensor.element_size()


def _check_aliasing(op: str, name: str, tensor: torch.Tensor, buffer_name: str, buffer: torch.Tensor,
                    offset: int) -> None:
    """Reject a tensor whose memory overlaps ``buffer``'s unless it *is* ``buffer[offset:offset+n]``.

    An exact alias is harmless (every element is read and written by the same thread), any other
    overlap would make the result depend on the order of reads and writes. Tensors in the same
    storage whose bytes do not overlap are fine.
    """
    if tensor.numel() == 0 or buffer.numel() == 0:
        return
    start, stop = _byte_range(tensor)
    buffer_start, buffer_stop = _byte_range(buffer)
    if stop <= buffer_start or start >= buffer_stop:
        return
    exact = (
        tensor.dtype == buffer.dtype
        and tensor.is_contiguous()
        and buffer.is_contiguous()
        and start == buffer.data_ptr() + offset * buffer.element_size()
    )
    if not exact:
        raise ValueError(
            f"{op}: {name} overlaps the memory of {buffer_name} without being exactly "
            f"{buffer_name}[{offset}:{offset + tensor.numel()}]; pass a separate tensor"
        )


def validate_flatten(
    tensors: Sequence[torch.Tensor | None],
    offsets: Sequence[int],
    out: torch.Tensor,
    scale: float,
    numels: Sequence[int] | None,
) -> tuple[list[int], ScannedItems, float]:
    """Check :func:`flashfsdp.kernels.flatten`'s arguments; return ``(offsets, items, scale)``.

    ``items.sizes`` is filled in: ``t.numel()`` for a tensor, the caller's value (or 0 when the
    caller gave no ``numels``) for a ``None`` entry.
    """
    op = "flatten"
    out = check_flat_buffer(op, "out", out)
    scale = check_scale(op, scale)
    offsets = _as_int_list(op, "offsets", offsets)
    if len(offsets) != len(tensors):
        raise ValueError(f"{op}: got {len(tensors)} tensors but {len(offsets)} offsets")
    if numels is not None:
        numels = _as_int_list(op, "numels", numels)
        if len(numels) != len(tensors):
            raise ValueError(f"{op}: got {len(tensors)} tensors but {len(numels)} numels")
    items = _scan_items(op, "tensors", tensors, offsets, "out", out, numels, allow_none=True)
    check_ranges(op, "tensors", offsets, items.sizes, "out", out.numel())
    return offsets, items, scale


def validate_unflatten(
    flat: torch.Tensor, offsets: Sequence[int], outs: Sequence[torch.Tensor]
) -> tuple[list[int], ScannedItems]:
    """Check :func:`flashfsdp.kernels.unflatten`'s arguments; return ``(offsets, items)``.

    Unlike ``flatten``'s ranges, ``unflatten``'s source ranges may overlap (reading one element into
    two outputs is well defined); they must lie inside ``flat``.
    """
    op = "unflatten"
    flat = check_flat_buffer(op, "flat", flat)
    offsets = _as_int_list(op, "offsets", offsets)
    if len(offsets) != len(outs):
        raise ValueError(f"{op}: got {len(outs)} outs but {len(offsets)} offsets")
    items = _scan_items(op, "outs", outs, offsets, "flat", flat)
    check_ranges(op, "outs", offsets, items.sizes, "flat", flat.numel(), disjoint=False)
    return offsets, items


def validate_accumulate_grad_shard(src: torch.Tensor, dst: torch.Tensor, scale: float) -> float:
    """Check :func:`flashfsdp.kernels.accumulate_grad_shard`'s arguments; return ``scale``."""
    op = "accumulate_grad_shard"
    src = check_tensor(op, "src", src)
    dst = check_tensor(op, "dst", dst)
    check_same_device(op, "src", src, "dst", dst)
    if src.numel() != dst.numel():
        raise ValueError(
            f"{op}: src has {src.numel()} elements (shape {tuple(src.shape)}) but dst has "
            f"{dst.numel()} (shape {tuple(dst.shape)})"
        )
    _check_aliasing(op, "src", src, "dst", dst, 0)
    return check_scale(op, scale)
