"""The public kernel ops: each picks the Triton launcher or the plain-torch reference per call.

Rule (:func:`select_backend`): Triton for CUDA tensors when the kernels are compiled, Triton for
CPU tensors when they run under the Triton interpreter (``TRITON_INTERPRET=1`` set before import,
see [Note: interpreter mode is fixed at import] in :mod:`flashfsdp.kernels.triton_support`), the
reference otherwise (a device the kernels do not serve; CPU tensors without Triton) — except that
CUDA tensors without Triton raise :func:`~flashfsdp.kernels.triton_support.missing_triton_error`
(naming the extra to install) instead of falling back. :func:`use_backend` forces
one path for tests and benchmarks. :func:`backend_counts` says which path each op really took.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Iterator, Literal, Sequence

import torch

from flashfsdp.kernels import reference, triton_support
from flashfsdp.kernels.accumulate_grad_shard import accumulate_grad_shard_triton
from flashfsdp.kernels.flatten import flatten_triton
from flashfsdp.kernels.quantize import BLOCK_SIZE, dequantize_int8_triton, quantize_int8_triton
from flashfsdp.kernels.quantize_grad import dequantize_reduce_triton, quantize_grad_triton
from flashfsdp.kernels.unflatten import unflatten_triton

Backend = Literal["triton", "reference"]
BACKENDS: tuple[Backend, ...] = ("triton", "reference")

_TRITON_LAUNCHERS = {
    "flatten": flatten_triton,
    "unflatten": unflatten_triton,
    "accumulate_grad_shard": accumulate_grad_shard_triton,
    "quantize_int8": quantize_int8_triton,
    "dequantize_int8": dequantize_int8_triton,
    "quantize_grad": quantize_grad_triton,
    "dequantize_reduce": dequantize_reduce_triton,
}

# The backend forced by `use_backend`, or None for the automatic rule. A plain global rather than
# a context variable on purpose: autograd runs backward hooks on its own threads, which must see it.
_forced_backend: Backend | None = None


@contextlib.contextmanager
def use_backend(backend: Backend | None) -> Iterator[None]:
    """Force every op called inside the ``with`` block onto ``backend`` ("triton" or "reference").

    ``None`` restores the automatic rule. Forcing "triton" where it cannot run (Triton missing,
    CPU tensors without the interpreter, CUDA tensors under the interpreter) makes the ops raise
    ``RuntimeError``. Not thread-safe against concurrent ``use_backend`` calls.
    """
    global _forced_backend
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"use_backend: backend must be one of {BACKENDS} or None, got {backend!r}")
    previous, _forced_backend = _forced_backend, backend
    try:
        yield
    finally:
        _forced_backend = previous


def use_triton() -> contextlib.AbstractContextManager[None]:
    """Shorthand for ``use_backend("triton")``."""
    return use_backend("triton")


def use_reference() -> contextlib.AbstractContextManager[None]:
    """Shorthand for ``use_backend("reference")``."""
    return use_backend("reference")


def triton_device_type() -> str | None:
    """The device type the Triton kernels serve in this process: "cuda", "cpu" (interpreter), or None."""
    if not triton_support.AVAILABLE:
        return None
    return "cpu" if triton_support.INTERPRETED else "cuda"


def select_backend(device: torch.device) -> Backend:
    """The backend an op on tensors living on ``device`` uses now (see the module docstring).

    Raises:
        RuntimeError: CUDA tensors (or a forced "triton") where triton cannot be imported, naming the
            extra that installs it; a forced "triton" on a device the kernels do not serve.
    """
    served = triton_device_type()
    if _forced_backend == "triton":
        if served is None:
            raise triton_support.missing_triton_error("ops forced onto the Triton backend (use_backend)")
        if device.type != served:
            mode = "under the Triton interpreter" if served == "cpu" else "without TRITON_INTERPRET=1"
            raise RuntimeError(f"Triton backend forced but the kernels cannot run on {device} {mode}")
        return "triton"
    if _forced_backend == "reference":
        return "reference"
    if served is None and device.type == "cuda":
        raise triton_support.missing_triton_error(f"{device} tensors")
    return "triton" if device.type == served else "reference"


def _implementation(op: str, device_of: object, tensors: Sequence = ()):
    """The function running ``op`` for tensors on ``device_of``'s device (:func:`op_backend`'s
    choice; a non-tensor: the reference, whose validation then raises the TypeError)."""
    if not isinstance(device_of, torch.Tensor):
        return getattr(reference, op)
    backend = op_backend(op, device_of, tensors)
    return _TRITON_LAUNCHERS[op] if backend == "triton" else getattr(reference, op)


def op_backend(op: str, device_of: torch.Tensor, tensors: Sequence = (), *, float64: bool | None = None) -> Backend:
    """The backend that runs ``op`` now for tensors on ``device_of``'s device, counted in
    :func:`backend_counts`: :func:`select_backend`'s, except that any float64 tensor among
    ``device_of`` and ``tensors`` (or ``float64=True``, where the caller knows it without a scan)
    selects the reference: the kernels compute in fp32.

    Raises:
        RuntimeError: as :func:`select_backend`.
    """
    device_type = device_of.device.type
    backend = select_backend(device_of.device)
    if backend == "triton" and (_any_float64(device_of, tensors) if float64 is None
                                else float64 or device_of.dtype == torch.float64):
        backend = "reference"
    elif backend == "reference" and device_type == "cuda" and _forced_backend is None:
        _warn_cuda_on_reference()
    key = (op, backend, device_type)
    _counts[key] = _counts.get(key, 0) + 1
    return backend


# (op, backend, device type) -> calls since the last reset_backend_counts(); a plain dict updated
# from whichever thread runs the op (autograd's too): one increment per op call.
_counts: dict[tuple[str, Backend, str], int] = {}
_warned_cuda_on_reference = False


def backend_counts() -> dict[tuple[str, Backend, str], int]:
    """How many calls of each op ran on each backend, per device type, since the last
    :func:`reset_backend_counts` (or import): ``{("flatten", "triton", "cuda"): 12, ...}``. The
    ``gpu`` tests assert from it that the Triton kernels, not the reference, served CUDA tensors."""
    return dict(_counts)


def reset_backend_counts() -> None:
    """Start :func:`backend_counts` from zero."""
    _counts.clear()


def _warn_cuda_on_reference() -> None:
    """Warn once that CUDA tensors run the plain-torch reference (Triton missing or interpreted)."""
    global _warned_cuda_on_reference
    if _warned_cuda_on_reference:
        return
    _warned_cuda_on_reference = True
    why = (f"triton cannot be imported ({triton_support.IMPORT_ERROR!r})" if not triton_support.AVAILABLE
           else "the kernels were built for the Triton interpreter (TRITON_INTERPRET=1 at import)")
    warnings.warn(f"flashfsdp: CUDA tensors run the plain-torch reference kernels because {why}; "
                  f"unset TRITON_INTERPRET / install triton>={triton_support.MIN_TRITON} for the Triton kernels",
                  RuntimeWarning, stacklevel=4)


def _any_float64(first: torch.Tensor, tensors: Sequence) -> bool:
    return first.dtype == torch.float64 or any(
        isinstance(t, torch.Tensor) and t.dtype == torch.float64 for t in tensors)


def flatten(
    tensors: Sequence[torch.Tensor | None],
    offsets: Sequence[int],
    out: torch.Tensor,
    *,
    scale: float = 1.0,
    numels: Sequence[int] | None = None,
) -> torch.Tensor:
    """Pack many tensors into one flat buffer, with cast, scale and zeroed gaps; returns ``out``.

    For every entry i with a tensor ``t_i`` (any shape, n_i = ``t_i.numel()`` elements, read in
    row-major order)::

        out[offsets[i] : offsets[i] + n_i] = (t_i.reshape(-1).float() * scale).to(out.dtype)

    (``.double()`` instead of ``.float()`` when ``t_i`` or ``out`` is float64)
    the cast rounding to nearest even; every element of ``out`` no tensor covers is set to 0.
    A ``None`` entry stands for a tensor that does not exist (a parameter without a gradient):
    its range ``[offsets[i], offsets[i] + numels[i])`` is zeroed like any gap (length 0 without
    ``numels``). This is the job of FSDP2's ``torch._foreach_copy_`` into split views of the
    all-gather input (copy-in, with a cast to ``param_dtype``) and of ``torch._chunk_cat`` packing
    gradients for reduce-scatter (cast to ``reduce_dtype``, pre-divide ``scale``, zero padding),
    done here in one launch for a whole unit: the Triton path reads a device table of pointers,
    dtype codes, offsets and sizes, casts each entry from its own dtype (mixed input dtypes share
    the launch, no grouping by dtype) and writes the gaps' zeros in the same pass.

    Args:
        tensors: sequence of tensors of dtype float32, bfloat16, float16 or float64 (mixed dtypes allowed),
            or ``None``; all on ``out``'s device. Non-contiguous tensors are read through a
            ``.contiguous()`` copy.
        offsets: element offsets into ``out``, one per entry, in any order; the ranges must lie
            inside ``out`` and must not overlap.
        out: 1-D contiguous float32/bfloat16/float16/float64 buffer, written in place.
        scale: factor applied in fp32 before the cast (e.g. 1/world_size as pre-divide factor).
        numels: optional element count per entry; required to give ``None`` entries a length,
            and must equal ``t_i.numel()`` for tensors.

    Raises:
        TypeError: a non-tensor entry, an unsupported dtype, a non-int offset or a non-real scale.
        ValueError: a scale that is not finite in float32; length mismatch between tensors,
            offsets and numels; a negative, out-of-range or overlapping range; ``out`` not 1-D and
            contiguous; a tensor on another device, or sharing ``out``'s memory without being
            exactly ``out[offsets[i] : offsets[i] + n_i]``.
    """
    return _implementation("flatten", out, tensors)(
        tensors, offsets, out, scale=scale, numels=numels
    )


def unflatten(flat: torch.Tensor, offsets: Sequence[int], outs: Sequence[torch.Tensor]) -> None:
    """Copy ranges of one flat buffer out into many tensors, with cast; the inverse of :func:`flatten`.

    For every i, with n_i = ``outs[i].numel()``::

        outs[i].view(-1)[:] = flat[offsets[i] : offsets[i] + n_i].to(outs[i].dtype)

    (row-major order, rounding to nearest even on narrowing casts). This is the job of FSDP2's
    ``torch.split_with_sizes_copy`` (copy-out of the all-gather output), used by flashfsdp to write
    back full parameters (loading, summoning full parameters, CPU offload), one launch per call.

    Args:
        flat: 1-D contiguous float32/bfloat16/float16/float64 buffer.
        offsets: element offset of each output's range in ``flat``; ranges must lie inside ``flat``
            (they may overlap: reading twice is well defined).
        outs: tensors of any shape and dtype float32/bfloat16/float16/float64 on ``flat``'s device, written
            in place. Non-contiguous outputs are written through a contiguous temporary and copied
            back (correct, one extra pass). Outputs must not overlap each other.

    Raises:
        TypeError: a non-tensor output, an unsupported dtype, a non-int offset.
        ValueError: length mismatch between outs and offsets; a negative or out-of-range range;
            ``flat`` not 1-D and contiguous; an output on another device, or sharing ``flat``'s
            memory without being exactly ``flat[offsets[i] : offsets[i] + n_i]``.
    """
    return _implementation("unflatten", flat, outs)(
        flat, offsets, outs
    )


def accumulate_grad_shard(
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    scale: float = 1.0,
    accumulate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Add (or assign) a reduced gradient shard into the master gradient; return its norm and flag.

    Elementwise, in fp32 (in float64 when either tensor is float64), rounding once to
    ``dst.dtype`` (nearest even)::

        dst = (dst.float() + src.float() * scale).to(dst.dtype)    # accumulate=True
        dst = (src.float() * scale).to(dst.dtype)                  # accumulate=False

    and, from the same pass over the stored values, ``norm_sq = sum(dst.float() ** 2)`` and
    ``nonfinite = any(isinf(dst) | isnan(dst))``. This replaces FSDP2's post-reduce-scatter
    ``div_`` (post-divide factor), cast to the parameter dtype and ``sharded_param.grad += ...``,
    and hands gradient clipping (sum of the shards' ``norm_sq`` across ranks) and fp16 loss scaling
    (any rank's ``nonfinite``) their inputs without another read of the gradient.

    Args:
        src: reduce-scatter output, any shape, float32/bfloat16/float16/float64 (``reduce_dtype``);
            read through a ``.contiguous()`` copy if it is not contiguous.
        dst: master gradient shard, any shape with ``src.numel()`` elements, float32/bfloat16/
            float16/float64, on ``src``'s device, updated in place (through a contiguous temporary and a
            copy back if it is not contiguous).
        scale: factor applied to ``src`` in fp32 (e.g. the post-divide factor 1/world_size).
        accumulate: add into ``dst`` (True) or overwrite it (False, the first micro-batch).

    Returns:
        ``(norm_sq, nonfinite)``: a 0-dim float32 (float64 for a float64 ``dst``) tensor, the squared L2 norm of ``dst`` after the
        update (summed in fp32 blocks of the stored values; relative error ~1e-6), and a 0-dim
        bool tensor, true if ``dst`` holds any inf or nan; both on ``dst``'s device, without a
        host synchronisation.

    Raises:
        TypeError: non-tensor arguments, unsupported dtypes, a non-real scale.
        ValueError: a scale that is not finite in float32; ``src.numel() != dst.numel()``,
            different devices, ``src`` sharing ``dst``'s memory without being exactly ``dst``.
    """
    return _implementation("accumulate_grad_shard", dst, (src,))(
        src, dst, scale=scale, accumulate=accumulate
    )


