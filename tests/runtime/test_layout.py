"""ShardLayout: FSDP2's dim-0 chunks packed per rank, alignment, segments, the zero-copy cases."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from flashfsdp.runtime.layout import ShardLayout, align_elements


def test_align_elements_covers_every_dtype():
    assert align_elements([4, 2]) == 8  # 16 bytes in bf16, 32 in fp32
    assert align_elements([4]) == 4
    with pytest.raises(ValueError, match="item size 3"):
        align_elements([3])
    with pytest.raises(ValueError, match="empty"):
        align_elements([])


def test_chunks_are_fsdp2s_and_offsets_aligned():
    # (5, 3): k = 2 rows per rank at W = 4 -> chunks of 2, 2, 1, 0 rows; (7,): k = 2 -> 2, 2, 2, 1
    layout = ShardLayout.build([(5, 3), (7,), (0, 4)], world_size=4, align=8)
    assert layout.offsets == (0, 8, 16) and layout.shard_size == 16
    assert [layout.local_rows(r, 0) for r in range(4)] == [2, 2, 1, 0]
    assert [layout.local_shape(r, 1) for r in range(4)] == [(2,), (2,), (2,), (1,)]
    assert layout.local_shape(3, 0) == (0, 3) and layout.local_shape(0, 2) == (0, 4)
    assert layout.gathered_size == 64 and not layout.zero_copy
    assert all(o % 8 == 0 for o in layout.unsharded_offsets) and layout.unsharded_size >= 15 + 7


def test_zero_copy_at_one_rank_and_for_one_parameter_filling_the_shard():
    assert ShardLayout.build([(5, 3), (7,)], world_size=1, align=4).zero_copy
    single = ShardLayout.build([(8, 4)], world_size=2, align=4)  # 4 rows x 4 = 16 = S
    assert single.zero_copy and single.unsharded_size == single.gathered_size
    assert not ShardLayout.build([(7, 3)], world_size=2, align=8).zero_copy  # a 12-element chunk, S = 16
    assert ShardLayout.build([(7, 4)], world_size=2, align=4).zero_copy  # 4 rows x 4 = 16 = S


@settings(max_examples=200, deadline=None)
@given(
    shapes=st.lists(st.tuples(st.integers(0, 9), st.integers(1, 4)), max_size=6),
    world_size=st.integers(1, 6),
    align=st.sampled_from([1, 2, 4, 8]),
)
def test_segments_move_every_parameter_exactly_as_torch_chunk(shapes, world_size, align):
    """Packing full tensors by the segments into the gathered layout gives each rank's shard
    torch.chunk's rows at the parameter's offset; copy-out by the same segments restores them."""
    layout = ShardLayout.build(shapes, world_size, align)
    fulls = [torch.randn(shape) for shape in shapes]
    gathered = torch.full((layout.gathered_size,), float("nan"))
    for s in layout.segments:
        gathered[s.gathered_offset : s.gathered_offset + s.numel] = fulls[s.param_index].reshape(-1)[
            s.param_offset : s.param_offset + s.numel]
    S = layout.shard_size
    for r in range(world_size):
        for i, full in enumerate(fulls):
            chunks = list(torch.chunk(full, world_size, dim=0)) if full.shape[0] else []
            want = chunks[r] if r < len(chunks) else full[:0]
            assert layout.local_shape(r, i) == tuple(want.shape)
            o = r * S + layout.offsets[i]
            assert torch.equal(gathered[o : o + want.numel()].view(want.shape), want)
    unsharded = torch.full((layout.unsharded_size,), float("nan"))
    for s in layout.segments:
        u = layout.unsharded_offsets[s.param_index] + s.param_offset
        unsharded[u : u + s.numel] = gathered[s.gathered_offset : s.gathered_offset + s.numel]
    for i, full in enumerate(fulls):
        u = layout.unsharded_offsets[i]
        assert torch.equal(unsharded[u : u + full.numel()].view(full.shape), full)
    if layout.zero_copy:  # the gathered buffer is the unsharded layout itself
        for i, full in enumerate(fulls):
            u = layout.unsharded_offsets[i]
            assert torch.equal(gathered[u : u + full.numel()].view(full.shape), full)


def test_sub_layout_keeps_world_size_and_alignment():
    layout = ShardLayout.build([(5, 3), (7,), (2, 2)], world_size=2, align=4)
    sub = layout.sub_layout([True, False, True])
    assert sub.shapes == ((5, 3), (2, 2)) and sub.world_size == 2 and sub.align == 4
    assert sub.shard_size < layout.shard_size


def test_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        ShardLayout.build([(3,)], 0)
    with pytest.raises(ValueError, match="align must be >= 1"):
        ShardLayout.build([(3,)], 2, align=0)
    with pytest.raises(ValueError, match=r"shapes\[1\] is 0-dim"):
        ShardLayout.build([(3,), ()], 2)
    with pytest.raises(ValueError, match=r"shapes\[0\] = \(3, -1\) has a negative size"):
        ShardLayout.build([(3, -1)], 2)
