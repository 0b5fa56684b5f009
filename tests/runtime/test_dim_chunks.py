"""Shard(k) parameters, k != 0: their layout (``layout.py``) and the torch-op moves between full
tensors and rank-major buffers (``dim_chunks.py``), against ``torch.tensor_split`` at the chunk
boundaries (``torch.chunk``'s sizes, empty chunks past the end)."""

from __future__ import annotations

import pytest
import torch

from flashfsdp.runtime.dim_chunks import chunks_to_full, full_to_chunks
from flashfsdp.runtime.layout import ShardLayout

# (shape, dim, W): even, uneven, ranks with empty chunks, the last dim, a size-1 dim
CASES = [((4, 6), 1, 2), ((3, 5, 2), 1, 4), ((2, 3), 1, 4), ((5, 7), 1, 3), ((2, 2, 5), 2, 2), ((3, 1), 1, 2),
         ((2, 0, 3), 1, 2), ((6, 4), 0, 2)]


def expected_chunks(p: torch.Tensor, dim: int, world_size: int) -> list[torch.Tensor]:
    k = -(-p.shape[dim] // world_size)
    return list(torch.tensor_split(p, [min(r * k, p.shape[dim]) for r in range(1, world_size)], dim))


def layout_of(shape, dim, world_size) -> ShardLayout:
    return ShardLayout.build([(3,), shape, (2, 2)], world_size, align=4, dims=[0, dim, 0])


@pytest.mark.parametrize("shape, dim, world_size", CASES)
def test_layout_chunk_shapes_are_torch_chunks(shape, dim, world_size):
    layout = layout_of(shape, dim, world_size)
    chunks = expected_chunks(torch.zeros(shape), dim, world_size)
    assert [layout.local_shape(r, 1) for r in range(world_size)] == [tuple(c.shape) for c in chunks]
    assert layout.padded_numel(1) == max(c.numel() for c in chunks) or any(d == 0 for d in shape)
    assert layout.strided == ((1,) if dim else ())
    assert {s.param_index for s in layout.segments} == ({0, 2} if dim else {0, 1, 2})
    assert not layout.zero_copy


@pytest.mark.parametrize("shape, dim, world_size", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_to_chunks_and_back(shape, dim, world_size, dtype):
    layout = layout_of(shape, dim, world_size)
    p = torch.randn(shape)
    stride = layout.shard_size + 4  # a reduce-scatter segment: the shard, then flags
    flat = torch.full((world_size * stride,), -7.0, dtype=dtype)
    full_to_chunks(p, layout, 1, flat, stride=stride, scale=0.5)
    for r, chunk in enumerate(expected_chunks(p, dim, world_size)):
        got = flat[r * stride + layout.offsets[1]:][: chunk.numel()].view(chunk.shape)
        torch.testing.assert_close(got, (chunk.to(dtype) * 0.5), rtol=0, atol=0)
        pad = flat[r * stride + layout.offsets[1] + chunk.numel(): r * stride + layout.offsets[1] + layout.padded_numel(1)]
        assert bool((pad == -7.0).all()), "the padding after a chunk is the caller's"
    out = torch.empty(shape)
    chunks_to_full(flat, layout, 1, out, stride=stride)
    torch.testing.assert_close(out, (p.to(dtype) * 0.5).float(), rtol=0, atol=0)


@pytest.mark.parametrize("shape, dim, world_size", [c for c in CASES if c[2] >= 2])
def test_full_to_chunks_of_some_ranks(shape, dim, world_size):
    """A slice of the gathered layout (ranks 1..W-1, the first at offset 0): what a rank keeps
    after forward with ``reshard_after_forward=<int>``."""
    layout = layout_of(shape, dim, world_size)
    p = torch.randn(shape)
    whole = torch.zeros(world_size * layout.shard_size)
    full_to_chunks(p, layout, 1, whole)
    part = torch.zeros((world_size - 1) * layout.shard_size)
    full_to_chunks(p, layout, 1, part, ranks=range(1, world_size))
    torch.testing.assert_close(part, whole[layout.shard_size:], rtol=0, atol=0)


def test_layout_rejects_a_dim_out_of_range():
    with pytest.raises(ValueError, match=r"dims\[0\] = 2 is out of range"):
        ShardLayout.build([(4, 4)], 2, dims=[2])
    with pytest.raises(ValueError, match="1 dims for 2 shapes"):
        ShardLayout.build([(4, 4), (2,)], 2, dims=[1])


def test_one_rank_or_dim_zero_keeps_the_segments():
    assert ShardLayout.build([(4, 6)], 1, dims=[1]).zero_copy  # one rank: the chunk is the parameter
    assert ShardLayout.build([(4, 6)], 1, dims=[1]).strided == ()
    sub = ShardLayout.build([(4, 6), (3, 5)], 2, dims=[1, 0]).sub_layout([True, False])
    assert sub.dims == (1,) and sub.strided == (0,)
