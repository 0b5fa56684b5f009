"""The plain-Python path of the range checks and gap segments (few ranges) agrees with the numpy
path (many ranges): the same gaps, the same error with the same message for the same input."""

from __future__ import annotations

import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashfsdp.kernels import segments, validation
from flashfsdp.kernels.segments import gap_segments
from flashfsdp.kernels.validation import check_ranges

# Offsets around a 40-element buffer, negative and past the end included, sizes 0 upwards.
RANGES = st.lists(st.tuples(st.integers(-3, 45), st.integers(0, 12)), max_size=8)


def _outcome(offsets, numels, disjoint):
    try:
        check_ranges("flatten", "tensors", offsets, numels, "out", 40, disjoint=disjoint)
    except ValueError as exc:
        return str(exc)
    return None


@settings(max_examples=200, deadline=None)
@given(ranges=RANGES, disjoint=st.booleans())
def test_few_ranges_raise_what_the_numpy_path_raises(ranges, disjoint):
    offsets, numels = [o for o, _ in ranges], [n for _, n in ranges]
    few = _outcome(offsets, numels, disjoint)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(validation, "SMALL_RANGE_COUNT", -1)
        assert _outcome(offsets, numels, disjoint) == few


@pytest.mark.parametrize("offsets, numels, message", [
    ([0, -1], [4, 0], "offsets[1]=-1 is negative"),
    ([0, 38], [4, 3], "offsets[1]=38 with tensors[1] of 3 elements ends at 41, past out.numel()=40"),
    ([10, 0, 12], [4, 4, 2], "offsets[2]=12 overlaps tensors[0] which covers [10, 14)"),
    ([2**70], [1], f"offsets[0]={2**70} with tensors[0] of 1 elements ends at {2**70 + 1}, past out.numel()=40"),
])
def test_few_ranges_name_the_first_bad_entry(offsets, numels, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_ranges("flatten", "tensors", offsets, numels, "out", 40)


@settings(max_examples=200, deadline=None)
@given(total_extra=st.integers(0, 5), pieces=st.lists(st.tuples(st.integers(0, 4), st.integers(0, 6)), max_size=10),
       seed=st.integers(0, 2**16))
def test_few_gap_segments_equal_the_numpy_ones(total_extra, pieces, seed):
    starts, lengths, at = [], [], 0
    for gap, length in pieces:  # disjoint ranges, shuffled below
        starts.append(at + gap)
        lengths.append(length)
        at += gap + length
    order = np.random.default_rng(seed).permutation(len(starts)).tolist()
    starts, lengths = [starts[i] for i in order], [lengths[i] for i in order]
    total = at + total_extra
    few = gap_segments(starts, lengths, total)
    many = gap_segments(np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64), total)
    assert len(starts) <= segments.SMALL_RANGE_COUNT
    for a, b in zip(few, many):
        assert a.dtype == b.dtype == np.int64 and a.tolist() == b.tolist()
