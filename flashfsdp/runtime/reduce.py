"""Gradient reduction of one unit: pack, reduce-scatter, accumulate (no nn.Module knowledge).

Per trainable flat group (DESIGN.md §2, step 5): one ``flatten`` launch on the compute stream
(as FSDP2's ``foreach_reduce``: the gradients are freed right after it) packs every unsharded
gradient into a T-element buffer in ``reduce_dtype`` (cast, pre-divide, zero padding, zeros where
no gradient) — or compacted per rank when some parameters are frozen (``reduce_plan.py``);
reduce-scatter into S elements on the reduce-scatter stream. The :class:`PendingReduce` it
returns finishes later: one ``accumulate_grad_shard`` launch post-divides, casts and adds into
``sharded_grad`` and returns the shard's squared norm and inf/nan flag from the same pass.

[Note: pre-divide and post-divide]
Summing W gradients in a low-precision ``reduce_dtype`` can overflow (fp16) or lose digits; so the
gradients are scaled by 1/f_pre before the reduction and by 1/f_post after it, f_pre·f_post = W,
with f_pre the power of two near sqrt(W) (FSDP1, ``_get_gradient_predivide_factor``). In fp32 the
whole division happens after the sum (f_pre = 1), as a single-process mean would. Under HSDP, W is
the whole data-parallel size R·S (FSDP2's ``_get_gradient_divide_factors``).

[Note: HSDP all-reduce]
With replicas (``unit.replicate_comm``), the reduce-scattered shard (summed over the S ranks of
the shard group, pre-divided) is all-reduced (summed) across the R replicas before the
all-reduce hook and the post-divide, as FSDP2's ``foreach_reduce`` does. The all-reduce needs
the reduce-scatter's result: on CUDA it is enqueued right behind the reduce-scatter on the
reduce-scatter stream when that is issued (the host does not wait); on CPU, where waiting
blocks, it is issued when the reduction is finished. With ``unit.requires_all_reduce`` off
(``set_requires_all_reduce(False)``) the shard is summed into ``unit.partial_reduce`` instead and
no gradient is accumulated; the next reduction with the all-reduce adds that sum in first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from flashfsdp.kernels import accumulate_grad_shard, flatten, unflatten

from . import loss_scale, trace
from .communicator import Work
from .flat_param import FlatParam
from .reduce_plan import ReducePlan

if TYPE_CHECKING:
    from .unit import ShardedUnit


def gradient_divide_factors(world_size: int, reduce_dtype: torch.dtype) -> tuple[float, float]:
    """(f_pre, f_post) with f_pre·f_post = W; f_pre = 1 for fp32/fp64 reductions.

    Source: FSDP1 ``_get_gradient_predivide_factor`` (fairscale's ``gradient_predivide_factor``).
    """
    if reduce_dtype in (torch.float32, torch.float64) or world_size == 1:
        return 1.0, float(world_size)
    factor = 1
    while world_size % factor == 0 and world_size / factor > factor:
        factor *= 2
    return float(factor), world_size / factor


def divide_factors(unit: "ShardedUnit", reduce_dtype: torch.dtype) -> tuple[float, float]:
    """The (pre, post) divide factors a unit uses: :func:`gradient_divide_factors`, unless
    ``unit.gradient_divide_factor`` sets the total division (split like W: the pre-divide stays)."""
    f_pre, f_post = gradient_divide_factors(unit.data_parallel_size, reduce_dtype)
    if unit.gradient_divide_factor is not None:
        total = float(unit.gradient_divide_factor)
        return (1.0, total) if f_pre == 1.0 else (f_pre, total / f_pre)
    return f_pre, f_post


@dataclass
class PendingReduce:
    """A reduce-scatter in flight and what is needed to accumulate its result."""

    unit: "ShardedUnit"
    group: FlatParam
    work: Work
    output: torch.Tensor
    accumulate: bool
    post_scale: float
    keepalive: list = field(default_factory=list)
    issued: "trace.Issued | None" = None  # when it was issued (for an active profile)
    local: list = field(default_factory=list)  # per parameter: got a gradient on this rank
    had: list = field(default_factory=list)  # per parameter: its piece held a gradient already
    plan: ReducePlan | None = None  # the compacted layout the output comes in (None: dense)
    across_replicas: bool = False  # HSDP: the all-reduce stage was started (see start_all_reduce)
    to_accumulate: bool = True  # False: the output went into the unit's partial sum

    def _expand(self) -> torch.Tensor:
        """A compacted output placed at its offsets in a zeroed shard-sized buffer."""
        full = torch.zeros(self.group.layout.shard_size, dtype=self.output.dtype, device=self.output.device)
        if self.plan.local:
            unflatten(self.output, [seg for seg, _, _ in self.plan.local],
                      [full[start : start + n] for _, start, n in self.plan.local])
        return full

    def _run_all_reduce_hook(self) -> None:
        unit, streams = self.unit, self.unit.streams
        with streams.use(unit.all_reduce_hook_stream):
            unit.all_reduce_hook(self.output)
        if unit.all_reduce_hook_stream is not None:
            streams.reduce_scatter.wait_stream(unit.all_reduce_hook_stream)

    def _wait_reduce_scatter(self) -> None:
        # On CPU the compute thread itself waits here; on CUDA the reduce-scatter stream does
        # (the compute stream's wait is recorded in streams.wait_for_reduce_scatter).
        streams = self.unit.streams
        with trace.waiting(self.issued, [self.work], streams.reduce_scatter, wait_span=not streams.is_cuda):
            self.work.wait()
        self.issued = None  # waited: a later wait (the all-reduce's) is not the reduce-scatter's

    def start_all_reduce(self) -> bool:
        """HSDP (see [Note: HSDP all-reduce]): wait for the reduce-scatter and issue the all-reduce
        of its output across the replicas (``self.work`` becomes the all-reduce's), or, with
        ``requires_all_reduce`` off, sum the output into ``unit.partial_reduce``. Returns False in
        that case (nothing to accumulate now), else True; a no-op without replicas. Run it on the
        reduce-scatter stream."""
        unit = self.unit
        if unit.replicate_comm is None or self.across_replicas:
            return self.to_accumulate
        self.across_replicas = True
        self._wait_reduce_scatter()
        partial = unit.partial_reduce.pop(id(self.group), None)
        if partial is not None or not unit.requires_all_reduce:
            if self.plan is not None:  # partial sums are dense: the frozen parameters may change
                self.output, self.plan = self._expand(), None
            if partial is not None:
                self.output.add_(partial[0])
                self.local = [a or b for a, b in zip(self.local, partial[1])]
            if not unit.requires_all_reduce:
                unit.partial_reduce[id(self.group)] = (self.output, self.local)
                self.to_accumulate = False
                return False
        with trace.label("all_reduce", unit.name):
            self.work = unit.replicate_comm.all_reduce(self.output, op="sum")
        return True

    def finish(self) -> None:
        """Wait for the reduce-scatter (and the all-reduce across replicas under HSDP) and
        accumulate into ``sharded_grad`` (fused norm and flag)."""
        streams, name = self.unit.streams, self.unit.name
        with streams.use(streams.reduce_scatter):
            if not self.start_all_reduce():
                self.keepalive.clear()
                return
            self._wait_reduce_scatter()
            grad = self.group.sharded_grad_buffer()
            if self.unit.all_reduce_hook is not None:
                self._run_all_reduce_hook()
            output = self.output if self.plan is None else self._expand()
            if output.device != grad.device:
                # CPU offload: the reduced shard comes to the host (this waits for it), where it
                # is accumulated; the optimizer then steps on the CPU.
                with trace.span("copy_to_host", name, "reduce_scatter", streams.reduce_scatter):
                    output = output.to(grad.device)
            with trace.span("accumulate", name, "reduce_scatter", streams.reduce_scatter):
                # With an armed loss scaler the same pass also unscales (see loss_scale.py).
                scale, unscaled_by = loss_scale.kernel_scale(self.group, self.post_scale, self.accumulate)
                sq_norm, nonfinite = accumulate_grad_shard(output, grad, scale=scale, accumulate=self.accumulate)
        self.group.grad_stats = (sq_norm, nonfinite, grad._version)
        loss_scale.record(self.group, unscaled_by)
        mask = self.group.grad_mask(self.local, self.had, self.unit.reduce_unused_params) if self.local else None
        self.group.expose_grads(mask)
        self.group.run_post_accumulate_grad_hooks()
        self.keepalive.clear()


def reduce_group(unit: "ShardedUnit", group: FlatParam) -> PendingReduce | None:
    """Pack and reduce-scatter (asynchronously) one trainable group's unsharded gradients; None if
    it has none. The unsharded parameters' ``.grad`` and the no-sync buffer are released."""
    grads = [p.grad for p in group.unsharded_params]
    local = [g is not None or acc for g, acc in zip(grads, group.accum_had_grad)]
    if not group.requires_grad or not any(local):
        return None
    reduce_dtype = unit.reduce_dtype or group.param_dtype
    loss_scale.warn_if_unscaled(unit.name, group.param_dtype, reduce_dtype)
    f_pre, f_post = divide_factors(unit, reduce_dtype)
    had = group.had_grads()
    accumulate = group.prepare_grad_accumulation()
    plan = group.reduce_plan()
    streams, rs = unit.streams, unit.streams.reduce_scatter
    # Packing runs on the compute stream (FSDP2's foreach_reduce), so that the gradients can go
    # at once; the reduce-scatter stream waits on it (use). See streams.py, [Note: memory safety].
    with torch.no_grad(), trace.span("pack", unit.name, "compute" if streams.is_cuda else "reduce_scatter"):
        packed = pack(group, grads, reduce_dtype, 1.0 / f_pre, plan, unit.device)
    with streams.use(rs), torch.no_grad():
        size = group.layout.shard_size if plan is None else plan.segment
        output = torch.empty(size, dtype=reduce_dtype, device=unit.device)
        with trace.issuing("reduce_scatter", unit.name, rs) as issued:
            work = issued.track((unit.rs_comm or unit.comm).reduce_scatter_tensor(output, packed, op="sum"))
        pending = PendingReduce(unit, group, work, output, accumulate, 1.0 / f_post, [packed], issued, local, had,
                                plan)
        read_event = streams.record(rs)  # the reduce-scatter has read ``packed``
        if streams.is_cuda:  # HSDP: enqueue the all-reduce behind it (see [Note: HSDP all-reduce])
            pending.start_all_reduce()
    # ``packed`` is a compute-stream block the reduce-scatter stream reads: the compute stream
    # must pass the reduce-scatter before it may be freed (see streams.hold_until_passed).
    streams.hold_until_passed(read_event, packed)
    for p in group.unsharded_params:
        p.grad = None
    return pending


def pack(group: FlatParam, grads: list, reduce_dtype: torch.dtype, scale: float, plan: ReducePlan | None,
         device: torch.device) -> torch.Tensor:
    """The reduce-scatter input: the gradients cast to ``reduce_dtype`` and scaled, in the group's
    T-element layout (one ``flatten`` launch) or compacted by ``plan`` (frozen parameters left out,
    see ``reduce_plan.py``); with a no-sync accumulation buffer, these gradients are added into it
    first and it is the source."""
    accum = group.unsharded_accum
    if accum is not None:
        sources = group.unsharded_views(accum)
        for view, g in zip(sources, grads):
            if g is not None:
                view.add_(g.reshape(-1))
        group.unsharded_accum = None
        group.accum_had_grad = [False] * len(group.accum_had_grad)
        if plan is None:
            return accum.mul_(scale) if scale != 1.0 else accum
        grads = sources
    if plan is None:
        packed = torch.empty(group.layout.total, dtype=reduce_dtype, device=device)
        flatten(grads, list(group.layout.offsets), packed, scale=scale, numels=list(group.layout.numels))
        return packed
    packed = torch.empty(plan.packed_size, dtype=reduce_dtype, device=device)
    parts = [None if grads[i] is None else grads[i].reshape(-1)[a : a + n] for i, a, n, _ in plan.entries]
    flatten(parts, [o for *_, o in plan.entries], packed, scale=scale, numels=[n for _, _, n, _ in plan.entries])
    return packed


def accumulate_unsharded(unit: "ShardedUnit") -> None:
    """A micro-batch without gradient sync ended: where ``reduce_dtype`` differs from the
    gradients' dtype, add them into a flat ``reduce_dtype`` buffer and release them, so that
    micro-batches accumulate in ``reduce_dtype`` as FSDP2 does (else autograd accumulates them in
    ``param_dtype``, e.g. bf16, losing digits). The next reduction reduces that buffer."""
    reduce_dtype = unit.reduce_dtype
    for group in unit.groups:
        grads = [p.grad for p in group.unsharded_params]
        if reduce_dtype is None or all(g is None or g.dtype == reduce_dtype for g in grads):
            continue
        with torch.no_grad():
            if group.unsharded_accum is None:
                group.unsharded_accum = torch.zeros(group.layout.total, dtype=reduce_dtype, device=unit.device)
            for i, (view, g) in enumerate(zip(group.unsharded_views(group.unsharded_accum), grads)):
                if g is not None:
                    view.add_(g.reshape(-1))
                    group.accum_had_grad[i] = True
        for p in group.unsharded_params:
            p.grad = None
