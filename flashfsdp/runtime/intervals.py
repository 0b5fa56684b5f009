"""The union of time intervals: how long a set of possibly overlapping [start, end] intervals keeps
a stream busy, and each interval's share of it.

One implementation for the trace (``Profile.summary``'s busy time per communication stream), the
overlap simulator (``Prediction.comm_busy_s``) and the analysis of measured traces
(``flashfsdp.sim.calibrate``), so that measured and predicted busy times are counted alike.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence, TypeVar

T = TypeVar("T")


def union_shares(items: Sequence[T], bounds: Callable[[T], tuple[float, float]]) -> list[tuple[T, float]]:
    """Each item with its share of the union of the items' intervals.

    The items are taken in order of their intervals' (start, end); each counts only the part of its
    interval after every earlier one ended, so the shares sum to the union's length.

    Args:
        items: anything with an interval.
        bounds: ``item -> (start, end)``.

    Returns:
        ``[(item, share), ...]`` in that order (shares >= 0, in the intervals' unit).
    """
    out, cursor = [], float("-inf")
    for item, (start, end) in sorted(((item, bounds(item)) for item in items), key=lambda pair: pair[1]):
        out.append((item, max(0.0, end - max(start, cursor))))
        cursor = max(cursor, end)
    return out


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals (0.0 for none)."""
    return sum(share for _, share in union_shares(list(intervals), lambda interval: interval))
