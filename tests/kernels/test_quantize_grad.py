"""quantize_grad / dequantize_reduce (ZeRO++ qgZ): the int4 / int8 format, the all-to-all slot order,
error bounds per block against float64, exact sums on exactly representable inputs, Triton ==
reference bit for bit, bad input, and a (2 nodes x 2 ranks) hierarchical reduction moved by hand
with the bytes that cross nodes counted against a bf16 ring reduce-scatter.

Sizes stay tiny: the Triton path runs under the interpreter on CPU."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import flashfsdp.kernels as kernels
from flashfsdp.kernels import dispatch
from flashfsdp.kernels.quantize import QMAX_BY_BITS, packed_nbytes, payload_nbytes, scales_offset
from flashfsdp.kernels.quantize_grad import slot_of
from tests.kernels.conftest import kernel_device
from tests.kernels.spec import DTYPES as FLOATS
from tests.kernels.spec import assert_within as within
from tests.kernels.spec import overflow_is_expected, random_tensor

def _skip_without_triton(path):
    if path == "triton" and dispatch.triton_device_type() is None:
        pytest.skip("triton cannot be imported")


@pytest.fixture
def ops(op_module):
    """``quantize_grad`` / ``dequantize_reduce`` (and the int8 ops) of one path (see conftest.py)."""
    return op_module


def quantize(ops, x, bits, nodes=1, local_size=1, block_size=256):
    world = nodes * local_size
    nbytes = world * packed_nbytes(x.numel() // world, block_size, bits=bits)
    packed = torch.full((nbytes,), 99, dtype=torch.int8, device=x.device)
    assert ops.quantize_grad(x, packed, bits=bits, nodes=nodes, local_size=local_size, block_size=block_size) is packed
    return packed


def reduce(ops, packed, numel, bits, senders=1, chunks=1, out_bits=None, dtype=torch.float32, block_size=256):
    """dequantize_reduce into a fresh output (filled with junk first, so that a byte left unwritten shows)."""
    if out_bits is None:
        out = torch.full((chunks * numel,), 7.0, dtype=dtype, device=packed.device)
    else:
        out = torch.full((chunks * packed_nbytes(numel, block_size, bits=out_bits),), 99, dtype=torch.int8,
                         device=packed.device)
    result = ops.dequantize_reduce(packed, out, senders=senders, numel=numel, bits=bits, chunks=chunks,
                                   out_bits=out_bits, block_size=block_size)
    assert result is out
    return out


def unpack(chunk, n, bits, block_size=256):
    """(int64 values, fp32 scales) of one packed chunk, read byte by byte (independently of the ops)."""
    chunk = chunk.cpu()
    payload = chunk[:payload_nbytes(n, bits)].to(torch.int64)
    if bits == 8:
        q = payload
    else:
        low, high = payload & 15, torch.div(payload - (payload & 15), 16, rounding_mode="floor")
        low = torch.where(low >= 8, low - 16, low)
        q = torch.stack([low, high], dim=1).reshape(-1)[:n]
    start = scales_offset(n, bits)
    assert torch.equal(chunk[len(payload):start], torch.zeros(start - len(payload), dtype=torch.int8)), "padding"
    scales = chunk[start:].contiguous().view(torch.float32)
    assert scales.numel() == -(-n // block_size)
    return q, scales


def chunks_of(packed, count):
    return packed.view(count, -1)


def per_element(scales, n, block_size=256):
    """Each element's block scale, as float64."""
    return scales.double().repeat_interleave(block_size)[:n]


def test_int4_bytes_hold_nibble_pairs_low_first(ops, device):
    """35 values in blocks of 32 (a partial block of 3, an odd count): int4 payload of 18 bytes
    (value 2j in the low nibble of byte j, the last high nibble 0), 2 bytes of zero padding, then the
    two scales as float32; the values are exact multiples of their scales, so q is known."""
    first = torch.tensor([7, -7, 1, -1, 0, 3, -4, 5] * 4, dtype=torch.float32)
    last = torch.tensor([-7, 5, 1], dtype=torch.float32)
    x = torch.cat([first * 2.0**-3, last]).to(device)
    packed = quantize(ops, x, bits=4, block_size=32)
    assert packed.numel() == 18 + 2 + 8
    q = torch.cat([first, last]).to(torch.int64).tolist() + [0]
    expected = [16 * q[2 * j + 1] + (q[2 * j] & 15) for j in range(18)]
    assert packed[:18].tolist() == [b - 256 if b > 127 else b for b in expected]
    assert packed[18:20].tolist() == [0, 0]
    assert packed[20:].cpu().view(torch.float32).tolist() == [2.0**-3, 1.0]
    values, _ = unpack(packed, 35, 4, 32)
    assert values.tolist() == q[:35]
    assert torch.equal(reduce(ops, packed, 35, 4, block_size=32), x)


