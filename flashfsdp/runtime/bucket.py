"""Buckets: one all-gather, or one reduce-scatter, for several small units (no nn.Module knowledge).

A model of many small units spends its step on per-collective costs — a launch, a latency, a
host round trip per unit — not on bytes. The step protocol (``step.py``, [Note: buckets]) decides
which units that run back to back share a collective; this module runs it on tensors, for units
sharded over the same communicator on the same device:

- **all-gather bucket** (:meth:`Buckets.unshard`): the flat groups of the bucket's units, by
  ``param_dtype``, are laid side by side in every rank's segment of one gathered buffer (rank-major,
  W·S_b elements, S_b the sum of their shard sizes S_g; group g at offset b_g of each segment).
  Copy-in is one multi-tensor copy (with the cast) of every group's ``sharded_flat`` into this
  rank's segment, then one all-gather, and at the wait one copy-out (one ``unflatten`` launch on
  CUDA) moves every chunk of every group into its unsharded parameters: chunk r of group g lies at
  r·S_b + b_g + (its offset in g's own rank segment). Each unit gets its own unsharded buffer, as
  when it all-gathers alone, so it reshards on its own. The gathered buffer is kept per bucket
  (:class:`GatherBucket`, its views built once) with its storage freed after copy-out, as a unit's
  own gathered buffer is.
- **reduce-scatter bucket** (:func:`reduce_units`): every trainable group's pack (chunk r of each
  gradient and the per-parameter flags, ``reduce.py``) goes into rank r's segment of one
  reduce-scatter input at the group's offset, in one ``flatten`` launch; one reduce-scatter; each
  group then finishes from its slice of the output as it does alone (post-divide, accumulate,
  HSDP all-reduce, all-reduce hook), so values are those of per-unit reductions: each output
  element is the same sum over the same ranks (bit-equal at W = 2; at larger W the collective
  may sum in another order for another buffer size, within that order's rounding).

Units with all-gather extensions, int8 all-gathers, CPU offload or ``Shard(k)`` parameters
(k != 0), and post-forward (hpZ) regathers, all-gather alone; units with reductions of several
dtypes, offload or ``Shard(k)`` parameters reduce alone (:func:`all_gather_class`,
:func:`reduce_class`).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Hashable, Sequence

import torch

from flashfsdp._torch_private import foreach_copy_
from flashfsdp.kernels import FlattenPlan, UnflattenPlan, flatten
from flashfsdp.kernels.dispatch import op_backend

from . import trace
from .communicator import LocalCommunicator
from .custom_collectives import CustomReduceScatter
from .flat_param import FlatParam
from .reduce import PendingReduce, ReduceLayout, divide_factors, gradient_sources, pack_sources, prepare_reduction
from .step import NOTHING
from .unit import AllGatherResult, ShardedUnit

__all__ = ["Buckets", "GatherBucket", "all_gather_class", "reduce_class", "reduce_units", "bucket_name"]

# Bucket layouts kept per root: a model whose buckets keep their composition needs one per bucket.
MAX_KEPT = 256


def bucket_name(units: Sequence[ShardedUnit]) -> str:
    """The name of a bucket in traces and the flight recorder (``trace.bucket_name`` of its units')."""
    return trace.bucket_name([u.name for u in units])


def _comm_id(comm) -> Hashable:
    """Which collectives a communicator runs: its identity, or "local" for any group of one rank
    (every ``LocalCommunicator`` is the same no-op)."""
    return "local" if isinstance(comm, LocalCommunicator) else id(comm)


def _plain_groups(unit: ShardedUnit) -> bool:
    return not any(g.offload or g.layout.strided for g in unit.groups)


def all_gather_class(unit: ShardedUnit) -> tuple[Hashable, int] | None:
    """``(class, gathered bytes)`` of ``unit``'s all-gather from its shard in a bucket;
    ``step.NOTHING`` for a unit without parameters; None where it must all-gather alone (see the
    module docstring)."""
    if not unit.groups:
        return NOTHING
    if unit.all_gather_dtype is not None or not _plain_groups(unit) or unit.extensions or unit.ag_comm is not None:
        return None  # (a custom all-gather runs alone: custom_collectives.py)
    nbytes = sum(g.layout.gathered_size * g.param_dtype.itemsize for g in unit.groups)
    return ("all_gather", _comm_id(unit.comm), unit.device), nbytes


def reduce_class(unit: ShardedUnit) -> tuple[Hashable, int] | None:
    """``(class, reduce-scatter input bytes)`` of ``unit``'s next reduction in a bucket;
    ``step.NOTHING`` if it has no trainable group; None where it must reduce alone."""
    groups = [g for g in unit.groups if g.requires_grad]
    if not groups:
        return NOTHING
    dtypes = {unit.reduce_dtype or g.param_dtype for g in groups}
    if len(dtypes) != 1 or not _plain_groups(unit) or unit.extensions or unit.reduce_quantization is not None:
        return None  # (a qgZ unit reduces alone: quantized_reduce.py)
    if isinstance(unit.rs_comm, CustomReduceScatter):
        return None  # (a custom reduce-scatter runs alone: custom_collectives.py)
    (reduce_dtype,) = dtypes
    f_pre, _ = divide_factors(unit, reduce_dtype)
    nbytes = sum(ReduceLayout.of(g).segment for g in groups) * unit.comm.world_size * reduce_dtype.itemsize
    return ("reduce_scatter", _comm_id(unit.rs_comm or unit.comm), unit.device, reduce_dtype, f_pre), nbytes


def _on_reference(op: str, tensor: torch.Tensor) -> bool:
    return op_backend(op, tensor) == "reference"


class GatherBucket:
    """The all-gather of one bucket's groups of one ``param_dtype``, laid out once (see the module
    docstring): the gathered buffer (its storage alive from unshard to copy-out), this rank's
    segment, and the copy-in and copy-out over fixed views.

    On one rank with every group's gathered layout its unsharded one (``ShardLayout.zero_copy``)
    there is nothing to gather: copy-in casts each shard straight into its unsharded buffer
    (:attr:`direct`), and there is no all-gather or copy-out.

    Args:
        groups: the flat groups (of units sharded over one communicator), one ``param_dtype``.
        rank, world_size: of that communicator.
    """

    def __init__(self, groups: Sequence[FlatParam], rank: int, world_size: int):
        self.groups = list(groups)
        first = self.groups[0]
        self.dtype, self.device = first.param_dtype, first.device
        self.direct = world_size == 1 and all(g.layout.zero_copy for g in self.groups)
        self.bases, base = [], 0
        for g in self.groups:
            self.bases.append(base)
            base += g.layout.shard_size
        self.segment = base  # S_b
        if self.direct:
            self._in_views = [g.unsharded_flat for g in self.groups]
            self.nbytes = 0
            return
        self.gathered = torch.empty(world_size * base, dtype=self.dtype, device=self.device)
        self.own = self.gathered[rank * base : (rank + 1) * base]
        self._in_views = [self.own[b : b + g.layout.shard_size] for g, b in zip(self.groups, self.bases)]
        self._in_plan = FlattenPlan([g.sharded_flat for g in self.groups], self.bases)
        offsets, targets = [], []
        for g, b in zip(self.groups, self.bases):
            lay, S = g.layout, g.layout.shard_size
            if lay.zero_copy:  # the group's gathered layout is its unsharded one: W runs of S
                for r in range(world_size):
                    n = min(S, lay.unsharded_size - r * S)
                    if n > 0:
                        offsets.append(r * base + b)
                        targets.append(g.unsharded_flat[r * S : r * S + n])
            else:
                for s, t in zip(lay.segments, g._copy_out_targets):
                    offsets.append(s.rank * base + b + s.gathered_offset - s.rank * S)
                    targets.append(t)
        self._offsets, self._targets = offsets, targets
        self._sources = [self.gathered[o : o + t.numel()].view(t.shape) for o, t in zip(offsets, targets)]
        self._out_plan = UnflattenPlan(offsets, targets)
        self.nbytes = self.gathered.numel() * self.gathered.element_size()
        self.gathered.untyped_storage().resize_(0)

    def copy_in(self) -> None:
        """Allocate the gathered buffer and cast every group's shard into this rank's segment
        (:attr:`direct`: into the groups' unsharded buffers)."""
        for g in self.groups:
            g.note_copy_in()
        if self.direct:
            with torch.no_grad():
                foreach_copy_(self._in_views, [g.sharded_flat for g in self.groups])
            return
        storage = self.gathered.untyped_storage()
        if storage.nbytes() != self.nbytes:
            storage.resize_(self.nbytes)
        with torch.no_grad():
            if _on_reference("flatten", self.own):
                foreach_copy_(self._in_views, [g.sharded_flat for g in self.groups])
            else:
                self._in_plan.run(self.own)

    def copy_out(self) -> None:
        """Move every chunk into the groups' unsharded parameters, then free the gathered buffer."""
        if self.direct:
            return
        with torch.no_grad():
            if _on_reference("unflatten", self.gathered):
                foreach_copy_(self._targets, self._sources)
            else:
                self._out_plan.run(self.gathered)
        self.gathered.untyped_storage().resize_(0)


class _BucketFinish:
    """What an all-gather bucket's :class:`AllGatherResult` does at its wait: copy-out (on CUDA on
    the all-gather stream, after what was enqueued there), returning the event recorded after it."""

    def __init__(self, parts: list[GatherBucket]):
        self.parts = parts

    def finish(self, works, streams, event):
        stream = streams.all_gather if streams is not None else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            if stream is not None and event is not None:
                stream.wait_event(event)
            for work in works:
                work.wait()
            for part in self.parts:
                part.copy_out()
            return streams.record(stream) if stream is not None else None


class Buckets:
    """The all-gather buckets of one root's units, laid out once per composition (at most
    :data:`MAX_KEPT` kept, least recently used dropped)."""

    def __init__(self):
        self._kept: OrderedDict[tuple, list[GatherBucket]] = OrderedDict()

    def _parts(self, units: Sequence[ShardedUnit]) -> list[GatherBucket]:
        groups = [g for u in units for g in u.groups]
        key = tuple((id(g), id(g.sharded_flat), id(g.unsharded_flat)) for g in groups)
        parts = self._kept.get(key)
        if parts is None:
            comm = units[0].comm
            by_dtype: dict[torch.dtype, list[FlatParam]] = {}
            for g in groups:
                by_dtype.setdefault(g.param_dtype, []).append(g)
            parts = [GatherBucket(gs, comm.rank, comm.world_size) for gs in by_dtype.values()]
            self._kept[key] = parts
            if len(self._kept) > MAX_KEPT:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(key)
        return parts

    def unshard(self, units: Sequence[ShardedUnit]) -> AllGatherResult:
        """Issue one all-gather per ``param_dtype`` for ``units`` (sharded, of one
        :func:`all_gather_class`); each unit is then UNSHARDING on the returned result."""
        first = units[0]
        streams, comm, name = first.streams, first.comm, bucket_name(units)
        buffers = [g.unsharded_flat for u in units for g in u.groups]
        versions = [b._version for b in buffers]
        ag = streams.all_gather
        with streams.use(ag), torch.no_grad():
            with trace.span("copy_in", name, "all_gather", ag):
                for unit in units:
                    for group in unit.groups:
                        group.alloc_unsharded(gathered=False)
                parts = self._parts(units)  # (views of the unsharded buffers: built while allocated)
                for part in parts:
                    part.copy_in()
            with trace.issuing("all_gather", name, ag) as issued:
                works = [issued.track(comm.all_gather_into_tensor(p.gathered, p.own)) for p in parts if not p.direct]
            event = streams.record(ag)
        result = AllGatherResult(works, buffers, versions, event, streams, issued, bucket=_BucketFinish(parts))
        for unit in units:
            unit.join_all_gather(result)
        return result


def reduce_units(units: Sequence[ShardedUnit]) -> list[PendingReduce]:
    """Pack every trainable group of ``units`` (of one :func:`reduce_class`) with gradients into one
    reduce-scatter input and issue it (asynchronously); one :class:`PendingReduce` per group, over
    its slice of the output. The unsharded parameters' ``.grad`` are released. Call ``finish()`` on
    each, in order, before reading the gradient shards."""
    entries = []
    for unit in units:
        for group in unit.groups:
            prepared = prepare_reduction(unit, group)
            if prepared is not None:
                entries.append((unit, group, prepared))
    if not entries:
        return []
    first = entries[0][0]
    W, device, streams = first.comm.world_size, first.device, first.streams
    reduce_dtype, f_pre = entries[0][2].reduce_dtype, entries[0][2].f_pre
    segment = sum(p.rlayout.segment for _, _, p in entries)  # R_b
    tensors, offsets, numels, base = [], [], [], 0
    for _, group, p in entries:
        rl = p.rlayout
        tensors += pack_sources(group, gradient_sources(group, p.grads), p.local, rl, device)
        offsets += [o + r * (segment - rl.segment) + base for o, r in zip(rl.pack_offsets, rl.pack_ranks)]
        numels += rl.pack_numels
        base += rl.segment
    name = bucket_name(list(dict.fromkeys(u for u, _, _ in entries)))
    rs = streams.reduce_scatter
    with torch.no_grad(), trace.span("pack", name, "compute" if streams.is_cuda else "reduce_scatter"):
        packed = torch.empty(W * segment, dtype=reduce_dtype, device=device)
        flatten(tensors, offsets, packed, scale=1.0 / f_pre, numels=numels)
    del tensors  # the gradients go before the output is allocated (as in reduce.reduce_group)
    for _, group, p in entries:
        p.grads = None
        for param in group.unsharded_params:
            param.grad = None
    pending = []
    with streams.use(rs), torch.no_grad():
        output = torch.empty(segment, dtype=reduce_dtype, device=device)
        with trace.issuing("reduce_scatter", name, rs) as issued:
            work = issued.track((first.rs_comm or first.comm).reduce_scatter_tensor(output, packed, op="sum"))
        base = 0
        for unit, group, p in entries:
            rl = p.rlayout
            pending.append(PendingReduce(unit, group, work, output[base : base + rl.segment], p.accumulate,
                                         1.0 / p.f_post, rl, [packed], issued if not pending else None,
                                         p.local, p.had))
            base += rl.segment
        read_event = streams.record(rs)
        if streams.is_cuda:  # HSDP: each group's all-reduce behind the reduce-scatter (reduce.py)
            for p in pending:
                p.start_all_reduce()
    streams.hold_until_passed(read_event, packed)
    return pending
