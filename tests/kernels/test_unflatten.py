"""unflatten: one flat buffer -> many tensors with cast, on every path."""

import pytest
import torch

from flashfsdp.kernels.unflatten import BLOCK
from tests.kernels.spec import (
    DTYPE_PAIRS,
    DTYPES,
    assert_same,
    dtype_id,
    overflow_is_expected,
    expected_unflatten,
    many_small_tensors,
    random_tensor,
    special_values,
)

SHAPES = [(0,), (1,), (123, 77)]


def nan_outputs(shapes_and_dtypes, device):
    return [torch.full(shape, float("nan"), dtype=dtype, device=device) for shape, dtype in shapes_and_dtypes]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=dtype_id)
@pytest.mark.parametrize("offset", [16, 3], ids=["aligned", "unaligned"])
def test_one_output_every_dtype_pair(ops, device, shape, dtypes, offset):
    flat_dtype, out_dtype = dtypes
    numel = torch.Size(shape).numel()
    flat = random_tensor((offset + numel + 4,), flat_dtype, device)
    outs = nan_outputs([(shape, out_dtype)], device)
    assert ops.unflatten(flat, [offset], outs) is None
    assert_same(outs[0], expected_unflatten(flat, [offset], [(shape, out_dtype)])[0])


@pytest.mark.parametrize("flat_dtype", DTYPES, ids=dtype_id)
def test_mixed_output_dtypes_noncontiguous_and_overlapping_reads(ops, device, flat_dtype):
    flat = random_tensor((BLOCK + 300,), flat_dtype, device, seed=1)
    shapes_and_dtypes = [
        ((3, 5), torch.bfloat16),
        ((BLOCK + 7,), torch.float16),
        ((0, 4), torch.float32),
        ((13, 7), torch.float32),  # written through a transposed (non-contiguous) view below
        ((2, 2), torch.bfloat16),
    ]
    offsets = [200, 9, 0, 100, 205]  # unsorted; [200, 215) and [205, 209) are read twice
    outs = nan_outputs(shapes_and_dtypes, device)
    storage = torch.full((7, 13), float("nan"), device=device)
    outs[3] = storage.t()
    assert not outs[3].is_contiguous()
    ops.unflatten(flat, offsets, outs)
    for out, expected in zip(outs, expected_unflatten(flat, offsets, shapes_and_dtypes)):
        assert_same(out, expected)
    assert_same(storage, expected_unflatten(flat, [100], [((13, 7), torch.float32)])[0].t())


def test_hundreds_of_small_outputs(ops, device):
    templates, offsets, numel = many_small_tensors(device)
    flat = random_tensor((numel,), torch.float32, device, seed=7)
    shapes_and_dtypes = [(t.shape, t.dtype) for t in templates]
    outs = nan_outputs(shapes_and_dtypes, device)
    ops.unflatten(flat, offsets, outs)
    for out, expected in zip(outs, expected_unflatten(flat, offsets, shapes_and_dtypes)):
        assert_same(out, expected)


@overflow_is_expected
@pytest.mark.parametrize("out_dtype", DTYPES, ids=dtype_id)
def test_round_to_nearest_even_at_the_edges(ops, device, out_dtype):
    flat = special_values().to(device)
    shapes_and_dtypes = [((flat.numel(),), out_dtype)]
    outs = nan_outputs(shapes_and_dtypes, device)
    ops.unflatten(flat, [0], outs)
    assert_same(outs[0], expected_unflatten(flat, [0], shapes_and_dtypes)[0])


def test_flatten_then_unflatten_round_trips(ops, device):
    tensors = [random_tensor(shape, dtype, device, seed=i)
               for i, (shape, dtype) in enumerate([((4, 3), torch.float32), ((5,), torch.bfloat16), ((1,), torch.float16)])]
    offsets = [0, 16, 24]
    flat = torch.empty(32, dtype=torch.float32, device=device)
    ops.flatten(tensors, offsets, flat)
    outs = [torch.empty_like(t) for t in tensors]
    ops.unflatten(flat, offsets, outs)
    for out, tensor in zip(outs, tensors):
        assert_same(out, tensor)


@pytest.mark.gpu
def test_past_2_to_31_elements(cuda_triton_ops):
    """64-bit offsets: reads past element 2^31 (byte 2^32) of a bf16 flat buffer."""
    device = torch.device("cuda")
    flat = torch.zeros(2**31 + 2 * BLOCK, dtype=torch.bfloat16, device=device)
    flat[2**31 - 100 : 2**31 + BLOCK] = random_tensor((BLOCK + 100,), torch.bfloat16, device, seed=8)
    outs = [torch.empty(BLOCK + 100, dtype=torch.float32, device=device),
            torch.empty(7, dtype=torch.float16, device=device)]
    cuda_triton_ops.unflatten(flat, [2**31 - 100, 2**31 + 3], outs)
    assert_same(outs[0], flat[2**31 - 100 : 2**31 + BLOCK].float())
    assert_same(outs[1], flat[2**31 + 3 : 2**31 + 10].half())
