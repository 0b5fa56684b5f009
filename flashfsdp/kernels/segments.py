"""Host-side bookkeeping of the multi-tensor ops: which element ranges of a flat buffer are covered.

Pure Python; no Triton and no device work, so the reference path uses it too.
"""

from __future__ import annotations

from typing import Iterable


def uncovered_ranges(ranges: Iterable[tuple[int, int]], total: int) -> list[tuple[int, int]]:
    """The parts of ``[0, total)`` that no ``(offset, numel)`` range covers, as ``(start, stop)``.

    ``ranges`` may come in any order and must be disjoint (validation guarantees it); empty ranges
    are ignored. The result is sorted and holds no empty range.
    """
    gaps = []
    position = 0
    for offset, numel in sorted(r for r in ranges if r[1] > 0):
        if offset > position:
            gaps.append((position, offset))
        position = offset + numel
    if total > position:
        gaps.append((position, total))
    return gaps
