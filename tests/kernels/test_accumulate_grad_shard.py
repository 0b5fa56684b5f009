"""accumulate_grad_shard: reduced shard -> master gradient, with squared norm and inf/nan flag."""

import pytest
import torch

from flashfsdp.kernels.accumulate_grad_shard import BLOCK
from tests.kernels.spec import (
    DTYPE_PAIRS,
    assert_same,
    dtype_id,
    overflow_is_expected,
    expected_accumulate,
    random_tensor,
    special_values,
)

NORM_RTOL = 1e-5


def run_and_check(ops, src, dst, scale, accumulate):
    before = dst.clone()
    expected_dst, expected_norm_sq, expected_flag = expected_accumulate(src, before, scale, accumulate)
    norm_sq, nonfinite = ops.accumulate_grad_shard(src, dst, scale=scale, accumulate=accumulate)
    assert_same(dst, expected_dst)
    assert norm_sq.dtype == torch.float32 and norm_sq.dim() == 0 and norm_sq.device == dst.device
    assert nonfinite.dtype == torch.bool and nonfinite.dim() == 0 and nonfinite.device == dst.device
    assert bool(nonfinite) == expected_flag
    if not expected_flag:
        torch.testing.assert_close(norm_sq.double().cpu(), expected_norm_sq, rtol=NORM_RTOL, atol=0)
    return norm_sq, nonfinite


@pytest.mark.parametrize("shapes", [((0,), (0,)), ((1,), (1,)), ((123, 77), (123 * 77,))], ids=str)
@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=dtype_id)
@pytest.mark.parametrize("accumulate", [True, False], ids=["add", "assign"])
@pytest.mark.parametrize("scale", [1.0, -0.375], ids=["scale1", "scale-0.375"])
def test_every_dtype_pair(ops, device, shapes, dtypes, accumulate, scale):
    src_shape, dst_shape = shapes
    src_dtype, dst_dtype = dtypes
    src = random_tensor(src_shape, src_dtype, device, seed=1)
    dst = random_tensor(dst_shape, dst_dtype, device, seed=2)
    norm_sq, nonfinite = run_and_check(ops, src, dst, scale, accumulate)
    if dst.numel() == 0:
        assert float(norm_sq) == 0.0 and not bool(nonfinite)


@pytest.mark.parametrize("scale", [0.25, -1.5, 1 / 3])
@pytest.mark.parametrize("accumulate", [True, False], ids=["add", "assign"])
def test_scale_over_several_blocks(ops, device, scale, accumulate):
    src = random_tensor((3 * BLOCK + 5,), torch.bfloat16, device, seed=3)
    dst = random_tensor((3 * BLOCK + 5,), torch.float32, device, seed=4)
    run_and_check(ops, src, dst, scale, accumulate)


def test_noncontiguous_src_and_dst(ops, device):
    src = random_tensor((40, 30), torch.float16, device, seed=5).t()
    storage = random_tensor((50, 24), torch.float32, device, seed=6)
    dst = storage.t()
    assert not src.is_contiguous() and not dst.is_contiguous()
    before = dst.clone()
    run_and_check(ops, src, dst, 0.5, True)
    assert_same(storage.t(), expected_accumulate(src, before, 0.5, True)[0])


