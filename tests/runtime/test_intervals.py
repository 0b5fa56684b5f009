"""flashfsdp.runtime.intervals: the union of intervals and each interval's share of it."""

from __future__ import annotations

import pytest

from flashfsdp.runtime.intervals import union_length, union_shares


def test_union_of_overlapping_nested_and_disjoint_intervals():
    intervals = [(5.0, 9.0), (0.0, 4.0), (2.0, 3.0), (3.0, 6.0), (10.0, 12.0)]
    assert union_length(intervals) == pytest.approx(11.0)  # [0, 9] and [10, 12]
    shares = union_shares(intervals, lambda interval: interval)
    # by (start, end); each counts only what no earlier one covered
    assert shares == [((0.0, 4.0), 4.0), ((2.0, 3.0), 0.0), ((3.0, 6.0), 2.0), ((5.0, 9.0), 3.0),
                      ((10.0, 12.0), 2.0)]
    assert union_length([]) == 0.0


def test_shares_of_objects_through_their_bounds():
    spans = [{"name": "b", "t": (1, 3)}, {"name": "a", "t": (0, 2)}]
    assert [(s["name"], share) for s, share in union_shares(spans, lambda s: s["t"])] == [("a", 2), ("b", 1)]
