"""accumulate_grad_shard in Triton: reduced shard -> master gradient, with squared norm and flag.

The op's contract is :func:`flashfsdp.kernels.accumulate_grad_shard` (docstring in
:mod:`flashfsdp.kernels.dispatch`); its reference is
:func:`flashfsdp.kernels.reference.accumulate_grad_shard`.

Two launches, no atomics, deterministic:
1. :func:`accumulate_kernel`, one program per ``BLOCK`` elements: ``dst = cast(dst + src*scale)``
   in fp32, then from the values just stored (cast back to fp32) its block's sum of squares and
   whether any is inf/nan, into per-block partial buffers.
2. :func:`finalize_kernel`, a single program: sums the partial sums in a fixed order (fp64
   accumulator) and ORs the flags into the 0-dim outputs.
The partial sums are fp32 tree sums of ``BLOCK`` squares, so the norm's relative error stays near
1e-7 whatever the shard's size. FP contraction is disabled (``enable_fp_fusion=False``) so that
``dst + src*scale`` rounds twice, as the reference does, instead of once in an FMA.
"""

from __future__ import annotations

import torch

from flashfsdp.kernels.triton_helpers import cast_from_float32
from flashfsdp.kernels.triton_support import tl, triton
from flashfsdp.kernels.validation import validate_accumulate_grad_shard

BLOCK = 4096  # elements per program of the update pass
NUM_WARPS = 8
FINALIZE_BLOCK = 1024  # partials summed per step of the single finalize program
FINALIZE_WARPS = 4


@triton.jit
def accumulate_kernel(
    src_ptr, dst_ptr, partial_sum_ptr, partial_flag_ptr, n, scale,
    BLOCK: tl.constexpr, ACCUMULATE: tl.constexpr, APPLY_SCALE: tl.constexpr,
):
    """Update one block of ``dst`` and record its sum of squares and inf/nan flag."""
    pid = tl.program_id(0).to(tl.int64)
    idx = pid * BLOCK + tl.arange(0, BLOCK)
    mask = idx < n
    x = tl.load(src_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    if APPLY_SCALE:
        x = x * scale
    if ACCUMULATE:
        x = tl.load(dst_ptr + idx, mask=mask, other=0.0).to(tl.float32) + x
    stored = cast_from_float32(x, dst_ptr.dtype.element_ty)
    tl.store(dst_ptr + idx, stored, mask=mask)
    y = tl.where(mask, stored.to(tl.float32), 0.0)
    tl.store(partial_sum_ptr + pid, tl.sum(y * y, axis=0))
    nonfinite = (y != y) | (tl.abs(y) == float("inf"))
    tl.store(partial_flag_ptr + pid, tl.max(nonfinite.to(tl.int32), axis=0))


@triton.jit
def finalize_kernel(partial_sum_ptr, partial_flag_ptr, n_partials, norm_sq_ptr, flag_ptr, BLOCK: tl.constexpr):
    """Single program: ``norm_sq = sum(partial sums)`` (fp64 accumulator), ``flag = any(flags)``."""
    total = tl.zeros([BLOCK], dtype=tl.float64)
    flags = tl.zeros([BLOCK], dtype=tl.int32)
    for start in range(0, n_partials, BLOCK):
        idx = start + tl.arange(0, BLOCK)
        mask = idx < n_partials
        total += tl.load(partial_sum_ptr + idx, mask=mask, other=0.0).to(tl.float64)
        flags = tl.maximum(flags, tl.load(partial_flag_ptr + idx, mask=mask, other=0))
    tl.store(norm_sq_ptr, tl.sum(total, axis=0).to(tl.float32))
    tl.store(flag_ptr, (tl.max(flags, axis=0) > 0).to(tl.uint8))


def accumulate_grad_shard_triton(
    src: torch.Tensor,
    dst: torch.Tensor,
    *,
    scale: float = 1.0,
    accumulate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton launcher of :func:`flashfsdp.kernels.accumulate_grad_shard` (same contract).

    A non-contiguous ``src`` is read through ``.contiguous()``; a non-contiguous ``dst`` is updated
    in a contiguous temporary and copied back. Runs on CUDA tensors, or on CPU tensors under
    ``TRITON_INTERPRET=1``.
    """
    scale = validate_accumulate_grad_shard(src, dst, scale)
    device = dst.device
    norm_sq = torch.empty((), dtype=torch.float32, device=device)
    flag = torch.empty((), dtype=torch.uint8, device=device)
    n = dst.numel()
    if n == 0:
        return norm_sq.zero_(), flag.zero_().view(torch.bool)
    src = src.contiguous()
    target = dst
    if not dst.is_contiguous():
        target = dst.contiguous() if accumulate else torch.empty(dst.shape, dtype=dst.dtype, device=device)
    n_blocks = triton.cdiv(n, BLOCK)
    partial_sums = torch.empty(n_blocks, dtype=torch.float32, device=device)
    partial_flags = torch.empty(n_blocks, dtype=torch.int32, device=device)
    accumulate_kernel[(n_blocks,)](
        src, target, partial_sums, partial_flags, n, scale,
        BLOCK=BLOCK, ACCUMULATE=accumulate, APPLY_SCALE=scale != 1.0,
        num_warps=NUM_WARPS, enable_fp_fusion=False,
    )
    finalize_kernel[(1,)](
        partial_sums, partial_flags, n_blocks, norm_sq, flag, BLOCK=FINALIZE_BLOCK, num_warps=FINALIZE_WARPS
    )
    if target is not dst:
        dst.copy_(target)
    return norm_sq, flag.view(torch.bool)