@pytest.mark.parametrize("planted", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_nonfinite_flag(ops, device, planted):
    src = random_tensor((BLOCK + 10,), torch.float32, device, seed=7)
    dst = random_tensor((BLOCK + 10,), torch.float32, device, seed=8)
    src[BLOCK + 3] = planted  # in the second, partial block
    norm_sq, nonfinite = run_and_check(ops, src, dst, 1.0, True)
    assert bool(nonfinite)
    assert not torch.isfinite(norm_sq)


@overflow_is_expected
def test_overflow_on_cast_is_flagged(ops, device):
    """A finite fp32 sum that overflows fp16 on the store is inf in dst, so it is flagged."""
    src = torch.full((5,), 40000.0, device=device)
    dst = torch.full((5,), 40000.0, dtype=torch.float16, device=device)
    _, nonfinite = run_and_check(ops, src, dst, 1.0, True)
    assert bool(nonfinite)


@overflow_is_expected
def test_huge_finite_values_are_not_flagged(ops, device):
    """Squares overflow the norm to inf, but no element is inf/nan: the flag stays false."""
    src = torch.full((3,), 1e30, device=device)
    dst = torch.zeros(3, device=device)
    norm_sq, nonfinite = ops.accumulate_grad_shard(src, dst)
    assert not bool(nonfinite)
    assert torch.isinf(norm_sq)


@overflow_is_expected
@pytest.mark.parametrize("dst_dtype", [torch.bfloat16, torch.float16], ids=dtype_id)
def test_round_to_nearest_even_at_the_edges(ops, device, dst_dtype):
    src = special_values().to(device)
    dst = torch.zeros(src.numel(), dtype=dst_dtype, device=device)
    run_and_check(ops, src, dst, 1.0, False)


def test_src_aliasing_dst_doubles_it(ops, device):
    dst = random_tensor((10,), torch.float32, device, seed=9)
    expected = dst * 2
    ops.accumulate_grad_shard(dst, dst)
    assert_same(dst, expected)


@pytest.mark.gpu
def test_past_2_to_31_elements(cuda_triton_ops):
    """64-bit offsets over a 2^31 + BLOCK element bf16 shard (4 GiB)."""
    device = torch.device("cuda")
    numel = 2**31 + BLOCK + 3
    src = torch.ones(numel, dtype=torch.bfloat16, device=device)
    dst = torch.zeros(numel, dtype=torch.bfloat16, device=device)
    dst[-5:] = 2.0
    norm_sq, nonfinite = cuda_triton_ops.accumulate_grad_shard(src, dst, scale=0.5)
    assert float(dst[-1]) == 2.5 and float(dst[2**31 + 1]) == 0.5 and float(dst[0]) == 0.5
    expected = (numel - 5) * 0.25 + 5 * 6.25
    torch.testing.assert_close(norm_sq.double().cpu(), torch.tensor(expected, dtype=torch.float64), rtol=NORM_RTOL, atol=0)
    assert not bool(nonfinite)


@pytest.mark.parametrize("accumulate", [True, False], ids=["add", "assign"])
@pytest.mark.parametrize("scale", [1.0, 0.5, 1 / 3], ids=["scale1", "scale0.5", "scale1/3"])
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32)], ids=dtype_id)
def test_several_pairs_at_once_equal_the_single_op(ops, device, dtypes, scale, accumulate):
    """accumulate_grad_shards: every pair's dst bit for bit as the single op leaves it, its norm
    within the single op's tolerance and its flag exact (an inf in one shard, a nan in another);
    odd sizes and an empty shard among them."""
    sizes = [1, 0, 37, 3 * BLOCK + 5, 64]
    srcs = [random_tensor((n,), dtypes[0], device, seed=10 + i) for i, n in enumerate(sizes)]
    dsts = [random_tensor((n,), dtypes[1], device, seed=20 + i) for i, n in enumerate(sizes)]
    srcs[2][5], srcs[4][0] = float("inf"), float("nan")
    want = [d.clone() for d in dsts]
    single = [ops.accumulate_grad_shard(s, d, scale=scale, accumulate=accumulate) for s, d in zip(srcs, want)]
    got = ops.accumulate_grad_shards(srcs, dsts, scale=scale, accumulate=accumulate)
    assert len(got) == len(sizes)
    for d, w, (norm_sq, flag), (want_sq, want_flag) in zip(dsts, want, got, single):
        assert_same(d, w)
        assert norm_sq.dim() == 0 and flag.dtype == torch.bool and flag.dim() == 0
        assert bool(flag) == bool(want_flag)
        if not bool(want_flag):
            torch.testing.assert_close(norm_sq.double().cpu(), want_sq.double().cpu(), rtol=NORM_RTOL, atol=0)


def test_several_pairs_refuse_what_the_single_op_refuses(ops, device):
    src, dst = random_tensor((4,), torch.float32, device, seed=1), random_tensor((5,), torch.float32, device, seed=2)
    with pytest.raises(ValueError, match="accumulate_grad_shard: src has 4 elements"):
        ops.accumulate_grad_shards([src], [dst])
    with pytest.raises(ValueError, match="1 srcs but 0 dsts"):
        ops.accumulate_grad_shards([src], [])
    assert ops.accumulate_grad_shards([], []) == []
