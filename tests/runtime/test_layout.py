"""FlatLayout: alignment, padding to W, rank ranges and local pieces."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flashfsdp.runtime.layout import FlatLayout, align_elements


def test_align_elements_covers_every_dtype():
    assert align_elements([4, 2]) == 8  # 16 bytes in bf16, 32 in fp32
    assert align_elements([4]) == 4
    with pytest.raises(ValueError, match="item size 3"):
        align_elements([3])
    with pytest.raises(ValueError, match="empty"):
        align_elements([])


def test_offsets_are_aligned_and_total_padded_to_world_size():
    layout = FlatLayout.build([5, 1, 0, 7], world_size=4, align=8)
    assert layout.offsets == (0, 8, 16, 16)
    assert all(o % 8 == 0 for o in layout.offsets)
    assert layout.shard_size % 8 == 0 and layout.total == 4 * layout.shard_size >= layout.used == 23


@settings(max_examples=200, deadline=None)
@given(
    numels=st.lists(st.integers(0, 50), max_size=12),
    world_size=st.integers(1, 8),
    align=st.sampled_from([1, 2, 4, 8]),
)
def test_pieces_partition_every_parameter(numels, world_size, align):
    layout = FlatLayout.build(numels, world_size, align)
    covered = [0] * len(numels)
    for rank in range(world_size):
        lo, hi = layout.rank_range(rank)
        for pc in layout.local_pieces(rank):
            assert lo <= pc.flat_start <= pc.flat_end <= hi
            assert pc.shard_end - pc.shard_start == pc.numel
            if pc.numel:
                assert pc.flat_start == layout.offsets[pc.param_index] + pc.param_start
            covered[pc.param_index] += pc.numel
    assert covered == list(numels)


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        FlatLayout.build([3], 0)
    with pytest.raises(ValueError, match=r"numels\[1\] is negative"):
        FlatLayout.build([3, -1], 2)
    with pytest.raises(ValueError, match="rank 2 is outside"):
        FlatLayout.build([3], 2).rank_range(2)
