"""flatten: many tensors -> one flat buffer with cast, scale and zeroed gaps, on every path."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flashfsdp.kernels import dispatch, reference
from flashfsdp.kernels import flatten as flatten_op
from flashfsdp.kernels.flatten import BLOCK
from tests.kernels.conftest import kernel_device
from tests.kernels.spec import (
    DTYPE_PAIRS,
    DTYPES,
    assert_same,
    dtype_id,
    overflow_is_expected,
    expected_flatten,
    many_small_tensors,
    nan_buffer,
    random_tensor,
    special_values,
)

SHAPES = [(0,), (1,), (123, 77)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=dtype_id)
@pytest.mark.parametrize("offset", [8, 3], ids=["aligned", "unaligned"])
def test_one_tensor_every_dtype_pair(ops, device, shape, dtypes, offset):
    in_dtype, out_dtype = dtypes
    tensor = random_tensor(shape, in_dtype, device)
    numel = offset + tensor.numel() + 5
    out = nan_buffer(numel, out_dtype, device)
    result = ops.flatten([tensor], [offset], out)
    assert result is out
    assert_same(out, expected_flatten([tensor], [offset], numel, out_dtype))


@pytest.mark.parametrize("out_dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("scale", [1.0, 0.37, -3.0])
def test_mixed_dtypes_none_noncontiguous_and_gaps(ops, device, out_dtype, scale):
    transposed = random_tensor((7, 13), torch.float32, device, seed=1).t()
    assert not transposed.is_contiguous()
    tensors = [
        random_tensor((3, 5), torch.bfloat16, device, seed=2),
        None,
        transposed,
        random_tensor((BLOCK + 3,), torch.float16, device, seed=3),
        random_tensor((0,), torch.float32, device),
        random_tensor((2, 2), torch.float32, device, seed=4),
    ]
    numels = [15, 6, 91, BLOCK + 3, 0, 4]
    # Not sorted, with gaps between all ranges and at both ends.
    offsets = [130, 4, 20, 200, 15, 120]
    numel = 200 + BLOCK + 3 + 9
    out = nan_buffer(numel, out_dtype, device)
    ops.flatten(tensors, offsets, out, scale=scale, numels=numels)
    assert_same(out, expected_flatten(tensors, offsets, numel, out_dtype, scale))


def test_none_entries_without_numels_and_empty_list(ops, device):
    out = nan_buffer(10, torch.float32, device)
    ops.flatten([None, torch.ones(2, device=device)], [3, 4], out)
    assert_same(out, expected_flatten([None, torch.ones(2)], [3, 4], 10, torch.float32))
    out = nan_buffer(6, torch.bfloat16, device)
    ops.flatten([], [], out)
    assert_same(out, torch.zeros(6, dtype=torch.bfloat16))


def test_hundreds_of_small_tensors(ops, device):
    tensors, offsets, numel = many_small_tensors(device)
    out = nan_buffer(numel, torch.bfloat16, device)
    ops.flatten(tensors, offsets, out, scale=0.5)
    assert_same(out, expected_flatten(tensors, offsets, numel, torch.bfloat16, 0.5))


@overflow_is_expected
@pytest.mark.parametrize("out_dtype", DTYPES, ids=dtype_id)
def test_round_to_nearest_even_at_the_edges(ops, device, out_dtype):
    values = special_values().to(device)
    out = nan_buffer(values.numel() + 2, out_dtype, device)
    ops.flatten([values], [1], out)
    assert_same(out, expected_flatten([values], [1], values.numel() + 2, out_dtype))


def test_exact_alias_is_a_cast_free_copy(ops, device):
    out = random_tensor((20,), torch.float32, device)
    before = out.clone()
    ops.flatten([out[4:10]], [4], out)
    assert_same(out, expected_flatten([before[4:10]], [4], 20, torch.float32))


@st.composite
def layouts(draw, max_tensors):
    """Random (sizes, dtypes, gaps, order, out dtype, scale) for a flatten call."""
    count = draw(st.integers(0, max_tensors))
    sizes = draw(st.lists(st.integers(0, 40), min_size=count, max_size=count))
    gaps = draw(st.lists(st.integers(0, 9), min_size=count + 1, max_size=count + 1))
    dtypes = draw(st.lists(st.sampled_from(DTYPES), min_size=count, max_size=count))
    is_none = draw(st.lists(st.booleans(), min_size=count, max_size=count))
    order = draw(st.permutations(range(count)))
    out_dtype = draw(st.sampled_from(DTYPES))
    scale = draw(st.sampled_from([1.0, 0.125, -2.5]))
    return sizes, gaps, dtypes, is_none, order, out_dtype, scale


def check_random_layout(flatten, layout, device):
    sizes, gaps, dtypes, is_none, order, out_dtype, scale = layout
    offsets, position = [], 0
    for gap, size in zip(gaps, sizes):
        position += gap
        offsets.append(position)
        position += size
    numel = position + gaps[-1]
    tensors = [
        None if none else random_tensor((size,), dtype, device, seed=i)
        for i, (size, dtype, none) in enumerate(zip(sizes, dtypes, is_none))
    ]
    tensors, offsets, sizes = ([seq[i] for i in order] for seq in (tensors, offsets, sizes))
    out = nan_buffer(numel, out_dtype, device)
    flatten(tensors, offsets, out, scale=scale, numels=sizes)
    assert_same(out, expected_flatten(tensors, offsets, numel, out_dtype, scale))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(max_tensors=12))
def test_property_reference(layout):
    check_random_layout(reference.flatten, layout, kernel_device())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts(max_tensors=12))
def test_property_triton(layout):
    if dispatch.triton_device_type() is None:
        pytest.skip("triton cannot be imported")
    with dispatch.use_triton():
        check_random_layout(flatten_op, layout, kernel_device())


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=dtype_id)
def test_past_2_to_31_elements(cuda_triton_ops, out_dtype):
    """64-bit offsets: ranges across and past element 2^31 (byte 2^32 for bf16, 2^33 for fp32)."""
    device = torch.device("cuda")
    out = torch.full((2**31 + 3 * BLOCK,), float("nan"), dtype=out_dtype, device=device)
    big = random_tensor((2 * BLOCK + 17,), torch.bfloat16, device, seed=6)
    small = random_tensor((1000,), torch.float32, device, seed=5)
    big_at, small_at = 2**31 - BLOCK, 2**31 + BLOCK + 100  # big straddles element 2^31
    big_end, small_end = big_at + big.numel(), small_at + small.numel()
    cuda_triton_ops.flatten([small, big], [small_at, big_at], out, scale=0.5)
    assert_same(out[big_at:big_end], (big.float() * 0.5).to(out_dtype))
    assert_same(out[small_at:small_end], (small.float() * 0.5).to(out_dtype))
    for gap in (out[:big_at], out[big_end:small_at], out[small_end:]):
        assert torch.count_nonzero(gap) == 0  # nan counts as nonzero: every gap element was written


@overflow_is_expected
@pytest.mark.parametrize("out_dtype", DTYPES, ids=dtype_id)
def test_random_bit_patterns_round_like_torch(ops, device, out_dtype):
    """Every fp32 bit pattern class (normals, subnormals, inf, nan payloads) casts like torch's
    ``Tensor.to``: 4096 patterns on CPU, 2^24 on a GPU."""
    count = 2**24 if device.type == "cuda" else 2**12
    generator = torch.Generator().manual_seed(11)
    bits = torch.randint(-(2**31), 2**31 - 1, (count,), dtype=torch.int32, generator=generator)
    values = bits.view(torch.float32).to(device)
    out = torch.empty(count, dtype=out_dtype, device=device)
    ops.flatten([values], [0], out)
    assert_same(out, values.to(out_dtype))
