"""Flat layout of one unit: element offsets, alignment, padding to the world size, rank ranges.

A unit's parameters p_0..p_{n-1} are laid end to end in one flat buffer of T = W·S elements.
Every offset is aligned to ``align`` elements so that each parameter starts on a 16-byte boundary in
every dtype the unit uses, and T is padded to a multiple of W·align so that every rank's range
[r·S, (r+1)·S) starts on such a boundary too. Rank r owns that range; each parameter's *local piece*
on rank r is the parameter's range intersected with the rank's range (possibly empty).

The flat layout follows fairscale's ``FlattenParamsWrapper`` and FSDP1's ``FlatParameter``; the
alignment follows YaFSDP. Pure arithmetic: no tensors, no torch.distributed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

ALIGN_BYTES = 16


def align_elements(itemsizes: Sequence[int], align_bytes: int = ALIGN_BYTES) -> int:
    """Number of elements that is a multiple of ``align_bytes`` bytes in every given item size.

    Args:
        itemsizes: element sizes in bytes of every dtype the flat buffers use (e.g. 4 for the fp32
            master shard, 2 for a bf16 ``param_dtype``).
        align_bytes: the byte alignment wanted (16 by default: one 128-bit vector access).

    Returns:
        ``align_bytes // min(itemsizes)`` (at least 1).

    Raises:
        ValueError: if ``itemsizes`` is empty or holds a size that does not divide ``align_bytes``.
    """
    if not itemsizes:
        raise ValueError("align_elements: itemsizes is empty")
    for size in itemsizes:
        if size <= 0 or align_bytes % size:
            raise ValueError(f"align_elements: item size {size} does not divide {align_bytes} bytes")
    return max(1, align_bytes // min(itemsizes))


@dataclass(frozen=True)
class LocalPiece:
    """The part of one parameter that one rank owns.

    Attributes:
        param_index: index of the parameter in the layout.
        flat_start, flat_end: the piece's range in the flat buffer (elements, end exclusive).
        shard_start, shard_end: the same range relative to the rank's shard (0 <= start <= end <= S).
        param_start: offset of the piece inside the flattened parameter (elements).
    """

    param_index: int
    flat_start: int
    flat_end: int
    shard_start: int
    shard_end: int
    param_start: int

    @property
    def numel(self) -> int:
        """Number of elements in the piece (0 when the rank owns none of the parameter)."""
        return self.flat_end - self.flat_start


@dataclass(frozen=True)
class FlatLayout:
    """Offsets, padding and per-rank ranges of one flat buffer.

    Attributes:
        numels: element count of each parameter.
        offsets: element offset of each parameter in the flat buffer (aligned, increasing).
        world_size: W, the number of ranks the buffer is sharded over.
        align: alignment of every offset and of the shard size, in elements.
        shard_size: S, the elements each rank owns (a multiple of ``align``).
    """

    numels: tuple[int, ...]
    offsets: tuple[int, ...]
    world_size: int
    align: int
    shard_size: int

    @classmethod
    def build(cls, numels: Sequence[int], world_size: int, align: int = 1) -> "FlatLayout":
        """Lay parameters of the given sizes end to end, aligned, padded to a multiple of W·align.

        Args:
            numels: element count of each parameter (>= 0).
            world_size: W >= 1.
            align: element alignment of each offset and of S (>= 1).

        Raises:
            ValueError: on a negative numel, W < 1 or align < 1.
        """
        if world_size < 1:
            raise ValueError(f"FlatLayout: world_size must be >= 1, got {world_size}")
        if align < 1:
            raise ValueError(f"FlatLayout: align must be >= 1, got {align}")
        offsets = []
        cursor = 0
        for i, n in enumerate(numels):
            if n < 0:
                raise ValueError(f"FlatLayout: numels[{i}] is negative ({n})")
            cursor = _round_up(cursor, align)
            offsets.append(cursor)
            cursor += n
        shard = _round_up(_ceil_div(cursor, world_size), align)
        return cls(tuple(int(n) for n in numels), tuple(offsets), world_size, align, shard)

    @property
    def total(self) -> int:
        """T = W·S, the padded length of the unsharded flat buffer (elements)."""
        return self.world_size * self.shard_size

    @property
    def used(self) -> int:
        """Elements up to the end of the last parameter (T minus the tail padding)."""
        if not self.numels:
            return 0
        return self.offsets[-1] + self.numels[-1]

    def rank_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank ``rank``'s shard in the flat buffer (elements)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"FlatLayout: rank {rank} is outside [0, {self.world_size})")
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def local_pieces(self, rank: int) -> list[LocalPiece]:
        """Each parameter's piece owned by ``rank``, in parameter order (empty pieces included).

        An empty piece has ``flat_start == flat_end`` clamped into the rank's range, so that it can
        still be expressed as an (empty) slice of the shard.
        """
        lo, hi = self.rank_range(rank)
        pieces = []
        for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
            start = min(max(off, lo), hi)
            end = max(min(off + n, hi), start)
            pieces.append(LocalPiece(i, start, end, start - lo, end - lo, start - off if end > start else 0))
        return pieces


def _round_up(x: int, multiple: int) -> int:
    return _ceil_div(x, multiple) * multiple


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)
