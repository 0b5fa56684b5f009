"""What the kernel ops must compute, as plain torch expressions, and the comparison the tests use.

Written independently of ``flashfsdp.kernels.reference`` (which is itself under test here).
Comparisons are exact on every path, the Triton interpreter included: the kernels round
fp32 -> bf16 to nearest even in integer arithmetic, so the interpreter's truncating cast never
enters; nan compares equal to nan (payload and sign bits are not part of the contract).
"""

import itertools
import random

import pytest
import torch

# The Triton interpreter computes with numpy, which warns where a test overflows on purpose.
overflow_is_expected = pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Quantised payloads: |x - deq(q(x))| <= scale/2, up to the fp32 roundings of x / scale and
# q * scale (a few ulps of the scale) and, for blocks whose max is subnormal, the scale's own lost
# precision (absolute).
QUANTIZATION_RELATIVE_SLACK = 2.0**-12
QUANTIZATION_ABSOLUTE_SLACK = 2.0**-120


def assert_within(error, bound):
    """``error <= bound`` everywhere (float64 tensors), with the slack of fp32 quantisation arithmetic."""
    ok = error <= bound * (1 + QUANTIZATION_RELATIVE_SLACK) + QUANTIZATION_ABSOLUTE_SLACK
    assert bool(ok.all()), f"worst excess {float((error - bound).max())}"
DTYPE_PAIRS = tuple(itertools.product(DTYPES, DTYPES))  # (input dtype, output dtype)


def dtype_id(value):
    """pytest id for dtypes and dtype pairs: fp32, bf16, fp16, fp32-bf16."""
    short = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    if isinstance(value, tuple):
        return "-".join(short[d] for d in value)
    return short.get(value)


def random_tensor(shape, dtype, device, seed=0):
    """Normal values with a spread of magnitudes (so that casts really round), in ``dtype``."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(shape, generator=generator) * torch.exp2(torch.randint(-6, 7, shape, generator=generator))
    return values.to(dtype).to(device)


def expected_flatten(tensors, offsets, numel, dtype, scale=1.0):
    """``out`` as the spec defines it: zeros, then each tensor cast and scaled at its offset."""
    out = torch.zeros(numel, dtype=dtype)
    for tensor, offset in zip(tensors, offsets):
        if tensor is not None and tensor.numel() > 0:
            values = (tensor.detach().cpu().reshape(-1).float() * scale).to(dtype)
            out[offset : offset + tensor.numel()] = values
    return out


def expected_unflatten(flat, offsets, shapes_and_dtypes):
    """The outputs of ``unflatten`` as the spec defines them."""
    flat = flat.cpu()
    outs = []
    for offset, (shape, dtype) in zip(offsets, shapes_and_dtypes):
        numel = torch.Size(shape).numel()
        outs.append(flat[offset : offset + numel].to(dtype).reshape(shape))
    return outs


def expected_accumulate(src, dst_before, scale, accumulate):
    """``(dst_after, norm_sq as fp64, nonfinite)`` as the spec defines them."""
    update = src.cpu().reshape(-1).float() * scale
    if accumulate:
        update = dst_before.cpu().reshape(-1).float() + update
    dst_after = update.to(dst_before.dtype).reshape(dst_before.shape)
    stored = dst_after.double()
    return dst_after, stored.square().sum(), bool((~torch.isfinite(stored)).any())


def assert_same(actual, expected):
    """Bitwise-equal values (nan == nan, -0 == +0), same dtype and shape."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=0, atol=0, equal_nan=True)


def nan_buffer(numel, dtype, device):
    """An output buffer full of nan, so that a gap the kernel forgot to zero shows."""
    return torch.full((numel,), float("nan"), dtype=dtype, device=device)


def many_small_tensors(device, count=300, seed=0):
    """``count`` tensors of 1..7 elements, mixed dtypes, in a shuffled layout with some gaps."""
    rng = random.Random(seed)
    tensors = [
        random_tensor((rng.randint(1, 7),), rng.choice(DTYPES), device, seed=i) for i in range(count)
    ]
    offsets, position = [], 0
    for tensor in tensors:
        position += rng.choice([0, 0, 0, 1, 2])
        offsets.append(position)
        position += tensor.numel()
    order = list(range(count))
    rng.shuffle(order)
    return [tensors[i] for i in order], [offsets[i] for i in order], position + 3


def special_values():
    """fp32 values at the edges of rounding: ties to even for bf16 and fp16, overflow, subnormals."""
    bits = [
        0x3F808000,  # 1 + 2^-8: bf16 tie, rounds down to even 1.0
        0x3F818000,  # 1 + 3*2^-8: bf16 tie, rounds up to even
        0x3F808001,  # just above a bf16 tie: rounds up
        0x7F7FFFFF,  # fp32 max: rounds to bf16 inf
        0x00000001,  # smallest fp32 subnormal
        0x80800000,  # -smallest fp32 normal
        0x80000000,  # -0.0
        0x7F800000,  # inf
        0xFF800000,  # -inf
        0x7FC00000,  # nan
    ]
    values = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    fp16_edges = torch.tensor(
        [1 + 2**-11, 1 + 3 * 2**-11, 65504.0, 65519.0, 65520.0, 2**-25, 3 * 2**-26, -(2**-24)],
        dtype=torch.float32,
    )
    return torch.cat([values, fp16_edges])