def accumulate_grad_shards(
    srcs: Sequence[torch.Tensor],
    dsts: Sequence[torch.Tensor],
    *,
    scale: float = 1.0,
    accumulate: bool = True,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`accumulate_grad_shard` of every pair ``(srcs[i], dsts[i])`` with one ``scale`` and
    ``accumulate``: the reductions of a bucket of small units finished at once. Same values in
    ``dsts`` and the same returns per pair (``(norm_sq, nonfinite)``) as the single op; the
    reference makes one multi-tensor op per step for fp32 shards instead of several ops per shard,
    the Triton path launches the single kernel per pair.

    Args:
        srcs, dsts: pairs as :func:`accumulate_grad_shard`'s ``src`` and ``dst``, on one device.
        scale, accumulate: as :func:`accumulate_grad_shard`'s, for every pair.

    Returns:
        ``[(norm_sq, nonfinite), ...]``, one per pair, as :func:`accumulate_grad_shard` returns.

    Raises:
        TypeError, ValueError: as :func:`accumulate_grad_shard`, for the first bad pair; a
            ValueError if ``srcs`` and ``dsts`` differ in length.
    """
    if len(srcs) != len(dsts):
        raise ValueError(f"accumulate_grad_shards: {len(srcs)} srcs but {len(dsts)} dsts")
    if not dsts:
        return []
    if _implementation("accumulate_grad_shard", dsts[0], srcs[:1]) is reference.accumulate_grad_shard:
        return reference.accumulate_grad_shards(srcs, dsts, scale=scale, accumulate=accumulate)
    return [accumulate_grad_shard(s, d, scale=scale, accumulate=accumulate) for s, d in zip(srcs, dsts)]


def quantize_int8(src: torch.Tensor, packed: torch.Tensor, *, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Quantise ``src`` block-wise to int8 with one fp32 scale per block, into ``packed``; returns it.

    ZeRO++'s quantised weight all-gather (qwZ; Wang et al. 2023, arXiv:2306.10209, §3.1): per block
    b of ``block_size`` consecutive values (the last one may be partial), in fp32::

        scale[b] = max(|x| over block b) / 127
        q[i] = clamp(round_half_even(x[i] / scale[i // block_size]), -127, 127)   (0 where scale is 0)

    written into ``packed`` as described in [Note: packed int8 chunks] of
    :mod:`flashfsdp.kernels.quantize`: the n int8 values, zero padding to a multiple of 4, then the
    scales as float32. ``dequantize_int8`` gives back ``x`` within half a scale per element:
    ``|x - deq(q(x))| <= scale/2`` (up to a few fp32 ulps of the scale). A block holding an inf or
    nan gets a non-finite scale and dequantises to nan.

    Args:
        src: 1-D contiguous float32/bfloat16/float16/float64 tensor of n values (read as fp32).
        packed: 1-D contiguous int8 tensor of ``packed_nbytes(n, block_size)`` bytes on ``src``'s
            device, starting on a 4-byte boundary; written in place.
        block_size: values per scale, a power of two in [32, 4096] (default 256, see
            [Note: block size]).

    Raises:
        TypeError: a non-tensor, ``src`` not floating, ``packed`` not int8, a non-int block size.
        ValueError: a bad block size, ``src`` not 1-D and contiguous, ``packed`` of the wrong size,
            not 1-D and contiguous or misaligned, on another device, or overlapping ``src``.
    """
    return _implementation("quantize_int8", src, (packed,))(src, packed, block_size=block_size)


def dequantize_int8(packed: torch.Tensor, out: torch.Tensor, *, chunks: int = 1,
                    block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Dequantise ``chunks`` packed int8 chunks into ``out`` (cast to its dtype); returns ``out``.

    ``packed`` holds ``chunks`` consecutive chunks made by :func:`quantize_int8` from n values each
    (n = ``out.numel() // chunks``), e.g. the output of an all-gather of every rank's chunk; chunk c
    fills ``out[c·n : (c+1)·n]``::

        out[c·n + i] = cast(q_c[i] * scale_c[i // block_size])     (product in fp32, one rounding)

    This is the dequantisation into the unsharded buffer of ZeRO++ qwZ (Wang et al. 2023,
    arXiv:2306.10209), one launch for all ranks' chunks.

    Args:
        packed: 1-D contiguous int8 tensor of ``chunks * packed_nbytes(n, block_size)`` bytes,
            starting on a 4-byte boundary.
        out: 1-D contiguous float32/bfloat16/float16/float64 tensor of ``chunks * n`` elements on
            ``packed``'s device, written in place.
        chunks: the number of chunks (the all-gather's world size).
        block_size: the block size the chunks were quantised with.

    Raises:
        TypeError: a non-tensor, ``out`` not floating, ``packed`` not int8, a non-int block size.
        ValueError: a bad block size or ``chunks``, ``out.numel()`` not a multiple of ``chunks``,
            ``packed`` of the wrong size, misaligned or on another device, overlapping buffers.
    """
    return _implementation("dequantize_int8", out, (packed,))(packed, out, chunks=chunks, block_size=block_size)


def quantize_grad(src: torch.Tensor, packed: torch.Tensor, *, bits: int, nodes: int = 1, local_size: int = 1,
                  block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Quantise a reduce-scatter input segment by segment to int4 / int8 in the order of a
    hierarchical all-to-all (ZeRO++ qgZ); returns ``packed``.

    ZeRO++'s quantised gradient reduction (qgZ; Wang et al. 2023, arXiv:2306.10209, §3.3; DeepSpeed's
    ``swizzled_quantize`` kernel): ``src`` holds W = ``nodes · local_size`` segments of S values,
    segment g = m·L + l destined to rank g (node m, local rank l; L = ``local_size``), as
    :func:`flatten` packs a reduce-scatter input. Each segment is quantised as one chunk (blocks of
    ``block_size`` values from the segment's start, one fp32 scale each, in fp32)::

        scale[b] = max(|x| over block b) / QMAX            QMAX = 127 (bits=8) or 7 (bits=4)
        q[i] = clamp(round_half_even(x[i] / scale[i // block_size]), -QMAX, QMAX)   (0 where scale is 0)

    packed as in [Note: packed int8 chunks] of :mod:`flashfsdp.kernels.quantize` (int4: two values
    a byte, low nibble first) into slot ``l·N + m`` of ``packed`` (N = ``nodes``; [Note: qgZ
    layout] of :mod:`flashfsdp.kernels.quantize_grad`): the N segments for local rank l of every
    node lie together, ready for an all-to-all inside the node with equal splits. ``nodes=1``
    (or ``local_size=1``) keeps the segments in order; ``nodes=local_size=1`` quantises ``src`` as
    one chunk, and then ``bits=8`` gives the bytes of :func:`quantize_int8`. Each value
    dequantises within half its block's scale (up to a few fp32 ulps of the scale); a block
    holding an inf or nan gets a non-finite scale and dequantises to nan.

    Args:
        src: 1-D contiguous float32/bfloat16/float16/float64 tensor of W·S values (read as fp32).
        packed: 1-D contiguous int8 tensor of ``W · packed_nbytes(S, block_size, bits=bits)`` bytes
            on ``src``'s device, starting on a 4-byte boundary; written in place (padding zeroed).
        bits: 4 or 8 (ZeRO++ qgZ sends int4).
        nodes, local_size: the (nodes, ranks per node) shape of the W ranks.
        block_size: values per scale, a power of two in [32, 4096] (default 256, see
            [Note: block size] of :mod:`flashfsdp.kernels.quantize`).

    Raises:
        TypeError: a non-tensor, ``src`` not floating, ``packed`` not int8, a non-int ``bits``,
            ``block_size``, ``nodes`` or ``local_size``.
        ValueError: ``bits`` not 4 or 8, a bad block size, ``nodes`` or ``local_size`` < 1,
            ``src`` not 1-D and contiguous or not a multiple of W values, ``packed`` of the wrong
            size, not 1-D and contiguous or misaligned, on another device, or overlapping ``src``.
    """
    return _implementation("quantize_grad", src, (packed,))(
        src, packed, bits=bits, nodes=nodes, local_size=local_size, block_size=block_size)


def dequantize_reduce(packed: torch.Tensor, out: torch.Tensor, *, senders: int, numel: int, bits: int,
                      chunks: int = 1, out_bits: int | None = None, block_size: int = BLOCK_SIZE) -> torch.Tensor:
    """Sum the chunks received from ``senders`` ranks, dequantised, in fp32; write the sums or
    requantise them (ZeRO++ qgZ's step between the all-to-all hops); returns ``out``.

    ``packed`` is [senders][chunks][C] bytes, C = ``packed_nbytes(numel, block_size, bits=bits)``:
    what an all-to-all with equal splits receives, sender j's ``chunks`` packed chunks of ``numel``
    values each (made by :func:`quantize_grad` or by this op with ``out_bits``). For each chunk c::

        total[c] = deq(chunk (0, c)) + deq(chunk (1, c)) + ...     (fp32, from 0, sender order)
        deq(chunk)[i] = q[i] * scale[i // block_size]              (fp32 product)

    then, with ``out_bits=None``, ``out[c·numel : (c+1)·numel] = cast(total[c])`` (nearest even:
    the last hop, the reduce-scatter output); with ``out_bits`` 4 or 8, ``total[c]`` quantised as
    :func:`quantize_grad` quantises a segment, into chunk c of the packed ``out`` ([chunks][C']
    bytes, C' = ``packed_nbytes(numel, block_size, bits=out_bits)``), ready for the next
    all-to-all — dequantise, reduce and requantise fused in one pass, as DeepSpeed's
    ``quantized_reduction`` / ``dequant_reduce`` kernel. ``senders=1`` dequantises (bits=8:
    :func:`dequantize_int8`'s values). Error: each summed value is within the sum of its blocks'
    scales/2 over the senders (plus fp32 rounding), and a requantised one within another scale/2
    of the new block scale; a nan / inf block of any sender makes the block nan. See
    [Note: qgZ layout] of :mod:`flashfsdp.kernels.quantize_grad` for the hops.

    Args:
        packed: 1-D contiguous int8 tensor of ``senders · chunks · C`` bytes, 4-byte aligned.
        out: ``out_bits=None``: 1-D contiguous float32/bfloat16/float16/float64 tensor of
            ``chunks · numel`` elements; else a 1-D contiguous int8 tensor of ``chunks · C'`` bytes,
            4-byte aligned. On ``packed``'s device, written in place.
        senders: the number of ranks whose chunks are summed (>= 1).
        numel: values per chunk (S, the segment size; >= 0).
        bits: the bits ``packed`` was quantised with (4 or 8).
        chunks: chunks per sender (one sum each; the nodes of the next hop, or 1).
        out_bits: None for a float ``out``, or 4 / 8 to requantise into an int8 ``out``.
        block_size: the block size of ``packed`` (and of ``out`` when requantised).

    Raises:
        TypeError: a non-tensor, ``packed`` not int8, an int8 ``out`` without ``out_bits`` or a float
            one with it, a non-int ``bits``/``out_bits``/``senders``/``chunks``/``numel``/``block_size``.
        ValueError: ``bits`` / ``out_bits`` not 4 or 8, a bad block size, ``senders`` or ``chunks``
            < 1, ``numel`` < 0, a buffer of the wrong size, not 1-D and contiguous or misaligned,
            on another device, or overlapping the other.
    """
    return _implementation("dequantize_reduce", out if out_bits is None else packed, (packed, out))(
        packed, out, senders=senders, numel=numel, bits=bits, chunks=chunks, out_bits=out_bits,
        block_size=block_size)
