"""Gradient reduction of one unit: pack, reduce-scatter, accumulate (no nn.Module knowledge).

Per trainable flat group (the step protocol's ``gradients_ready``, docs/architecture.md): one
``flatten`` launch on the compute stream (as FSDP2's ``foreach_reduce``: the gradients are freed
right after it) packs every unsharded
gradient into the rank-major reduce-scatter input in ``reduce_dtype``: rank r's segment holds
chunk r of every gradient at the shard's offsets (cast, pre-divide, zero padding, zeros where no
gradient; the chunks of ``Shard(k)`` parameters, k != 0, are copied along k with torch ops after
the launch, ``dim_chunks.py``), then one flag per parameter (see [Note: gradients of unused parameters] in
``grad_shard.py``). Frozen parameters are left out: the segment is then laid out by the trainable
parameters' sub-layout (``FlatParam.reduce_layout``). The reduce-scatter into one segment runs on
the reduce-scatter stream (with ``unit.reduce_quantization``, ZeRO++ qgZ's quantised hierarchical
all-to-all in its place: ``quantized_reduce.py``). The :class:`PendingReduce` it returns finishes later: one
``accumulate_grad_shard`` launch post-divides, casts and adds the segment's shard part into
``sharded_grad`` and returns the shard's squared norm and inf/nan flag from the same pass.

[Note: pre-divide and post-divide]
Summing W gradients in a low-precision ``reduce_dtype`` can overflow (fp16) or lose digits; so the
gradients are scaled by 1/f_pre before the reduction and by 1/f_post after it, f_pre·f_post = W,
with f_pre the power of two near sqrt(W) (FSDP1, ``_get_gradient_predivide_factor``). In fp32 the
whole division happens after the sum (f_pre = 1), as a single-process mean would. Under HSDP, W is
the whole data-parallel size R·S (FSDP2's ``_get_gradient_divide_factors``).

[Note: all-reduce hook]
``set_all_reduce_hook``'s hook gets FSDP2's reduce output (``foreach_reduce``): the padded chunks
(``ceil(d_i / W)`` rows each) of the parameters that got a gradient on this rank (all trainable
ones with ``reduce_unused_params``), back to back in ``reduce_dtype``, without the flags and the
alignment gaps of the segment, divided as FSDP2 divides them before its hook
(:func:`fsdp2_hook_division`: the average for fp32/bf16, the sum under
``force_sum_reduction``, pre-divided for fp16). What the hook writes into it is copied back and
the accumulation divides by the rest. One call per trainable flat group and reduction (FSDP2:
per parameter group, one per unit unless its parameters differ in dtype).

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

import math
from dataclasses import dataclass, field
from typing import Sequence

import torch

from flashfsdp.kernels import accumulate_grad_shard, accumulate_grad_shards, flatten, unflatten

from . import loss_scale, trace
from .communicator import Work
from .dim_chunks import full_to_chunks
from .flat_param import FlatParam
from .layout import ShardLayout



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


def fsdp2_hook_division(total: float, reduce_dtype: torch.dtype, force_sum: bool) -> float:
    """What FSDP2 has divided the summed gradients by when its all-reduce hook sees them, the
    whole division being ``total`` (``_get_gradient_divide_factors``): all of it for fp32 and bf16
    reductions (AVG, or PREMUL_SUM by 1/factor), nothing with ``force_sum``, and for other dtypes
    (fp16) the power-of-two pre-divide near sqrt(total)."""
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return 1.0 if force_sum else total
    pre = 1
    while total % pre == 0 and total / pre > pre:
        pre *= 2
    return float(pre)


def segment_numel(layout: ShardLayout, params: int) -> int:
    """R, the elements of one rank's reduce-scatter segment (the reduce-scatter's output; its input
    is W of them) over ``layout`` with ``params`` parameters reduced: the shard's S elements, then
    one flag per parameter, padded to the layout's alignment."""
    return layout.shard_size + -(-params // layout.align) * layout.align


class ReduceLayout:
    """The reduce-scatter layout of one reduction of a group (built once per pattern of trainable
    parameters and kept on the group).

    Attributes:
        layout: the shard layout of the parameters reduced (the group's, or its trainable
            parameters' sub-layout).
        keep: the group's index of each parameter of ``layout``.
        segment: R, the elements of one rank's segment (the reduce-scatter output): the shard's
            S elements, then one flag per parameter, padded to the alignment (:func:`segment_numel`).
        entries: what :func:`pack` moves, per non-empty chunk: ``(group parameter index, offset in
            the flattened gradient, offset in the packed buffer, elements)``.
        strided: ``(group parameter index, index in layout)`` of each ``Shard(k)`` parameter
            (k != 0), whose chunks :func:`pack` copies along k.
    """

    def __init__(self, layout: ShardLayout, keep: tuple[int, ...]):
        self.layout, self.keep = layout, keep
        self.segment = segment_numel(layout, len(keep))
        self.entries = tuple((keep[s.param_index], s.param_offset, s.rank * self.segment + layout.offsets[s.param_index],
                              s.numel) for s in layout.segments)
        self.strided = tuple((keep[i], i) for i in layout.strided)
        self.flag_offsets = tuple(r * self.segment + layout.shard_size for r in range(layout.world_size))
        self.dense = keep == tuple(range(len(layout.shapes)))
        # flatten's offsets and numels of every pack: the entries', then one run of flags per segment
        self.pack_offsets = [o for _, _, o, _ in self.entries] + list(self.flag_offsets)
        self.pack_ranks = [s.rank for s in layout.segments] + list(range(layout.world_size))  # per pack entry
        self.pack_numels = [n for *_, n in self.entries] + [len(keep)] * len(self.flag_offsets)
        # the entries that take a whole gradient (W = 1, or a parameter on one rank): no slice
        self.whole = tuple(s.param_offset == 0 and s.numel == math.prod(layout.shapes[s.param_index])
                           for s in layout.segments)

    @classmethod
    def dense_of(cls, group: FlatParam) -> "ReduceLayout":
        """The layout of a reduction of every parameter of ``group``."""
        cache = group.__dict__.setdefault("_reduce_layout_cache", {})
        key = (True,) * len(group.shapes)
        if key not in cache:
            cache[key] = cls(group.layout, tuple(range(len(group.shapes))))
        return cache[key]

    @classmethod
    def of(cls, group: FlatParam) -> "ReduceLayout":
        """The layout of ``group``'s next reduction (its trainable parameters now)."""
        cache = group.__dict__.setdefault("_reduce_layout_cache", {})
        trainable = tuple(p.requires_grad for p in group.sharded_params)
        if trainable not in cache:
            sub = group.reduce_layout()
            keep = tuple(range(len(group.shapes))) if sub is None else tuple(i for i, t in enumerate(trainable) if t)
            cache[trainable] = cls(group.layout if sub is None else sub, keep)
        return cache[trainable]


@dataclass
class PendingReduce:
    """A reduce-scatter in flight and what is needed to accumulate its result."""

    unit: "ShardedUnit"
    group: FlatParam
    work: Work
    output: torch.Tensor
    accumulate: bool
    post_scale: float
    rlayout: ReduceLayout
    keepalive: list = field(default_factory=list)
    issued: "trace.Issued | None" = None  # when it was issued (for an active profile)
    local: list = field(default_factory=list)  # per parameter: got a gradient on this rank
    had: list = field(default_factory=list)  # per parameter: its chunk held a gradient already
    across_replicas: bool = False  # HSDP: the all-reduce stage was started (see start_all_reduce)
    to_accumulate: bool = True  # False: the output went into the unit's partial sum
    in_place: bool = False  # the output is to become the gradient shard ([Note: reduced in place])

    def _expand(self) -> None:
        """Make the output dense: a segment of the group's own layout, the reduced parameters'
        chunks and flags at their places, zeros for the others."""
        rl, group = self.rlayout, self.group
        full_rl = ReduceLayout.dense_of(group)
        full = torch.zeros(full_rl.segment, dtype=self.output.dtype, device=self.output.device)
        S, S_sub = group.layout.shard_size, rl.layout.shard_size
        outs, offsets = [], []
        for k, i in enumerate(rl.keep):
            n = group.layout.local_numel(group.rank, i)
            outs.append(full[group.layout.offsets[i] : group.layout.offsets[i] + n])
            offsets.append(rl.layout.offsets[k])
            outs.append(full[S + i : S + i + 1])
            offsets.append(S_sub + k)
        unflatten(self.output, offsets, outs)
        self.output, self.rlayout = full, full_rl

    def got_anywhere(self) -> list[bool]:
        """Per parameter of the group: whether any rank gave it a gradient (the summed flags)."""
        S = self.rlayout.layout.shard_size
        flags = self.output[S : S + len(self.rlayout.keep)].ne(0).tolist()
        out = [False] * len(self.group.shapes)
        for i, flag in zip(self.rlayout.keep, flags):
            out[i] = flag
        return out

    def _run_all_reduce_hook(self) -> None:
        """Call the unit's all-reduce hook on FSDP2's reduce output (see [Note: all-reduce hook])
        and take back what the hook wrote; the accumulation then divides by what is left."""
        unit, streams, out, rl = self.unit, self.unit.streams, self.output, self.rlayout
        f_pre, f_post = divide_factors(unit, out.dtype)
        before = fsdp2_hook_division(f_pre * f_post, out.dtype, unit.force_sum_reduction)
        shard = out[: rl.layout.shard_size]
        if f_pre != before:
            shard.mul_(f_pre / before)
        regions = [shard[rl.layout.offsets[k] : rl.layout.offsets[k] + rl.layout.padded_numel(k)]
                   for k, i in enumerate(rl.keep) if self.local[i] or unit.reduce_unused_params]
        view = torch.cat(regions) if regions else out.new_empty(0)
        with streams.use(unit.all_reduce_hook_stream):
            unit.all_reduce_hook(view)
        if unit.all_reduce_hook_stream is not None:
            streams.reduce_scatter.wait_stream(unit.all_reduce_hook_stream)
        for region, value in zip(regions, view.split([r.numel() for r in regions])):
            region.copy_(value)
        self.post_scale = before / (f_pre * f_post)

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
            if not self.rlayout.dense:  # partial sums are dense: the frozen parameters may change
                self._expand()
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
        ready = self._ready()
        if ready is None:
            return
        output, grad, scale, unscaled_by = ready
        streams = self.unit.streams
        with streams.use(streams.reduce_scatter), trace.span("accumulate", self.unit.name, "reduce_scatter",
                                                             streams.reduce_scatter):
            sq_norm, nonfinite = accumulate_grad_shard(output, grad, scale=scale, accumulate=self.accumulate)
        del output, ready  # a view of an output reduced in place would hold the gradient's memory
        self._done(grad, sq_norm, nonfinite, unscaled_by)

    def _ready(self):
        """Everything of :meth:`finish` before the accumulation: ``(reduced shard, gradient shard,
        the accumulation's scale, the loss scale it divides by)``, or None where nothing is to be
        accumulated now (HSDP without the all-reduce: the shard went into the partial sum)."""
        streams, name = self.unit.streams, self.unit.name
        with streams.use(streams.reduce_scatter):
            if not self.start_all_reduce():
                self.keepalive.clear()
                return None
            self._wait_reduce_scatter()
            grad = (self.group.adopt_reduce_output(self.output) if self.in_place
                    else self.group.sharded_grad_buffer())
            if self.unit.all_reduce_hook is not None:
                self._run_all_reduce_hook()
            if not self.rlayout.dense:
                self._expand()
            output = self.output[: self.group.layout.shard_size]
            if output.device != grad.device:
                # CPU offload: the reduced shard comes to the host (this waits for it), where it
                # is accumulated; the optimizer then steps on the CPU.
                with trace.span("copy_to_host", name, "reduce_scatter", streams.reduce_scatter):
                    output = output.to(grad.device)
        # With an armed loss scaler the same pass also unscales (see loss_scale.py).
        scale, unscaled_by = loss_scale.kernel_scale(self.group, self.post_scale, self.accumulate)
        return output, grad, scale, unscaled_by

    def _done(self, grad: torch.Tensor, sq_norm: torch.Tensor, nonfinite: torch.Tensor, unscaled_by) -> None:
        """Everything of :meth:`finish` after the accumulation: the statistics, the ``.grad`` fields
        and the post-accumulate-grad hooks."""
        self.group.grad_stats = (sq_norm, nonfinite, grad._version)
        loss_scale.record(self.group, unscaled_by)
        mask = self.group.grad_mask(self.local, self.had, self.got_anywhere, self.unit.reduce_unused_params)
        if self.in_place:  # the flags are read: only the gradient shard holds the memory now
            self.output = None
        self.group.expose_grads(mask)
        self.group.run_post_accumulate_grad_hooks()
        self.keepalive.clear()


def finish_all(pending: Sequence[PendingReduce]) -> None:
    """:meth:`PendingReduce.finish` of each (one reduction's: every group at most once), with the
    accumulations of those that take the same scale and mode made by one
    :func:`accumulate_grad_shards` (a bucket's; one span ``accumulate`` named after its units)."""
    if len(pending) <= 1:
        for p in pending:
            p.finish()
        return
    name = trace.bucket_name(list(dict.fromkeys(p.unit.name for p in pending)))
    ready = [(p, p._ready()) for p in pending]
    batches: dict[tuple, list] = {}
    for p, r in ready:
        if r is not None:
            batches.setdefault((r[2], p.accumulate, r[1].device), []).append((p, r))
    streams = pending[0].unit.streams
    stats = {}
    with streams.use(streams.reduce_scatter), trace.span("accumulate", name, "reduce_scatter", streams.reduce_scatter):
        for (scale, accumulate, _), items in batches.items():
            results = accumulate_grad_shards([r[0] for _, r in items], [r[1] for _, r in items], scale=scale,
                                             accumulate=accumulate)
            stats.update(zip((id(p) for p, _ in items), results))
    ready = [(p, r and (None, *r[1:])) for p, r in ready]  # (as in finish)
    for p, r in ready:
        if r is not None:
            p._done(r[1], *stats[id(p)], r[3])


@dataclass
class Reduction:
    """What one group's next reduction takes, read before its pack (:func:`prepare_reduction`).

    Attributes:
        grads: the unsharded gradients to reduce, as plain tensors (None: no gradient).
        local: per parameter, it got a gradient on this rank (or in the no-sync buffer).
        had: per parameter, its sharded parameter holds a gradient (the reduction adds to it).
        accumulate: the gradient shard holds a gradient to add to.
        rlayout: the reduce-scatter layout.
        reduce_dtype: the reduction's dtype; f_pre, f_post: its divide factors.
    """

    grads: list
    local: list
    had: list
    accumulate: bool
    rlayout: ReduceLayout
    reduce_dtype: torch.dtype
    f_pre: float
    f_post: float


def prepare_reduction(unit: "ShardedUnit", group: FlatParam) -> Reduction | None:
    """Read what ``group``'s reduction takes (its gradient shard made to hold what the ``.grad``
    fields say); None if the group is frozen or has no gradient to reduce."""
    grads = group.unsharded_grads()  # plain tensors (a subclass's copied, a TP DTensor's local)
    local = [g is not None or acc for g, acc in zip(grads, group.accum_had_grad)]
    if not group.requires_grad or not any(local):
        return None
    reduce_dtype = unit.reduce_dtype or group.param_dtype
    loss_scale.warn_if_unscaled(unit.name, group.param_dtype, reduce_dtype)
    f_pre, f_post = divide_factors(unit, reduce_dtype)
    had = group.had_grads()
    accumulate = group.prepare_grad_accumulation()
    return Reduction(grads, local, had, accumulate, ReduceLayout.of(group), reduce_dtype, f_pre, f_post)


def reduce_group(unit: "ShardedUnit", group: FlatParam) -> PendingReduce | None:
    """Pack and reduce-scatter (asynchronously) one trainable group's unsharded gradients; None if
    it has none. The unsharded parameters' ``.grad`` and the no-sync buffer are released."""
    prepared = prepare_reduction(unit, group)
    if prepared is None:
        return None
    reduce_dtype, rlayout, local, f_pre = prepared.reduce_dtype, prepared.rlayout, prepared.local, prepared.f_pre
    streams, rs = unit.streams, unit.streams.reduce_scatter
    # Packing runs on the compute stream (FSDP2's foreach_reduce), so that the gradients can go
    # at once; the reduce-scatter stream waits on it (use). See streams.py, [Note: memory safety].
    with torch.no_grad(), trace.span("pack", unit.name, "compute" if streams.is_cuda else "reduce_scatter"):
        packed = pack(group, prepared.grads, local, reduce_dtype, 1.0 / f_pre, rlayout, unit.device)
    # The packed copy is ordered before any later use of their memory: the gradients go now, before
    # the output is allocated (FSDP2 frees them after its copy-in, likewise).
    prepared.grads = None
    for p in group.unsharded_params:
        p.grad = None
    with streams.use(rs), torch.no_grad():
        in_place = None
        if not prepared.accumulate and rlayout.dense and unit.replicate_comm is None:
            in_place = group.reduce_output(rlayout.segment, reduce_dtype, unit.device)
        output = torch.empty(rlayout.segment, dtype=reduce_dtype, device=unit.device) if in_place is None else in_place
        with trace.issuing("reduce_scatter", unit.name, rs) as issued:
            if unit.reduce_quantization is not None:  # ZeRO++ qgZ (quantized_reduce.py)
                work = unit.reduce_quantization.reduce_scatter(output, packed, rlayout.layout.shard_size)
            else:
                work = (unit.rs_comm or unit.comm).reduce_scatter_tensor(output, packed, op="sum")
            work = issued.track(work)
        pending = PendingReduce(unit, group, work, output, prepared.accumulate, 1.0 / prepared.f_post, rlayout,
                                [packed], issued, local, prepared.had, in_place=in_place is not None)
        read_event = streams.record(rs)  # the reduce-scatter has read ``packed``
        if streams.is_cuda:  # HSDP: enqueue the all-reduce behind it (see [Note: HSDP all-reduce])
            pending.start_all_reduce()
    # ``packed`` is a compute-stream block the reduce-scatter stream reads: the compute stream
    # must pass the reduce-scatter before it may be freed (see streams.hold_until_passed).
    streams.hold_until_passed(read_event, packed)
    return pending


def gradient_sources(group: FlatParam, grads: list) -> list:
    """The gradients a reduction packs: ``grads``, or, with a no-sync accumulation buffer, that
    buffer's per-parameter ranges after ``grads`` were added into it (the buffer is then released
    from the group)."""
    accum = group.unsharded_accum
    if accum is None:
        return grads
    sources = group.unsharded_views(accum)
    for view, g in zip(sources, grads):
        if g is not None:
            view.add_(g.reshape(-1))
    group.unsharded_accum = None
    group.accum_had_grad = [False] * len(group.accum_had_grad)
    return sources


def pack_sources(group: FlatParam, grads: list, local: list[bool], rlayout: ReduceLayout,
                 device: torch.device) -> list:
    """What :func:`pack` flattens, one entry per ``rlayout.pack_offsets``: the chunks of each
    reduced gradient of ``grads`` (:func:`gradient_sources`; as 1-D tensors, None where the
    parameter has no gradient), then the flags ``local`` once per rank segment."""
    # A whole contiguous gradient goes as it is (flatten reads any contiguous tensor as its
    # elements in order); a chunk of one is a slice of it flattened.
    tensors = [None if (g := grads[i]) is None else g if whole and g.is_contiguous() else g.reshape(-1)[o : o + n]
               for (i, o, _, n), whole in zip(rlayout.entries, rlayout.whole)]
    flags = _flags(group, tuple(map(bool, local)) if rlayout.dense else tuple(bool(local[i]) for i in rlayout.keep),
                   device)
    return tensors + [flags] * len(rlayout.flag_offsets)


def pack(group: FlatParam, grads: list, local: list[bool], reduce_dtype: torch.dtype, scale: float,
         rlayout: ReduceLayout, device: torch.device) -> torch.Tensor:
    """The reduce-scatter input (W segments of ``rlayout.segment`` elements, ``reduce_dtype``):
    chunk r of each reduced gradient, scaled, at rank r's segment's shard offsets, then the
    flags ``local`` of the reduced parameters in every segment; one ``flatten`` launch
    (:func:`pack_sources` of :func:`gradient_sources`). The chunks of ``Shard(k)`` gradients,
    k != 0, are not runs the launch can move: after it (which zeroes their ranges) they are cut
    along k into their segments with torch ops (``dim_chunks.full_to_chunks``, the cast then the
    power-of-two ``scale``)."""
    grads = gradient_sources(group, grads)
    tensors = pack_sources(group, grads, local, rlayout, device)
    packed = torch.empty(rlayout.layout.world_size * rlayout.segment, dtype=reduce_dtype, device=device)
    flatten(tensors, rlayout.pack_offsets, packed, scale=scale, numels=rlayout.pack_numels)
    for i, sub in rlayout.strided:
        if grads[i] is not None:
            full_to_chunks(grads[i].contiguous(), rlayout.layout, sub, packed, stride=rlayout.segment, scale=scale)
    return packed


_FLAG_CACHE_SIZE = 8


def _flags(group: FlatParam, values: tuple[bool, ...], device: torch.device) -> torch.Tensor:
    """The flags as a float32 tensor on ``device``, kept per pattern on the group (a pattern
    repeats step after step: no host-to-device copy per reduction)."""
    cache = group.__dict__.setdefault("_reduce_flags", {})
    key = (values, device)
    if key not in cache:
        if len(cache) >= _FLAG_CACHE_SIZE:
            cache.pop(next(iter(cache)))
        cache[key] = torch.tensor(values, dtype=torch.float32).to(device)
    return cache[key]


def accumulate_unsharded(unit: "ShardedUnit") -> None:
    """A micro-batch without gradient sync ended: where ``reduce_dtype`` differs from the
    gradients' dtype, add them into a flat ``reduce_dtype`` buffer and release them, so that
    micro-batches accumulate in ``reduce_dtype`` as FSDP2 does (else autograd accumulates them in
    ``param_dtype``, e.g. bf16, losing digits). The next reduction reduces that buffer."""
    reduce_dtype = unit.reduce_dtype
    for group in unit.groups:
        grads = group.unsharded_grads()
        if reduce_dtype is None or all(g is None or g.dtype == reduce_dtype for g in grads):
            continue
        with torch.no_grad():
            if group.unsharded_accum is None:
                group.unsharded_accum = torch.zeros(group.layout.unsharded_size, dtype=reduce_dtype,
                                                    device=unit.device)
            for i, (view, g) in enumerate(zip(group.unsharded_views(group.unsharded_accum), grads)):
                if g is not None:
                    view.add_(g.reshape(-1))
                    group.accum_had_grad[i] = True
        for p in group.unsharded_params:
            p.grad = None