def test_one_chunk_at_8_bits_is_quantize_int8(ops, device):
    """One format for qwZ and qgZ: ``quantize_grad`` of one chunk at 8 bits writes
    ``quantize_int8``'s bytes, and ``dequantize_reduce`` from one sender gives
    ``dequantize_int8``'s values, chunk by chunk."""
    x = random_tensor((3 * 300,), torch.float32, device, seed=5)
    one = quantize(ops, x, bits=8, block_size=64)
    int8 = torch.empty_like(one)
    ops.quantize_int8(x, int8, block_size=64)
    assert torch.equal(one, int8)
    three = quantize(ops, x, bits=8, nodes=1, local_size=3, block_size=64)
    for dtype in (torch.bfloat16, torch.float32):
        ours = reduce(ops, three, 300, 8, chunks=3, dtype=dtype, block_size=64)
        theirs = torch.empty_like(ours)
        ops.dequantize_int8(three, theirs, chunks=3, block_size=64)
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("nodes,local_size", [(2, 2), (2, 4), (3, 2), (1, 3), (3, 1)])
def test_segments_go_to_their_all_to_all_slots(ops, device, bits, nodes, local_size):
    """Segment g = m·L + l is quantised, as if alone, into slot l·N + m: the N segments for local
    rank l of every node lie together (DeepSpeed's swizzle: 2 x 4 puts segments 0 4 1 5 2 6 3 7)."""
    world, n = nodes * local_size, 70
    x = random_tensor((world * n,), torch.float32, device, seed=world)
    rows = chunks_of(quantize(ops, x, bits, nodes, local_size, block_size=32), world)
    for g in range(world):
        alone = quantize(ops, x[g * n : (g + 1) * n], bits, block_size=32)
        assert torch.equal(rows[slot_of(g, nodes, local_size)], alone)
    if (nodes, local_size) == (2, 4):
        assert sorted(range(8), key=lambda g: slot_of(g, 2, 4)) == [0, 4, 1, 5, 2, 6, 3, 7]


_values = st.lists(st.floats(width=32, allow_nan=False, allow_infinity=False), min_size=1, max_size=200)


@overflow_is_expected
@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("bits", [4, 8])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(values=_values, block_size=st.sampled_from([32, 64, 256]), magnitude=st.integers(-40, 40))
def test_each_value_within_half_its_block_scale(path, bits, values, block_size, magnitude):
    """Any fp32 values (signs, zeros, subnormals, up to 2^127), any block size: scale = max|x| / QMAX
    per block (the correctly rounded quotient), |q| <= QMAX, and each value dequantises within
    half its block's scale, against float64."""
    _skip_without_triton(path)
    x = (torch.tensor(values, dtype=torch.float32) * 2.0**magnitude).nan_to_num().clamp(-(2.0**127), 2.0**127)
    x = x.to(kernel_device())
    n, qmax = x.numel(), QMAX_BY_BITS[bits]
    with dispatch.use_backend(path):
        packed = quantize(kernels, x, bits, block_size=block_size)
        deq = reduce(kernels, packed, n, bits, block_size=block_size)
    q, scales = unpack(packed, n, bits, block_size)
    amax = torch.stack([b.abs().max() for b in x.cpu().split(block_size)])
    assert torch.equal(scales, (amax.double() / qmax).float())
    assert int(q.abs().max()) <= qmax
    within((x.cpu().double() - deq.cpu().double()).abs(), per_element(scales, n, block_size) / 2)


def _bound_of_sum(parts, scales, n, block_size):
    """|sum of deq(parts) - sum of parts| bound: each part's scale/2, plus the fp32 rounding of the
    additions (k - 1 roundings, each at most 2^-24 of a partial sum, itself at most the sum of |deq|)."""
    half_scales = sum(per_element(s, n, block_size) / 2 for s in scales)
    magnitudes = sum(p.abs() for p in parts) + half_scales
    return half_scales + len(parts) * 2.0**-24 * magnitudes


@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("bits,out_bits", [(4, None), (8, None), (4, 4), (8, 4), (4, 8)])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), senders=st.integers(1, 4), chunks=st.integers(1, 3), n=st.integers(1, 100),
       spread=st.integers(0, 12))
