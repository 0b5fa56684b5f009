"""quantize_int8 / dequantize_int8 (ZeRO++ qwZ payloads): the error bound per block, the packed
format, Triton == reference bit for bit, special values and bad input, on every path.

Sizes stay tiny: the Triton path runs under the interpreter on CPU."""

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashfsdp.kernels as kernels
from flashfsdp.kernels import dispatch
from flashfsdp.kernels.quantize import packed_nbytes, scales_offset
from tests.kernels.conftest import kernel_device
from tests.kernels.spec import DTYPES as FLOATS
from tests.kernels.spec import assert_within, overflow_is_expected, random_tensor

@pytest.fixture
def ops(op_module):
    """``quantize_int8`` / ``dequantize_int8`` of one path (see tests/kernels/conftest.py)."""
    return op_module


def quantize(ops, x, block_size=256):
    packed = torch.full((packed_nbytes(x.numel(), block_size),), 99, dtype=torch.int8, device=x.device)
    assert ops.quantize_int8(x, packed, block_size=block_size) is packed
    return packed


def dequantize(ops, packed, numel, dtype=torch.float32, chunks=1, block_size=256):
    out = torch.full((numel,), 7.0, dtype=dtype, device=packed.device)
    assert ops.dequantize_int8(packed, out, chunks=chunks, block_size=block_size) is out
    return out


def unpack(packed, n, block_size=256):
    """(int8 values, fp32 scales) of one packed chunk."""
    start = scales_offset(n)
    return packed[:n].cpu(), packed[start:].cpu().view(torch.float32)


def check_bound(x, packed, deq, block_size):
    """Every value within half its block's scale; the scale is the block's max |x| / 127."""
    n = x.numel()
    q, scales = unpack(packed, n, block_size)
    x = x.detach().cpu().float()
    assert scales.numel() == math.ceil(n / block_size)
    assert int(q.abs().max()) <= 127 if n else True
    per_element = scales.repeat_interleave(block_size)[:n]
    amax = torch.stack([b.abs().max() for b in x.split(block_size)]) if n else torch.zeros(0)
    assert torch.equal(scales, amax / 127)
    assert_within((x.double() - deq.cpu().double()).abs(), per_element.double() / 2)
    assert torch.equal(packed[n:scales_offset(n)].cpu(), torch.zeros(scales_offset(n) - n, dtype=torch.int8))


_values = st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), max_size=300)


@overflow_is_expected
@pytest.mark.parametrize("path", ["reference", "triton"])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=_values, block_size=st.sampled_from([32, 64, 256]), magnitude=st.integers(-40, 40))
def test_error_within_half_a_scale_per_block(path, values, block_size, magnitude):
    """Any fp32 values (signs, zeros, subnormals, up to 2^127), any block size: each value
    dequantises within half its block's scale, on the reference and the Triton path."""
    if path == "triton" and dispatch.triton_device_type() is None:
        pytest.skip("triton cannot be imported")
    # below 2^127: at fp32's very top, 127 * RN(max / 127) may round past the largest float to inf
    x = (torch.tensor(values, dtype=torch.float32) * 2.0**magnitude).nan_to_num().clamp(-(2.0**127), 2.0**127)
    x = x.to(kernel_device())
    with dispatch.use_backend(path):
        packed = quantize(kernels, x, block_size)
        deq = dequantize(kernels, packed, x.numel(), block_size=block_size)
    check_bound(x, packed, deq, block_size)


