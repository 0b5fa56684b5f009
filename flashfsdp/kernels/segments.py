"""Host-side bookkeeping of the multi-tensor ops: covered ranges of a flat buffer, segment tables.

No Triton here: the reference path uses :func:`gap_segments` too, and the Triton launchers
build their device tables with :func:`segment_table`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

import numpy as np
import torch


def gap_segments(
    starts: Sequence[int] | np.ndarray, lengths: Sequence[int] | np.ndarray, total: int
) -> tuple[np.ndarray, np.ndarray]:
    """The parts of ``[0, total)`` that no range ``[starts[i], starts[i] + lengths[i])`` covers.

    The ranges may come in any order and must be disjoint (validation guarantees it); empty ranges
    are ignored. Returns ``(gap_starts, gap_lengths)``: int64 arrays, sorted, every length > 0.
    Vectorised (numpy), so a unit of thousands of tensors costs microseconds; up to
    ``SMALL_RANGE_COUNT`` ranges given as lists, plain Python (cheaper than numpy's per-call cost).
    """
    if isinstance(starts, list) and isinstance(lengths, list) and len(starts) <= SMALL_RANGE_COUNT:
        return _few_gap_segments(starts, lengths, total)
    starts = np.asarray(starts, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    nonempty = lengths > 0
    order = np.argsort(starts[nonempty], kind="stable")
    begins = starts[nonempty][order]
    ends = begins + lengths[nonempty][order]
    gap_starts = np.concatenate(([0], ends))
    gap_lengths = np.concatenate((begins, [total])) - gap_starts
    keep = gap_lengths > 0
    return gap_starts[keep], gap_lengths[keep]


# Up to this many ranges, gap_segments (and validation.check_ranges) run in plain Python.
SMALL_RANGE_COUNT = 64


def _few_gap_segments(starts: list[int], lengths: list[int], total: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`gap_segments` of a few ranges in plain Python; the same arrays."""
    gap_starts, gap_lengths, end = [], [], 0
    for begin, length in sorted((s, n) for s, n in zip(starts, lengths) if n > 0):
        if begin > end:
            gap_starts.append(end)
            gap_lengths.append(begin - end)
        end = begin + length
    if total > end:
        gap_starts.append(end)
        gap_lengths.append(total - end)
    return np.array(gap_starts, dtype=np.int64), np.array(gap_lengths, dtype=np.int64)


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
# float64 never reaches a kernel (an op with a float64 tensor runs the reference, in float64); its
# code only lets the shared validation describe it.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 8}
ZERO_CODE = 3
ALIGNED_FLAG = 4
ALIGNMENT_BYTES = 16


def segment_table(
    addresses: Sequence[int] | np.ndarray,
    codes: Sequence[int] | np.ndarray,
    flat_offsets: Sequence[int] | np.ndarray,
    numels: Sequence[int] | np.ndarray,
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
        ``flat``'s device and the number of programs to launch. Off the CPU the table comes from
        :data:`DEVICE_TABLES`: uploaded from pinned memory without a host sync the first time,
        reused while the launch's table stays the same (see [Note: cached device tables]); it
        must not be written to.
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
    if flat.device.type == "cpu":
        return torch.from_numpy(table), int(blocks.sum())
    return DEVICE_TABLES.get(table, flat.device), int(blocks.sum())


# [Note: cached device tables]
# A launch's table lists its tensors' addresses, so it can change from call to call; but in a
# training loop the caching allocator hands each step's gradients (and a unit's other tensors) the
# same blocks as the step before, so the table a unit's launch builds is, step after step, the
# same bytes. DeviceTables keeps the device copy of each table it uploaded, keyed by the table's
# bytes, device and the stream of the launch, and a launch whose table equals one of them reuses
# it: no pinned staging buffer, no host-to-device copy. A cached table is never written again (a
# different table is a different entry), so reuse cannot race a kernel still reading it; keying
# on the stream keeps every launch that reads it stream-ordered after its upload, and the
# allocator frees an evicted table on that same stream, after the kernels that read it.
class DeviceTables:
    """Device copies of segment tables, reused when a launch's table is byte-for-byte one of them.

    See [Note: cached device tables]. A table takes 40 bytes per segment on the device, and as
    much again on the host for its key; least recently used tables go first once the cached
    tables pass ``capacity_bytes`` (the newest one always stays).

    Args:
        capacity_bytes: bytes of tables kept on the device (> 0; default 16 MiB: 256 tables of
            1 600 segments).

    Raises:
        ValueError: ``capacity_bytes`` < 1.
    """

    def __init__(self, capacity_bytes: int = 16 << 20):
        if capacity_bytes < 1:
            raise ValueError(f"DeviceTables: capacity_bytes must be >= 1, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._tables: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self.nbytes = 0
        self.hits = self.uploads = 0

    def get(self, table: np.ndarray, device: torch.device, stream: int | None = None) -> torch.Tensor:
        """The table on ``device``, for a launch on ``stream`` (default: the device's current
        stream's handle; CPU: 0): a cached copy if one holds the same bytes, else a new upload
        (from pinned memory, without a host sync on CUDA)."""
        device = torch.device(device)
        if stream is None:
            stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
        key = (device, stream, table.shape, table.tobytes())
        cached = self._tables.get(key)
        if cached is not None:
            self._tables.move_to_end(key)
            self.hits += 1
            return cached
        host = torch.from_numpy(np.array(table, dtype=np.int64, order="C"))  # a copy: the cache owns it
        if device.type == "cuda":
            host = host.pin_memory()
        uploaded = host.to(device, non_blocking=True)
        self._tables[key] = uploaded
        self.nbytes += table.nbytes
        self.uploads += 1
        while self.nbytes > self.capacity_bytes and len(self._tables) > 1:
            (*_, old_bytes), _ = self._tables.popitem(last=False)
            self.nbytes -= len(old_bytes)
        return uploaded

    def clear(self) -> None:
        """Drop every cached table (and zero the counters)."""
        self._tables.clear()
        self.nbytes = self.hits = self.uploads = 0

    def __len__(self) -> int:
        return len(self._tables)


DEVICE_TABLES = DeviceTables()