def test_reduce_within_the_sum_of_half_scales(path, bits, out_bits, seed, senders, chunks, n, spread):
    """``senders`` ranks' chunks (values of magnitudes 2^±spread apart) summed: within the sum of
    the senders' block scales / 2 of the float64 sum of the unquantised values (plus fp32 rounding);
    requantised, within another half of the output's block scale."""
    _skip_without_triton(path)
    device, block_size = kernel_device(), 32
    gen = torch.Generator().manual_seed(seed)
    xs = [(torch.randn(chunks * n, generator=gen) * 2.0 ** torch.randint(-spread, spread + 1, (1,), generator=gen))
          .to(device) for _ in range(senders)]
    with dispatch.use_backend(path):
        received = torch.cat([quantize(kernels, x, bits, 1, chunks, block_size) for x in xs])
        out = reduce(kernels, received, n, bits, senders, chunks, out_bits, block_size=block_size)
        summed = out if out_bits is None else reduce(kernels, out, n, out_bits, 1, chunks, block_size=block_size)
    sender_rows = [chunks_of(received, senders * chunks)[j * chunks : (j + 1) * chunks] for j in range(senders)]
    for c in range(chunks):
        parts = [x[c * n : (c + 1) * n].cpu().double() for x in xs]
        scales = [unpack(rows[c], n, bits, block_size)[1] for rows in sender_rows]
        bound = _bound_of_sum(parts, scales, n, block_size)
        if out_bits is not None:
            bound = bound + per_element(unpack(chunks_of(out, chunks)[c], n, out_bits, block_size)[1], n, block_size) / 2
        error = (summed[c * n : (c + 1) * n].cpu().double() - sum(parts)).abs()
        within(error, bound)


@pytest.mark.parametrize("n", [1, 255, 256, 301])
@pytest.mark.parametrize("bits", [4, 8])
def test_paths_agree_bit_for_bit(bits, n):
    """The Triton kernels give the reference's bytes and values: every source dtype, float outputs
    of every dtype, requantised outputs at 4 and 8 bits, partial blocks, odd sizes."""
    _skip_without_triton("triton")
    device, world = kernel_device(), 4
    results = {}
    for path in ("triton", "reference"):
        with dispatch.use_backend(path):
            got = []
            for i, dtype in enumerate(FLOATS):
                x = random_tensor((world * n,), dtype, device, seed=n + i)
                packed = quantize(kernels, x, bits, 2, 2)
                got.append(packed)
            for dtype in FLOATS:
                got.append(reduce(kernels, got[0], n, bits, senders=2, chunks=2, dtype=dtype))
            for out_bits in (4, 8):
                got.append(reduce(kernels, got[0], n, bits, senders=2, chunks=2, out_bits=out_bits))
            results[path] = got
    for triton_result, reference_result in zip(results["triton"], results["reference"]):
        assert torch.equal(triton_result, reference_result)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter's numpy on nan
@pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning")
def test_special_blocks(ops, device):
    """A zero block stays zero through a sum and a requantisation; an inf or nan in one sender's
    block makes that block nan in the sum and after requantising (a non-finite scale), and leaves
    the neighbouring blocks alone; empty chunks write nothing."""
    n, block_size = 4 * 32, 32
    a = random_tensor((n,), torch.float32, device, seed=1)
    b = random_tensor((n,), torch.float32, device, seed=2)
    a[:32] = 0
    b[:32] = 0
    a[64 + 3] = float("inf")
    b[96 + 5] = float("nan")
    received = torch.cat([quantize(ops, a, 4, block_size=block_size), quantize(ops, b, 4, block_size=block_size)])
    for out_bits in (None, 4):
        out = reduce(ops, received, n, 4, senders=2, out_bits=out_bits, block_size=block_size)
        if out_bits is not None:
            out = reduce(ops, out, n, 4, block_size=block_size)
        assert torch.equal(out[:32], torch.zeros(32, device=device))
        assert bool(out[32:64].isfinite().all()) and bool(out[32:64].ne(0).any())
        assert bool(out[64:].isnan().all())
    empty = quantize(ops, torch.zeros(0, device=device), 4, 2, 2)
    assert empty.numel() == 0
    assert reduce(ops, empty, 0, 4, senders=2, chunks=2).numel() == 0
    assert reduce(ops, empty, 0, 4, senders=2, chunks=2, out_bits=8).numel() == 0


