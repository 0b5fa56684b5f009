"""Block-wise int8 / int4 quantisation: the packed-chunk format, its checks, and the Triton kernels
of ZeRO++'s quantised all-gather (qwZ) and quantised gradient reduction (qgZ).

Source: Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training" (arXiv:2306.10209), §3.1 "quantized weight communication" (qwZ): the forward and
backward all-gathers send the weights block-wise quantised to int8, one scale per block, and each
rank dequantises what it receives; the master weights stay in full precision. §3.3 (qgZ) sends
gradients block-quantised to int4 (or int8) through a hierarchical all-to-all, dequantising and
reducing between the hops (:mod:`flashfsdp.kernels.quantize_grad` holds its layout and ops; the
kernels here serve both).

The ops' contracts are :func:`flashfsdp.kernels.quantize_int8`, :func:`flashfsdp.kernels.dequantize_int8`,
:func:`flashfsdp.kernels.quantize_grad` and :func:`flashfsdp.kernels.dequantize_reduce` (docstrings
in :mod:`flashfsdp.kernels.dispatch`); their references are in :mod:`flashfsdp.kernels.reference`.

[Note: packed int8 chunks]
A chunk of ``n`` values (one rank's shard) quantises into ``packed_nbytes(n, block_size, bits=bits)``
bytes, one int8 tensor, so that a whole collective is one collective of int8 (gloo and NCCL both
carry int8)::

    bytes [0, p)                  the payload: p = n for int8, p = ceil(n / 2) for int4
    bytes [p, q_end)              zero padding, q_end = p rounded up to a multiple of 4
    bytes [q_end, q_end + 4·nb)   scale[b] as float32 (native byte order), nb = ceil(n / block_size)

int8 (``bits=8``): byte i is ``q[i] = round_half_even(x[i] / scale[i // block_size])``, in
[-127, 127]. int4 (``bits=4``): q in [-7, 7], two values a byte: byte j holds ``q[2j]`` in its low
nibble and ``q[2j+1]`` in its high one (two's complement nibbles; as a signed byte
``16·q[2j+1] + (q[2j] & 15)``); for odd n the last high nibble is 0.
``scale[b] = max(|x|) over block b / QMAX`` (``QMAX`` = 127 or 7, :data:`QMAX_BY_BITS`) computed
in fp32 (symmetric, no zero point, as ZeRO++'s symmetric quantiser). Blocks start at the chunk's
first element; the last one may be partial. All arithmetic is fp32, whatever the input dtype:
``x / scale`` and ``q * scale`` round once each (IEEE division and product), so
``|x - q·scale| <= scale/2`` up to a few fp32 ulps of ``scale`` (for |x| < 2^127: at fp32's very
top ``QMAX · scale`` may round past the largest float). A block of zeros has scale 0 and
dequantises to zeros; a block whose scale is 0 by underflow (max |x| below QMAX·2^-149) also
dequantises to zeros; a block holding an inf or nan gets a non-finite scale, q = 0, and dequantises
to nan throughout (a diverged weight or gradient stays visible). The int8 all-gather of W chunks is
W·packed_nbytes bytes against 2·W·n for bf16: with the default 256-element blocks the payload is
1 + 4/256 bytes per value, 0.508x of bf16 (0.254x of fp32); int4 is 0.5 + 4/256, 0.258x of bf16.

[Note: block size]
256 elements by default (:data:`BLOCK_SIZE`), for int8 and int4: a scale costs 1.6% of the int8
bytes (3.1% of the int4 ones), and the error bound (half a scale, i.e. max|x|/254 of the block for
int8, max|x|/14 for int4) follows the largest value of 256 neighbours rather than of thousands.
ZeRO++ quantises in blocks too, but the paper fixes no size: DeepSpeed's CUDA quantiser picks the
group count, not the group size — for qgZ ``all_to_all_quant_reduce``
(``deepspeed/runtime/comm/coalesced_collectives.py``) passes ``max(rows, cols, world_size)`` groups
of a 2-D gradient to ``swizzle_quant``, i.e. blocks of ``min(rows, cols)`` values (4096 for a
4096 x 4096 weight). A flat segment mixes parameters of different shapes, so that rule has no
meaning here; 4096 (the largest allowed) comes closest to it and saves 2.9% of the int4 bytes for
a bound up to 16x looser. Any power of two in [32, 4096] works (:func:`check_block_size`).

Kernels: one program quantises ``ROWS`` blocks of one chunk (a ``[ROWS, block_size]`` tile: per-row
max, one division per element, correctly rounded (``div_rn``), round half to even with the
1.5·2^23 trick, exact for |y| < 2^22) and writes their values and scales into the chunk's slot of
the packed buffer (:func:`quantize_kernel`); one program dequantises ``ROWS`` blocks of one output
chunk from each of ``senders`` packed chunks, sums them in fp32 in sender order, and either stores
the sum (rounding fp32 -> bf16 to nearest even in integer arithmetic: the interpreter truncates on
``.to(tl.bfloat16)``) or quantises it again (:func:`dequantize_reduce_kernel`). ``quantize_int8`` is
the first kernel for one chunk at 8 bits, ``dequantize_int8`` the second with one sender.
"""

