"""ShardedUnit: unshard, reshard and gradient reduction of one unit (no nn.Module knowledge).

One unit is the parameters of one ``fully_shard`` call, grouped into FlatParams by (dtype,
requires_grad). Its step on rank r (DESIGN.md §2):

1. unshard [all-gather stream]: allocate each group's unsharded buffer, copy-in (cast the shard to
   ``param_dtype`` into its own slice), all-gather in place. Returns an :class:`AllGatherResult`
   carrying the work handles; ``wait()`` makes the compute stream wait (GPU) or blocks (CPU).
2. reshard: free the unsharded storage (see ``streams`` for why no event is needed on free).
3. reduce_grads [reduce-scatter stream]: one ``flatten`` launch packs every unsharded gradient into
   a T-element buffer in ``reduce_dtype`` (cast, pre-divide, zero padding, zeros where no gradient);
   reduce-scatter into S elements. The returned :class:`PendingReduce` finishes later: one
   ``accumulate_grad_shard`` launch post-divides, casts and adds into ``sharded_grad`` and returns
   the shard's squared norm and inf/nan flag from the same pass.

[Note: pre-divide and post-divide]
Summing W gradients in a low-precision ``reduce_dtype`` can overflow (fp16) or lose digits; so the
gradients are scaled by 1/f_pre before the reduction and by 1/f_post after it, f_pre·f_post = W,
with f_pre the power of two near sqrt(W) (FSDP1, ``_get_gradient_predivide_factor``). In fp32 the
whole division happens after the sum (f_pre = 1), as a single-process mean would.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from flashfsdp.kernels import accumulate_grad_shard, flatten

from .communicator import Communicator, Work
from .flat_param import FlatParam
from . import trace
from .layout import align_elements
from .states import ShardState
from .streams import DeviceStreams, streams_for


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


@dataclass
class AllGatherResult:
    """The all-gathers of one unshard, as a named result that carries its synchronisation: the work
    handles, and the event recorded on the all-gather stream after them (FSDP2's
    ``AllGatherResult``, DESIGN.md §9). ``wait()`` orders the compute stream after both: the event
    covers the copy-in where the collective completes at once (W = 1, ``LocalCommunicator``).

    [Note: version counters]
    The unsharded parameters share their version counter with the unsharded buffer. Torch ops
    that write the buffer (the copy-in, gloo's all-gather, which copies on its worker thread
    until ``wait()``) bump it, which would invalidate the tensors autograd saved in forward; the
    counters are restored once the all-gather is waited on (FSDP2 does the same for its copy-out
    with ``torch.autograd._unsafe_preserve_version_counter``). NCCL and Triton writes bypass it.
    """

    works: list[Work]
    buffers: list[torch.Tensor]
    versions: list[int]
    event: "torch.cuda.Event | None" = None
    streams: "DeviceStreams | None" = None
    unit_name: str = ""
    issued: object = None  # trace timestamps of the collective (when a profile is active)
    issued_end: object = None

    def wait(self) -> None:
        """Make the current stream wait on the all-gathers (GPU) or block until done (CPU)."""
        prof = trace.active()
        with trace.label("wait_all_gather", self.unit_name):
            if prof is not None and self.works:
                waited = prof.now()
                completed_before = all(w.is_completed() for w in self.works)
            for work in self.works:
                work.wait()
            if prof is not None and self.works and self.issued is not None:
                prof.add_collective("all_gather", self.unit_name, self.works, self.issued, self.issued_end,
                                    waited, prof.now(), completed_before)
        self.works = []
        if self.streams is not None:
            self.streams.wait(self.event)
            self.streams = None
        if self.buffers:
            torch._C._autograd._unsafe_set_version_counter(tuple(self.buffers), tuple(self.versions))


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
    issued: object = None  # trace timestamps of the collective (when a profile is active)
    issued_end: object = None

    def finish(self) -> None:
        """Wait for the reduce-scatter and accumulate into ``sharded_grad`` (fused norm and flag)."""
        streams = self.unit.streams
        name = self.unit.name
        prof = trace.active()
        with streams.use(streams.reduce_scatter):
            with trace.label("wait_reduce_scatter", name):
                if prof is not None:
                    waited = prof.now(streams.reduce_scatter)
                    completed_before = self.work.is_completed()
                self.work.wait()
                if prof is not None and self.issued is not None:
                    # On CPU the compute thread itself blocked here; on CUDA the reduce-scatter
                    # stream did (the compute stream's wait is recorded in wait_for_reduce_scatter).
                    prof.add_collective("reduce_scatter", name, [self.work], self.issued, self.issued_end, waited,
                                        prof.now(streams.reduce_scatter), completed_before,
                                        wait_span=not streams.is_cuda)
            grad = self.group.sharded_grad_buffer()
            with trace.span("accumulate", name, "reduce_scatter", streams.reduce_scatter):
                sq_norm, nonfinite = accumulate_grad_shard(
                    self.output, grad, scale=self.post_scale, accumulate=self.accumulate
                )
        self.group.grad_stats = (sq_norm, nonfinite, grad._version)
        self.group.expose_grads()
        self.keepalive.clear()


class ShardedUnit:
    """The sharded parameters of one unit on one rank, and its collectives.

    Args:
        name: the unit's name in errors and traces (e.g. the module's qualified name).
        params: the unit's original full parameters (deduplicated), identical on every rank.
        fqns: a fully-qualified name per parameter.
        communicator: the collectives over the unit's ranks.
        device: the device of the shard and the buffers.
        param_dtype: dtype of the unsharded parameters (None: each parameter's own dtype).
        reduce_dtype: dtype of the gradient reduction (None: ``param_dtype``).
        post_forward_comm: if given, ``reshard(to_secondary=True)`` after forward keeps this rank's
            1/k of the unsharded buffer (k = its world size, a divisor of W; its ranks are k
            consecutive ranks of ``communicator`` in order), and the backward's unshard
            all-gathers over these k ranks only: the secondary sharding of ZeRO++ hpZ (Wang et
            al. 2023) and FSDP2's ``reshard_after_forward=<int>``.

    A unit with no parameters is allowed: its unshard and reduction do nothing.
    """

    def __init__(
        self,
        name: str,
        params: Sequence[torch.Tensor],
        fqns: Sequence[str],
        communicator: Communicator,
        device: torch.device,
        param_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        post_forward_comm: Communicator | None = None,
    ):
        self.name = name
        self.comm = communicator
        self.post_forward_comm = post_forward_comm
        self._secondary: list[torch.Tensor] = []
        self.device = device
        self.streams: DeviceStreams = streams_for(device)
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        # ids of the original parameters this unit took over (to detect sharing with other units)
        self.original_param_ids = {id(p) for p in params}
        keys: dict[tuple[torch.dtype, bool], list[int]] = {}
        for i, p in enumerate(params):
            keys.setdefault((p.dtype, p.requires_grad), []).append(i)
        self.groups: list[FlatParam] = []
        # index of each parameter -> (group, position in group)
        self.param_slots: list[tuple[FlatParam, int]] = [None] * len(params)  # type: ignore[list-item]
        for (dtype, _), idx in keys.items():
            pdt = param_dtype if (param_dtype is not None and dtype.is_floating_point) else dtype
            align = align_elements([dtype.itemsize, pdt.itemsize, (reduce_dtype or pdt).itemsize])
            group = FlatParam(
                [params[i] for i in idx], [fqns[i] for i in idx], rank=communicator.rank,
                world_size=communicator.world_size, param_dtype=pdt, device=device, align=align,
            )
            self.groups.append(group)
            for pos, i in enumerate(idx):
                self.param_slots[i] = (group, pos)
        self.state = ShardState.SHARDED
        self._all_gather: AllGatherResult | None = None
        for group in self.groups:
            for param in group.sharded_params:
                param._flashfsdp_unit = self
                param._flashfsdp_group = group

    # ------------------------------------------------------------------ params
    def unsharded_param(self, i: int) -> torch.nn.Parameter:
        """The full-shape view of parameter ``i`` into its group's unsharded buffer."""
        group, pos = self.param_slots[i]
        return group.unsharded_params[pos]

    def sharded_param(self, i: int) -> torch.nn.Parameter:
        """Parameter ``i``'s local piece (a 1-D view into the master shard)."""
        group, pos = self.param_slots[i]
        return group.sharded_params[pos]

    # ------------------------------------------------------------------ unshard / reshard
    def _secondary_slice(self, group: FlatParam) -> torch.Tensor:
        """This rank's 1/k of ``group``'s unsharded buffer for the post-forward group of k ranks."""
        k, g = self.post_forward_comm.world_size, self.post_forward_comm.rank
        n = group.layout.total // k
        return group.unsharded_flat[g * n : (g + 1) * n]

    def unshard(self) -> AllGatherResult | None:
        """Issue copy-in + all-gather of every group (asynchronous); None if already unsharded.

        From the post-forward (secondary) sharding, the copy-in takes this rank's 1/k slice and the
        all-gather runs over the k ranks of the post-forward group.
        """
        if self.state not in (ShardState.SHARDED, ShardState.SECONDARY):
            return self._all_gather
        secondary = self._secondary if self.state is ShardState.SECONDARY else []
        comm = self.post_forward_comm if secondary else self.comm
        works = []
        buffers = [g.unsharded_flat for g in self.groups]
        versions = [b._version for b in buffers]
        prof, ag = trace.active(), self.streams.all_gather
        with self.streams.use(ag), torch.no_grad():
            sources = []
            with trace.span("copy_in", self.name, "all_gather", ag):
                for i, group in enumerate(self.groups):
                    group.alloc_unsharded()
                    if secondary:
                        sources.append(self._secondary_slice(group))
                        sources[-1].copy_(secondary[i])
                    else:
                        group.copy_in()
                        sources.append(group.shard_slice_of_unsharded())
            with trace.label("all_gather", self.name):
                issued = prof.now(ag) if prof is not None else None
                for group, source in zip(self.groups, sources):
                    works.append(comm.all_gather_into_tensor(group.unsharded_flat, source))
                    if prof is not None and not self.streams.is_cuda:
                        works[-1].track_completion()
                issued_end = prof.now(ag) if prof is not None and self.streams.is_cuda else None
            event = self.streams.record(ag)
        self._all_gather = AllGatherResult(works, buffers, versions, event, self.streams, self.name, issued, issued_end)
        self.state = ShardState.UNSHARDING
        return self._all_gather

    def wait_unshard(self) -> None:
        """Make the current stream wait for the unshard in flight (issuing it if none is)."""
        if self.state in (ShardState.SHARDED, ShardState.SECONDARY):
            self.unshard()
        if self.state is ShardState.UNSHARDING:
            self._all_gather.wait()
            self._all_gather = None
            self.state = ShardState.UNSHARDED

    def reshard(self, to_secondary: bool = False) -> None:
        """Free the unsharded storage (waiting first for an all-gather still in flight).

        With ``to_secondary`` (and a post-forward group), keep this rank's 1/k slice first.
        """
        if self.state is ShardState.UNSHARDING:
            self.wait_unshard()
        keep = to_secondary and self.post_forward_comm is not None and self.state is ShardState.UNSHARDED
        if keep:
            with torch.no_grad():
                self._secondary = [self._secondary_slice(g).clone() for g in self.groups]
        elif not (to_secondary and self.state is ShardState.SECONDARY):
            self._secondary = []
        for group in self.groups:
            group.free_unsharded()
        self.state = ShardState.SECONDARY if self._secondary else ShardState.SHARDED

    # ------------------------------------------------------------------ gradients
    def reduce_grads(self) -> list[PendingReduce]:
        """Pack, reduce-scatter (asynchronously) the unsharded gradients of every trainable group.

        The unsharded parameters' ``.grad`` are released (set to None). Returns one PendingReduce per
        group that had a gradient; call ``finish()`` on each before reading ``sharded_grad``.
        """
        pending = []
        for group in self.groups:
            if not group.requires_grad:
                continue
            grads = [p.grad for p in group.unsharded_params]
            if all(g is None for g in grads):
                continue
            reduce_dtype = self.reduce_dtype or group.param_dtype
            f_pre, f_post = gradient_divide_factors(self.comm.world_size, reduce_dtype)
            accumulate = group.prepare_grad_accumulation()
            S, T = group.layout.shard_size, group.layout.total
            prof, rs = trace.active(), self.streams.reduce_scatter
            with self.streams.use(rs), torch.no_grad():
                with trace.span("pack", self.name, "reduce_scatter", rs):
                    packed = torch.empty(T, dtype=reduce_dtype, device=self.device)
                    flatten(grads, list(group.layout.offsets), packed, scale=1.0 / f_pre, numels=list(group.layout.numels))
                packed_event = self.streams.record(rs)
                output = torch.empty(S, dtype=reduce_dtype, device=self.device)
                with trace.label("reduce_scatter", self.name):
                    issued = prof.now(rs) if prof is not None else None
                    work = self.comm.reduce_scatter_tensor(output, packed, op="sum")
                    if prof is not None and not self.streams.is_cuda:
                        work.track_completion()
                    issued_end = prof.now(rs) if prof is not None and self.streams.is_cuda else None
            # Outside the reduce-scatter stream: the *compute* stream must pass the pack before
            # the gradients it read may be freed (see streams.hold_until_passed).
            self.streams.hold_until_passed(packed_event, grads)
            for p in group.unsharded_params:
                p.grad = None
            pending.append(PendingReduce(self, group, work, output, accumulate, 1.0 / f_post, [packed], issued, issued_end))
        return pending

    def has_unsharded_grads(self) -> bool:
        """Whether any unsharded parameter holds a gradient (accumulated without sync)."""
        return any(p.grad is not None for g in self.groups for p in g.unsharded_params)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: master shard + gradient shard, and unsharded buffers."""
        return {
            "sharded": sum(g.sharded_nbytes() for g in self.groups),
            "secondary": sum(t.numel() * t.element_size() for t in self._secondary),
            "unsharded": sum(g.unsharded_flat.untyped_storage().nbytes() for g in self.groups),
            "unsharded_max": sum(g.unsharded_nbytes for g in self.groups),
        }