def _bad(device):
    f32 = torch.zeros(8, device=device)
    i8 = torch.zeros(2 * packed_nbytes(4, bits=4), dtype=torch.int8, device=device)  # 2 chunks of 4 at int4: 16
    q = dict(bits=4, nodes=1, local_size=2)
    r = dict(senders=2, numel=4, bits=4)
    return [
        ("quantize_grad", (f32, i8), {**q, "bits": 2}, ValueError, r"quantize_grad: bits must be 4 or 8, got 2"),
        ("quantize_grad", (f32, i8), {**q, "bits": 4.0}, TypeError, r"quantize_grad: bits must be an int"),
        ("quantize_grad", (f32, i8), {**q, "block_size": 48}, ValueError,
         r"quantize_grad: block_size must be a power of two in \[32, 4096\]"),
        ("quantize_grad", (f32, i8), {**q, "nodes": 0}, ValueError, r"quantize_grad: nodes must be an int >= 1"),
        ("quantize_grad", (f32, i8), {**q, "local_size": 3}, ValueError,
         r"quantize_grad: src has 8 elements, not a multiple of nodes \* local_size = 3"),
        ("quantize_grad", (f32, i8[:-4]), q, ValueError,
         r"quantize_grad: packed has 12 bytes but 2 segments of 4 values at 4 bits need 16"),
        ("quantize_grad", (f32, i8.float()), q, TypeError, r"quantize_grad: packed must be an int8 tensor"),
        ("quantize_grad", (f32.int(), i8), q, TypeError, r"quantize_grad: src has non-floating dtype"),
        ("quantize_grad", (torch.zeros(16, device=device)[::2], i8), q, ValueError,
         r"quantize_grad: src must be contiguous"),
        ("quantize_grad", (f32.view(2, 4), i8), q, ValueError, r"quantize_grad: src must be 1-D"),
        ("quantize_grad", (f32, torch.zeros(17, dtype=torch.int8, device=device)[1:]), q, ValueError,
         r"quantize_grad: packed must start on a 4-byte boundary"),
        ("quantize_grad", (f32, i8.to("meta")), q, ValueError, r"quantize_grad: packed is on meta but src is on"),
        ("dequantize_reduce", (i8, f32), {**r, "chunks": 0}, ValueError,
         r"dequantize_reduce: chunks must be an int >= 1"),
        ("dequantize_reduce", (i8, f32), {**r, "senders": True}, TypeError,
         r"dequantize_reduce: senders must be an int, got bool"),
        ("dequantize_reduce", (i8, f32), {**r, "numel": -1}, ValueError,
         r"dequantize_reduce: numel must be an int >= 0"),
        ("dequantize_reduce", (i8, f32[:4]), {**r, "senders": 3}, ValueError,
         r"dequantize_reduce: packed has 16 bytes but 3 senders x 1 chunks of 4 values at 4 bits need 24"),
        ("dequantize_reduce", (i8, f32), r, ValueError,
         r"dequantize_reduce: out has 8 elements but chunks \* numel = 4"),
        ("dequantize_reduce", (i8, i8[:8]), r, TypeError, r"dequantize_reduce: out is int8 but out_bits is None"),
        ("dequantize_reduce", (i8, f32), {**r, "out_bits": 4}, TypeError,
         r"dequantize_reduce: out must be an int8 tensor"),
        ("dequantize_reduce", (i8, torch.zeros(8, dtype=torch.int8, device=device)), {**r, "out_bits": 3},
         ValueError, r"dequantize_reduce: out_bits must be 4 or 8, got 3"),
        ("dequantize_reduce", (i8, torch.zeros(12, dtype=torch.int8, device=device)), {**r, "out_bits": 4},
         ValueError, r"dequantize_reduce: out has 12 bytes but 1 chunks of 4 values at 4 bits need 8"),
        ("dequantize_reduce", (i8, f32[:4].int()), r, TypeError, r"dequantize_reduce: out has non-floating dtype"),
        ("dequantize_reduce", (i8.to("meta"), f32[:4]), r, ValueError,
         r"dequantize_reduce: out is on .* but packed is on meta"),
        ("dequantize_reduce", (i8, i8.view(torch.float32)), r, ValueError,
         r"dequantize_reduce: packed and out overlap in memory"),
        ("dequantize_reduce", ([0] * 16, f32[:4]), r, TypeError,
         r"dequantize_reduce: packed must be a torch.Tensor, got list"),
    ]