from __future__ import annotations

import torch

from flashfsdp.kernels.triton_helpers import cast_from_float32
from flashfsdp.kernels.triton_support import tl, triton
from flashfsdp.kernels.validation import check_flat_buffer, check_same_device

BLOCK_SIZE = 256  # default elements per quantisation block (see [Note: block size])
MIN_BLOCK_SIZE, MAX_BLOCK_SIZE = 32, 4096
QMAX_BY_BITS = {8: 127, 4: 7}  # symmetric ranges [-QMAX, QMAX]; -128 / -8 are never produced
QMAX = QMAX_BY_BITS[8]
ROWS_PER_PROGRAM = 2048  # elements per program: ROWS = ROWS_PER_PROGRAM // block_size blocks (at least 1)
NUM_WARPS = 4


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def check_block_size(op: str, block_size: object) -> int:
    """Return ``block_size`` if it is an int power of two in [32, 4096]; ``TypeError`` /
    ``ValueError`` naming ``op`` and ``block_size`` otherwise."""
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise TypeError(f"{op}: block_size must be an int, got {type(block_size).__name__}")
    if not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE or block_size & (block_size - 1):
        raise ValueError(
            f"{op}: block_size must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size}")
    return block_size


def check_bits(op: str, bits: object, name: str = "bits") -> int:
    """Return ``bits`` if it is 4 or 8 (an int); ``TypeError`` / ``ValueError`` naming ``op`` otherwise."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"{op}: {name} must be an int (4 or 8), got {type(bits).__name__}")
    if bits not in QMAX_BY_BITS:
        raise ValueError(f"{op}: {name} must be 4 or 8, got {bits}")
    return bits


def check_count(op: str, name: str, value: object, minimum: int = 1) -> int:
    """Return ``value`` if it is an int >= ``minimum``; ``TypeError`` / ``ValueError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{op}: {name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{op}: {name} must be an int >= {minimum}, got {value!r}")
    return value


def num_blocks(numel: int, block_size: int = BLOCK_SIZE) -> int:
    """Blocks (scales) of a chunk of ``numel`` values: ``ceil(numel / block_size)``."""
    return -(-numel // block_size)


def payload_nbytes(numel: int, bits: int = 8) -> int:
    """Bytes of a chunk's quantised values: ``numel`` at 8 bits, ``ceil(numel / 2)`` at 4."""
    return numel if bits == 8 else -(-numel // 2)


def scales_offset(numel: int, bits: int = 8) -> int:
    """Byte offset of the scales in a packed chunk of ``numel`` values (the payload rounded up to 4)."""
    return _round_up(payload_nbytes(numel, bits), 4)


def packed_nbytes(numel: int, block_size: int = BLOCK_SIZE, *, bits: int = 8) -> int:
    """Bytes of one packed chunk of ``numel`` values (see [Note: packed int8 chunks]).

    Raises:
        TypeError, ValueError: a negative ``numel``, a bad ``block_size`` or ``bits``.
    """
    check_block_size("packed_nbytes", block_size)
    check_bits("packed_nbytes", bits)
    if numel < 0:
        raise ValueError(f"packed_nbytes: numel must be >= 0, got {numel}")
    return scales_offset(numel, bits) + 4 * num_blocks(numel, block_size)


def check_packed(op: str, packed: object, nbytes: int, what: str, name: str = "packed") -> torch.Tensor:
    """Check a packed buffer: an int8 tensor, 1-D and contiguous, of ``nbytes`` bytes (``what``
    needing them), starting on a 4-byte boundary (its scales are float32)."""
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(packed).__name__}")
    if packed.dtype != torch.int8:
        raise TypeError(f"{op}: {name} must be an int8 tensor, got {packed.dtype}")
    if packed.dim() != 1 or not packed.is_contiguous():
        raise ValueError(f"{op}: {name} must be 1-D and contiguous, got shape {tuple(packed.shape)} "
                         f"and stride {packed.stride()}")
    if packed.numel() != nbytes:
        raise ValueError(f"{op}: {name} has {packed.numel()} bytes but {what} need {nbytes} "
                         f"(flashfsdp.kernels.quantize.packed_nbytes)")
    if packed.device.type != "meta" and packed.numel() and packed.data_ptr() % 4:
        raise ValueError(f"{op}: {name} must start on a 4-byte boundary (its scales are float32)")
    return packed


def check_disjoint(op: str, a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    """Raise ``ValueError`` if the memory of ``a`` and ``b`` overlaps."""
    if a.numel() == 0 or b.numel() == 0:
        return
    a_lo, b_lo = a.data_ptr(), b.data_ptr()
    if a_lo < b_lo + b.numel() * b.element_size() and b_lo < a_lo + a.numel() * a.element_size():
        raise ValueError(f"{op}: {a_name} and {b_name} overlap in memory; pass separate buffers")


def validate_quantize(src: torch.Tensor, packed: torch.Tensor, block_size: int) -> int:
    """Check :func:`flashfsdp.kernels.quantize_int8`'s arguments; return ``block_size``."""
    op = "quantize_int8"
    block_size = check_block_size(op, block_size)
    src = check_flat_buffer(op, "src", src)
    check_packed(op, packed, packed_nbytes(src.numel(), block_size), f"{src.numel()} values")
    check_same_device(op, "packed", packed, "src", src)
    check_disjoint(op, "src", src, "packed", packed)
    return block_size


def validate_dequantize(packed: torch.Tensor, out: torch.Tensor, chunks: int, block_size: int) -> tuple[int, int]:
    """Check :func:`flashfsdp.kernels.dequantize_int8`'s arguments; return ``(numel per chunk,
    block_size)``."""
    op = "dequantize_int8"
    block_size = check_block_size(op, block_size)
    out = check_flat_buffer(op, "out", out)
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"{op}: chunks must be an int >= 1, got {chunks!r}")
    if out.numel() % chunks:
        raise ValueError(f"{op}: out has {out.numel()} elements, not a multiple of chunks={chunks}")
    n = out.numel() // chunks
    check_packed(op, packed, chunks * packed_nbytes(n, block_size), f"{chunks} chunks of {n} values")
    check_same_device(op, "packed", packed, "out", out)
    check_disjoint(op, "packed", packed, "out", out)
    return n, block_size


def rows_per_program(block_size: int) -> int:
    """Blocks one program of the kernels handles."""
    return max(1, ROWS_PER_PROGRAM // block_size)


@triton.jit
def _quantize_tile(x, QMAX: tl.constexpr):
    """``(q, scale)`` of a ``[ROWS, BLOCK]`` fp32 tile, one block a row: ``scale = max|x| / QMAX``
    (nan where the row holds a nan), ``q = clamp(round_half_even(x / scale), ±QMAX)`` as fp32
    integers, 0 where the scale is 0 or not finite."""
    amax = tl.max(tl.abs(x), axis=1)
    has_nan = tl.max((x != x).to(tl.int32), axis=1) > 0
    # div_rn: IEEE division, as torch's (Triton's `/` on fp32 compiles to an approximate division)
    scale = tl.where(has_nan, float("nan"), tl.math.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)))
    usable = (scale > 0.0) & (scale < float("inf"))
    y = tl.math.div_rn(x, tl.broadcast_to(tl.where(usable, scale, 1.0)[:, None], x.shape))
    y = tl.where(usable[:, None], y, 0.0)
    y = (y + 12582912.0) - 12582912.0  # 1.5 * 2**23: rounds half to even, exact for |y| < 2**22
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    return y, scale


@triton.jit
def _store_payload(chunk_ptr, rows, q, n, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """Store the integer fp32 tile ``q`` (rows ``rows`` of a chunk of ``n`` values) as int8 bytes or
    int4 nibble pairs at ``chunk_ptr``."""
    if BITS == 8:
        idx = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        tl.store(chunk_ptr + idx, q.to(tl.int8), mask=idx < n)
    else:
        even, odd = tl.split(tl.reshape(q.to(tl.int32), (q.shape[0], BLOCK // 2, 2)))
        byte = rows[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
        tl.store(chunk_ptr + byte, (odd * 16 + (even & 15)).to(tl.int8), mask=byte < (n + 1) // 2)


@triton.jit
def _load_payload(chunk_ptr, rows, n, BLOCK: tl.constexpr, BITS: tl.constexpr):
    """The quantised values of rows ``rows`` of a chunk of ``n`` values at ``chunk_ptr`` as an fp32
    ``[ROWS, BLOCK]`` tile (0 past ``n``)."""
    if BITS == 8:
        idx = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        q = tl.load(chunk_ptr + idx, mask=idx < n, other=0).to(tl.float32)
    else:
        byte = rows[:, None] * (BLOCK // 2) + tl.arange(0, BLOCK // 2)[None, :]
        b = tl.load(chunk_ptr + byte, mask=byte < (n + 1) // 2, other=0).to(tl.int32)
        low = ((b & 15) ^ 8) - 8  # sign-extend the low nibble
        q = tl.reshape(tl.join(low, b >> 4), (b.shape[0], BLOCK)).to(tl.float32)
    return q


@triton.jit
def quantize_kernel(src_ptr, packed_ptr, scales_ptr, n, n_blocks, chunk_bytes, scales_start, nodes, local_size,
                    BLOCK: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr, QMAX: tl.constexpr):
    """Quantise blocks ``[pid1·ROWS, (pid1+1)·ROWS)`` of chunk ``g = pid0`` of ``src`` (``n`` values
    a chunk) into slot ``(g % local_size) · nodes + g // local_size`` of ``packed`` (``chunk_bytes``
    a slot; see [Note: qgZ layout] in :mod:`flashfsdp.kernels.quantize_grad`)."""
    chunk = tl.program_id(0).to(tl.int64)
    slot = (chunk % local_size) * nodes + chunk // local_size
    rows = tl.program_id(1).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    idx = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
    x = tl.load(src_ptr + chunk * n + idx, mask=idx < n, other=0.0).to(tl.float32)
    q, scale = _quantize_tile(x, QMAX)
    _store_payload(packed_ptr + slot * chunk_bytes, rows, q, n, BLOCK, BITS)
    # scales_ptr views the packed buffer as float32: slot s's scales start at float32 index
    # (s * chunk_bytes + scales_start) / 4 (both multiples of 4)
    tl.store(scales_ptr + (slot * chunk_bytes + scales_start) // 4 + rows, scale, mask=rows < n_blocks)


@triton.jit
def dequantize_reduce_kernel(packed_ptr, scales_ptr, out_ptr, out_scales_ptr, n, n_blocks, senders, chunks,
                             chunk_bytes, scales_start, out_chunk_bytes, out_scales_start,
                             BLOCK: tl.constexpr, ROWS: tl.constexpr, BITS: tl.constexpr, OUT_BITS: tl.constexpr,
                             OUT_QMAX: tl.constexpr):
    """Blocks ``[pid1·ROWS, (pid1+1)·ROWS)`` of output chunk ``c = pid0``: the sum over senders
    ``j = 0, 1, ...`` (in that order, fp32) of chunk ``j · chunks + c`` of ``packed`` dequantised;
    stored cast to ``out``'s dtype (``OUT_BITS == 0``) or quantised to ``OUT_BITS`` into chunk ``c`` of
    the packed ``out``."""
    chunk = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    total = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for j in range(senders):
        base = (j * chunks + chunk) * chunk_bytes
        q = _load_payload(packed_ptr + base, rows, n, BLOCK, BITS)
        scale = tl.load(scales_ptr + (base + scales_start) // 4 + rows, mask=rows < n_blocks, other=0.0)
        total = total + q * scale[:, None]
    if OUT_BITS == 0:
        idx = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        tl.store(out_ptr + chunk * n + idx, cast_from_float32(total, out_ptr.dtype.element_ty), mask=idx < n)
    else:
        q_out, scale_out = _quantize_tile(total, OUT_QMAX)
        _store_payload(out_ptr + chunk * out_chunk_bytes, rows, q_out, n, BLOCK, OUT_BITS)
        tl.store(out_scales_ptr + (chunk * out_chunk_bytes + out_scales_start) // 4 + rows, scale_out,
                 mask=rows < n_blocks)


def launch_quantize(src: torch.Tensor, packed: torch.Tensor, *, n: int, chunks: int, nodes: int, local_size: int,
                    bits: int, block_size: int) -> None:
    """Run :func:`quantize_kernel` over ``chunks`` chunks of ``n`` values (arguments validated), and
    zero each slot's padding bytes."""
    if n == 0:
        return
    payload, start = payload_nbytes(n, bits), scales_offset(n, bits)
    chunk_bytes = packed_nbytes(n, block_size, bits=bits)
    if start > payload:
        packed.view(chunks, chunk_bytes)[:, payload:start].zero_()
    nb, rows = num_blocks(n, block_size), rows_per_program(block_size)
    quantize_kernel[(chunks, triton.cdiv(nb, rows))](
        src, packed, packed.view(torch.float32), n, nb, chunk_bytes, start, nodes, local_size,
        BLOCK=block_size, ROWS=rows, BITS=bits, QMAX=float(QMAX_BY_BITS[bits]), num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )


def launch_dequantize_reduce(packed: torch.Tensor, out: torch.Tensor, *, n: int, senders: int, chunks: int,
                             bits: int, out_bits: int | None, block_size: int) -> None:
    """Run :func:`dequantize_reduce_kernel` (arguments validated): ``out`` a float buffer of
    ``chunks · n`` values (``out_bits`` None) or ``chunks`` packed chunks at ``out_bits``. FP
    contraction is off, so that ``total + q * scale`` rounds twice, as the reference does."""
    if n == 0:
        return
    nb, rows = num_blocks(n, block_size), rows_per_program(block_size)
    if out_bits is None:
        out_scales, out_chunk_bytes, out_start = out, 0, 0
    else:
        out_chunk_bytes, out_start = packed_nbytes(n, block_size, bits=out_bits), scales_offset(n, out_bits)
        if out_start > payload_nbytes(n, out_bits):
            out.view(chunks, out_chunk_bytes)[:, payload_nbytes(n, out_bits):out_start].zero_()
        out_scales = out.view(torch.float32)
    dequantize_reduce_kernel[(chunks, triton.cdiv(nb, rows))](
        packed, packed.view(torch.float32), out, out_scales, n, nb, senders, chunks,
        packed_nbytes(n, block_size, bits=bits), scales_offset(n, bits), out_chunk_bytes, out_start,
        BLOCK=block_size, ROWS=rows, BITS=bits, OUT_BITS=out_bits or 0,
        OUT_QMAX=float(QMAX_BY_BITS[out_bits or 8]), num_warps=NUM_WARPS, enable_fp_fusion=False,
    )


def quantize_int8_triton(src: torch.Tensor, packed: torch.Tensor, *, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Triton launcher of :func:`flashfsdp.kernels.quantize_int8` (same arguments, result and errors).

    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    block_size = validate_quantize(src, packed, block_size)
    launch_quantize(src, packed, n=src.numel(), chunks=1, nodes=1, local_size=1, bits=8, block_size=block_size)
    return packed


def dequantize_int8_triton(packed: torch.Tensor, out: torch.Tensor, *, chunks: int = 1,
                           block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Triton launcher of :func:`flashfsdp.kernels.dequantize_int8` (same arguments, result and errors).

    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1``.
    """
    n, block_size = validate_dequantize(packed, out, chunks, block_size)
    launch_dequantize_reduce(packed, out, n=n, senders=1, chunks=chunks, bits=8, out_bits=None,
                             block_size=block_size)
    return out