@pytest.mark.parametrize("src_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("out_dtype", FLOATS, ids=str)
@pytest.mark.parametrize("n", [1, 255, 256, 700])
def test_paths_agree_bit_for_bit(src_dtype, out_dtype, n):
    """The Triton kernels give the reference's bytes and values, every dtype pair, partial blocks."""
    if dispatch.triton_device_type() is None:
        pytest.skip("triton cannot be imported")
    x = random_tensor((n,), src_dtype, kernel_device(), seed=n)
    results = []
    for path in ("triton", "reference"):
        with dispatch.use_backend(path):
            packed = quantize(kernels, x)
            results.append((packed, dequantize(kernels, packed, n, out_dtype)))
    (p_triton, d_triton), (p_ref, d_ref) = results
    assert torch.equal(p_triton, p_ref)
    assert torch.equal(d_triton, d_ref)
    q, scales = unpack(p_ref, n)
    expected = (q.float() * scales.repeat_interleave(256)[:n]).to(out_dtype)  # the spec, written out
    assert torch.equal(d_ref.cpu(), expected)


def test_chunks_dequantise_like_an_all_gather(ops, device):
    """Three chunks side by side (what an all-gather of three ranks' chunks holds) dequantise
    into consecutive ranges, each as if alone; float64 output too (the reference serves it)."""
    n = 300
    xs = [random_tensor((n,), torch.float32, device, seed=s) for s in range(3)]
    gathered = torch.cat([quantize(ops, x, 64) for x in xs])
    for dtype in (torch.bfloat16, torch.float64):
        out = dequantize(ops, gathered, 3 * n, dtype, chunks=3, block_size=64)
        for c, x in enumerate(xs):
            alone = dequantize(ops, quantize(ops, x, 64), n, dtype, block_size=64)
            assert torch.equal(out[c * n : (c + 1) * n], alone)


def test_special_blocks(ops, device):
    """A zero block stays zero; a block with an inf or nan dequantises to nan throughout, and its
    neighbours are untouched; an empty chunk writes nothing."""
    x = torch.zeros(4 * 32, device=device)
    x[32:64] = torch.linspace(-1, 1, 32)
    x[64 + 5] = float("inf")
    x[96 + 7] = float("nan")
    deq = dequantize(ops, quantize(ops, x, 32), x.numel(), block_size=32)
    assert torch.equal(deq[:32], torch.zeros(32, device=device))
    assert torch.allclose(deq[32:64], x[32:64], atol=1 / 254)
    assert bool(deq[64:].isnan().all())
    empty = torch.zeros(0, device=device)
    packed = quantize(ops, empty)
    assert packed.numel() == 0 and dequantize(ops, packed, 0).numel() == 0


def test_fp64_source_uses_fp32_arithmetic(ops, device):
    """float64 masters quantise through fp32 (the reference serves them): the same bytes as fp32."""
    x = random_tensor((100,), torch.float32, device, seed=3)
    assert torch.equal(quantize(ops, x.double()), quantize(ops, x))


def _bad(device):
    f32, i8 = torch.zeros(8, device=device), torch.zeros(packed_nbytes(8), dtype=torch.int8, device=device)
    big = torch.zeros(40, dtype=torch.int8, device=device)
    return [
        ("quantize_int8", (f32, i8.float()), {}, TypeError, r"quantize_int8: packed must be an int8 tensor"),
        ("quantize_int8", (f32.int(), i8), {}, TypeError, r"quantize_int8: src has non-floating dtype"),
        ("quantize_int8", (f32, i8[:-1]), {}, ValueError, r"quantize_int8: packed has 11 bytes but 8 values need 12"),
        ("quantize_int8", (f32.view(2, 4), i8), {}, ValueError, r"quantize_int8: src must be 1-D"),
        ("quantize_int8", (f32, i8), {"block_size": 100}, ValueError, r"block_size must be a power of two in \[32, 4096\]"),
        ("quantize_int8", (f32, i8), {"block_size": 64.0}, TypeError, r"quantize_int8: block_size must be an int"),
        ("quantize_int8", (f32, torch.zeros(13, dtype=torch.int8, device=device)[1:]), {}, ValueError,
         r"quantize_int8: packed must start on a 4-byte boundary"),
        ("quantize_int8", (big[8:40].view(torch.float32), big[:12]), {}, ValueError, r"quantize_int8: src and packed overlap"),
        ("quantize_int8", ([0.0] * 8, i8), {}, TypeError, r"quantize_int8: src must be a torch.Tensor, got list"),
        ("dequantize_int8", (i8, f32), {"chunks": 0}, ValueError, r"dequantize_int8: chunks must be an int >= 1"),
        ("dequantize_int8", (i8, f32[:7]), {"chunks": 2}, ValueError, r"out has 7 elements, not a multiple of chunks=2"),
        ("dequantize_int8", (i8, f32), {"chunks": 2}, ValueError, r"packed has 12 bytes but 2 chunks of 4 values need 16"),
        ("dequantize_int8", (i8, f32.int()), {}, TypeError, r"dequantize_int8: out has non-floating dtype"),
        ("dequantize_int8", (i8.to("meta"), f32), {}, ValueError, r"dequantize_int8: packed is on meta but out is on"),
    ]


@pytest.mark.parametrize("case", range(14))
def test_bad_input_names_the_argument(ops, device, case):
    op, args, kwargs, error, pattern = _bad(device)[case]
    with pytest.raises(error, match=pattern):
        getattr(ops, op)(*args, **kwargs)


def test_scales_are_the_correctly_rounded_quotient(ops, device):
    """scale = max|x| / 127 rounded once (IEEE division) on every path: the fp64 quotient of the fp32
    max rounded to fp32 (exact, 53 >= 2·24 + 2 bits). A product with 1/127 misses it in the last bit
    for some blocks (what torch on CUDA computes for a division by a Python scalar)."""
    x = random_tensor((64 * 256,), torch.float32, device, seed=4)
    _, scales = unpack(quantize(ops, x), x.numel())
    amax = x.cpu().view(64, 256).abs().amax(dim=1)
    assert torch.equal(scales, (amax.double() / 127).float())
    assert not torch.equal(scales, amax * (1 / 127))  # the seed has blocks where the two differ


@pytest.mark.gpu
def test_compiled_kernels_match_the_reference_on_cuda():
    """On a GPU: the compiled kernels give the reference's bytes and values (bf16 out, 3 chunks); the
    reference runs on the CPU, where it is the contract."""
    n = 5000
    x = random_tensor((3 * n,), torch.float32, "cuda", seed=9)
    results = []
    for device in ("cuda", "cpu"):
        chunks = x.to(device).split(n)
        packed = torch.cat([quantize(kernels, chunk) for chunk in chunks])
        results.append((packed.cpu(), dequantize(kernels, packed, 3 * n, torch.bfloat16, chunks=3).cpu()))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert np.isfinite(results[0][1].float().numpy()).all()