@pytest.mark.parametrize("case", range(25))
def test_bad_input_names_the_argument(ops, device, case):
    op, args, kwargs, error, pattern = _bad(device)[case]
    with pytest.raises(error, match=pattern):
        getattr(ops, op)(*args, **kwargs)


def _ring_reduce_scatter_bf16(grads, nodes, local_size):
    """A ring reduce-scatter over ranks 0..W-1 (node-major, as NCCL's ring visits a node's GPUs in a
    row), bf16 on the wire, moved by hand: ``(shards, bytes sent between different nodes, all bytes)``."""
    world = nodes * local_size
    partial = [g.double().view(world, -1).clone() for g in grads]
    crossing = total = 0
    for step in range(world - 1):
        sent = []
        for r in range(world):
            c = (r - step - 1) % world
            sent.append((c, partial[r][c].to(torch.bfloat16)))
        for r, (c, payload) in enumerate(sent):
            dst = (r + 1) % world
            partial[dst][c] += payload.double()
            total += payload.numel() * payload.element_size()
            crossing += payload.numel() * payload.element_size() if r // local_size != dst // local_size else 0
    return [partial[r][r] for r in range(world)], crossing, total


def _hierarchical(ops, grads, nodes, local_size, bits, out_bits, block_size=256):
    """qgZ on W = nodes x local_size simulated ranks, the all-to-alls done by hand (see [Note: qgZ
    layout]): returns each rank's shard, each shard's per-element error bound, and the bytes sent
    (between different nodes, inside nodes)."""
    world, n = nodes * local_size, grads[0].numel() // (nodes * local_size)
    c1, c2 = packed_nbytes(n, block_size, bits=bits), packed_nbytes(n, block_size, bits=out_bits)
    node_of, local_of = (lambda g: g // local_size), (lambda g: g % local_size)
    sent = {"inter": 0, "intra": 0}
    # 1. every rank quantises its reduce-scatter input into the slot order
    packed = [quantize(ops, g, bits, nodes, local_size, block_size) for g in grads]
    # 2. all-to-all inside each node: rank (m, l) gets slots [l·N, (l+1)·N) of every rank (m, j)
    received = []
    for g in range(world):
        m, l = node_of(g), local_of(g)
        pieces = [packed[m * local_size + j][l * nodes * c1 : (l + 1) * nodes * c1] for j in range(local_size)]
        sent["intra"] += sum(p.numel() for j, p in enumerate(pieces) if j != l)
        received.append(torch.cat(pieces))
    # 3. dequantise, sum over the node's ranks, requantise: one chunk per destination node
    partial = [reduce(ops, r, n, bits, local_size, nodes, out_bits, block_size=block_size) for r in received]
    # 4. all-to-all across nodes: rank (m, l) gets chunk m of every rank (k, l)
    shards, bounds = [], []
    for g in range(world):
        m, l = node_of(g), local_of(g)
        pieces = [partial[k * local_size + l][m * c2 : (m + 1) * c2] for k in range(nodes)]
        sent["inter"] += sum(p.numel() for k, p in enumerate(pieces) if k != m)
        # 5. dequantise and sum over the nodes: the shard
        shards.append(reduce(ops, torch.cat(pieces), n, out_bits, nodes, 1, block_size=block_size))
        # the bound: half a scale of every block that held this segment, hop 1 and hop 2
        first = [unpack(chunks_of(packed[s], world)[slot_of(g, nodes, local_size)], n, bits, block_size)[1]
                 for s in range(world)]
        second = [unpack(p, n, out_bits, block_size)[1] for p in pieces]
        parts = [grads[s][g * n : (g + 1) * n].cpu().double() for s in range(world)]
        bounds.append(_bound_of_sum(parts, first, n, block_size)
                      + _bound_of_sum([sum(parts)], second, n, block_size) + nodes * 2.0**-24 * sum(parts).abs())
    return shards, bounds, sent


@pytest.mark.parametrize("bits", [4, 8])
def test_hierarchical_2x2_reduction_and_bytes_across_nodes(ops, device, bits):
    """2 nodes x 2 ranks, S = 512 values a shard, default 256-value blocks: intra-node all-to-all ->
    dequantise-sum-requantise -> inter-node all-to-all -> dequantise-sum, tensors moved between the
    simulated ranks by hand. Each rank's shard is within its per-element bound (the hop-1 half
    scales of the 4 ranks plus the hop-2 half scales of the 2 partial sums) of the float64 sum of
    all ranks' gradients. Counted bytes crossing nodes: 4 x 1 chunk of packed_nbytes(512, int4) =
    264 bytes = 1056 (int8: 4 x 520 = 2080), against 6144 for a bf16 ring reduce-scatter (3 steps x
    2 node-crossing links x 1024 bytes): 0.172x (int8 0.339x); against the 4096 bytes a bf16
    hierarchical reduce-scatter must move at least (each node's partial sums of the other node's
    2 shards): 0.258x (0.508x)."""
    nodes, local_size, n = 2, 2, 512
    world = nodes * local_size
    grads = [random_tensor((world * n,), torch.float32, device, seed=10 + r) for r in range(world)]
    shards, bounds, sent = _hierarchical(ops, grads, nodes, local_size, bits, bits)
    exact = sum(g.cpu().double() for g in grads).view(world, n)
    for g in range(world):
        within((shards[g].cpu().double() - exact[g]).abs(), bounds[g])
    ring_shards, ring_crossing, ring_total = _ring_reduce_scatter_bf16(grads, nodes, local_size)
    magnitude = sum(g.cpu().double().abs() for g in grads).view(world, n)
    for g in range(world):  # the ring really reduces (bf16 on the wire: 3 roundings of partial sums)
        assert bool(((ring_shards[g] - exact[g]).abs() <= 3 * 2.0**-8 * magnitude[g]).all())
    assert (ring_crossing, ring_total) == (6144, 12288)
    chunk = {4: 264, 8: 520}[bits]
    assert chunk == packed_nbytes(n, bits=bits)
    assert sent["inter"] == world * (nodes - 1) * chunk
    assert sent["intra"] == world * (local_size - 1) * nodes * chunk
    hierarchical_bf16 = nodes * (nodes - 1) * local_size * n * 2
    ratio, ratio_hierarchical = sent["inter"] / ring_crossing, sent["inter"] / hierarchical_bf16
    assert (round(ratio, 3), round(ratio_hierarchical, 3)) == {4: (0.172, 0.258), 8: (0.339, 0.508)}[bits]


@pytest.mark.parametrize("bits", [4, 8])
def test_exact_inputs_reduce_to_the_exact_sum(ops, device, bits):
    """Where quantising loses nothing the qgZ path equals the unquantised sum exactly: every rank's
    block holds integers in [-QMAX, QMAX] times a power of two with one value at QMAX (scale = the
    power of two, q = the integers), the two ranks of a node differ by ±d (their sum, 2·v, is
    requantised exactly with scale 2·2^e), and the sums of small integers times powers of two are
    exact in fp32: every shard == the float64 sum of all ranks' gradients, bit for bit."""
    nodes, local_size, n, block_size = 2, 2, 96, 32
    world, qmax = nodes * local_size, QMAX_BY_BITS[bits]
    gen = torch.Generator().manual_seed(bits)
    grads = []
    for m in range(nodes):
        blocks = world * n // block_size
        v = torch.randint(-(qmax // 2), qmax // 2 + 1, (blocks, block_size), generator=gen)
        room = qmax - v.abs()
        d = torch.floor(torch.rand(blocks, block_size, generator=gen) * (2 * room + 1)) - room
        v[:, 0], d[:, 0] = qmax, 0  # the block's max: scale = 2^e exactly
        power = 2.0 ** torch.randint(-6, 7, (blocks, 1), generator=gen)
        for sign in (1, -1):
            grads.append(((v + sign * d) * power).reshape(-1).float().to(device))
    exact = sum(g.cpu().double() for g in grads).view(world, n)
    shards, _, _ = _hierarchical(ops, grads, nodes, local_size, bits, bits, block_size)
    for g in range(world):
        assert torch.equal(shards[g].cpu().double(), exact[g])


@pytest.mark.gpu
def test_compiled_kernels_match_the_reference_on_cuda():
    """On a GPU: the compiled kernels give the reference's bytes and values (int4 and int8, the
    2 x 2 slot order, bf16 and requantised outputs); the reference runs on the CPU, where it is the
    contract."""
    n = 5000
    x = random_tensor((4 * n,), torch.float32, "cuda", seed=9)
    results = []
    for device in ("cuda", "cpu"):
        got = []
        for bits in (4, 8):
            packed = quantize(kernels, x.to(device), bits, 2, 2)
            got += [packed, reduce(kernels, packed, n, bits, 2, 2, dtype=torch.bfloat16),
                    reduce(kernels, packed, n, bits, 2, 2, out_bits=4)]
        results.append([t.cpu() for t in got])
    for cuda_result, cpu_result in zip(*results):
        assert torch.equal(cuda_result, cpu_result)
