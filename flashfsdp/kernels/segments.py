"""Host-side bookkeeping of the multi-tensor ops: covered ranges of a flat buffer, segment tables.

No Triton here: the reference path uses :func:`uncovered_ranges` too, and the Triton launchers
build their device tables with :func:`segment_table`.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np
import torch


def uncovered_ranges(ranges: Iterable[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    """The parts of ``[0, total)`` that no ``(offset, numel)`` range covers, as ``(start, stop)``.

    ``ranges`` may come in any order and must be disjoint (validation guarantees it); empty ranges
    are ignored. The result is sorted and holds no empty range.
    """
    gaps = []
    position = 0
    for offset, numel in sorted(ranges):
        if numel == 0:
            continue
        if offset > position:
            gaps.append((position, offset))
        position = offset + numel
    if total > position:
        gaps.append((position, total))
    return gaps


# [Note: segment tables]
# The multi-tensor kernels (flatten, unflatten) take one int64 table with a row per *segment*: a
# contiguous run of elements between one tensor (or nothing, for a zeroed gap) and a range of the
# flat buffer. Columns:
#   ADDRESS      the tensor's data_ptr() in bytes (0 for a gap)
#   CODE         the tensor's dtype code (DTYPE_CODES, or ZERO_CODE for a gap), OR-ed with
#                ALIGNED_FLAG when both the tensor and its range of the flat buffer start 16-byte
#                aligned (the kernel may then use unmasked 16-byte vector accesses)
#   FLAT_OFFSET  the first element of the range in the flat buffer
#   NUMEL        the segment's length in elements (> 0)
#   FIRST_BLOCK  the first program id that serves the segment: an exclusive prefix sum of
#                ceil(NUMEL / BLOCK) over the rows
# The kernel's grid has one program per BLOCK elements of every segment; program `pid` finds its
# segment by binary search on FIRST_BLOCK (the last row with FIRST_BLOCK <= pid). A huge tensor
# thus gets many programs and a tiny one exactly one, whatever their mix, with no per-block map
# to build on the host; the search costs log2(rows) cached scalar loads per program.
TABLE_COLUMNS = 5
ADDRESS, CODE, FLAT_OFFSET, NUMEL, FIRST_BLOCK = range(TABLE_COLUMNS)
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ZERO_CODE = 3
ALIGNED_FLAG = 4
ALIGNMENT_BYTES = 16


def segment_table(
    addresses: Sequence[int],
    codes: Sequence[int],
    flat_offsets: Sequence[int],
    numels: Sequence[int],
    flat: torch.Tensor,
    block: int,
) -> tuple[torch.Tensor, int]:
    """Build the device table of [Note: segment tables] for segments over ``flat``.

    Args:
        addresses, codes, flat_offsets, numels: one entry per segment, every numel > 0.
        flat: the flat buffer (its address decides alignment, its device where the table goes).
        block: elements per program.

    Returns:
        ``(table, n_blocks)``: an int64 tensor of shape ``[len(numels), TABLE_COLUMNS]`` on
        ``flat``'s device (copied from pinned memory without a host sync on CUDA) and the number
        of programs to launch.
    """
    addresses = np.asarray(addresses, dtype=np.int64)
    flat_offsets = np.asarray(flat_offsets, dtype=np.int64)
    numels = np.asarray(numels, dtype=np.int64)
    flat_addresses = flat.data_ptr() + flat_offsets * flat.element_size()
    aligned = (addresses % ALIGNMENT_BYTES == 0) & (flat_addresses % ALIGNMENT_BYTES == 0)
    blocks = (numels + block - 1) // block
    table = np.empty((len(numels), TABLE_COLUMNS), dtype=np.int64)
    table[:, ADDRESS] = addresses
    table[:, CODE] = np.asarray(codes, dtype=np.int64) | np.where(aligned, ALIGNED_FLAG, 0)
    table[:, FLAT_OFFSET] = flat_offsets
    table[:, NUMEL] = numels
    table[:, FIRST_BLOCK] = np.cumsum(blocks) - blocks
    device_table = torch.from_numpy(table)
    if flat.device.type != "cpu":
        device_table = device_table.pin_memory().to(flat.device, non_blocking=True)
    return device_table, int(blocks.sum())
