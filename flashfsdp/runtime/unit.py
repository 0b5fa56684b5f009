"""ShardedUnit: unshard, reshard and gradient reduction of one unit (no nn.Module knowledge).

One unit is the parameters of one ``fully_shard`` call, grouped into FlatParams by (dtype,
requires_grad). Its step on rank r (docs/architecture.md, The step protocol):

1. unshard [all-gather stream]: allocate each group's gathered and unsharded buffers, copy-in
   (cast the shard to ``param_dtype`` into this rank's slice of the gathered buffer; where there
   is nothing to cast the shard itself is the all-gather's input), all-gather. Returns an :class:`AllGatherResult` carrying the work handles; ``wait()`` makes the
   compute stream wait (GPU) or blocks (CPU), then copies out into the unsharded parameters.
2. reshard: free the unsharded storage, the all-gather stream ordered after the compute stream
   first (see ``streams`` for why nothing else is needed on free).
3. reduce_grads: pack [compute stream] + reduce-scatter + (later) accumulate [reduce-scatter
   stream], per group; see ``reduce.py``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Sequence

import torch

from flashfsdp._torch_private import unsafe_set_version_counter

from . import trace
from .communicator import Communicator, Work
from .extensions import PackedAllGather, ParamExtension, scan
from .flat_param import FlatParam
from .layout import align_elements
from .quantized_gather import QuantizedAllGather, check_all_gather_dtype, finish_quantized
from .quantized_reduce import QuantizedReducer
from .reduce import PendingReduce, accumulate_unsharded, gradient_divide_factors, reduce_group
from .sharding_spec import ShardingSpec
from .states import ShardState
from .tensor_parallel import tensor_parallel_specs, tp_local_param
from .streams import DeviceStreams, streams_for

__all__ = ["AllGatherResult", "PendingReduce", "ShardedUnit", "ShardState", "gradient_divide_factors"]


@dataclass
class AllGatherResult:
    """The all-gathers of one unshard, as a named result that carries its synchronisation: the work
    handles, and the event recorded on the all-gather stream after them (FSDP2's
    ``AllGatherResult``). ``wait()`` orders the compute stream after both: the event
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
    issued: "trace.Issued | None" = None  # when it was issued (for an active profile)
    quantized: "list[QuantizedAllGather] | None" = None  # int8 all-gathers to dequantise at wait()
    groups: "list[FlatParam] | None" = None  # the groups to copy out at wait()
    packed: "PackedAllGather | None" = None  # a unit with all-gather extensions: its byte-packed all-gather
    bucket: object = None  # several units' all-gather (bucket.py): ``finish(works, streams, event) -> event``

    def wait(self) -> None:
        """Make the current stream wait on the all-gathers (GPU) or block until done (CPU), then
        copy every group's gathered buffer out into its unsharded parameters (on CUDA on the
        all-gather stream, which the current stream then waits on)."""
        with trace.waiting(self.issued, self.works):
            if self.quantized:
                self.event = finish_quantized(self.quantized, self.works, self.streams)
                self.quantized, self.works = None, []
            if self.packed is not None:
                self.event = finish_packed(self.packed, self.works, self.streams, self.event)
                self.packed, self.works, self.groups = None, [], None
            if self.bucket is not None:
                self.event = self.bucket.finish(self.works, self.streams, self.event)
                self.bucket, self.works = None, []
            if self.groups and any(not g.layout.zero_copy for g in self.groups):
                self.event = finish_copy_out(self.groups, self.works, self.streams, self.event)
                self.works = []
            for work in self.works:
                work.wait()
        self.works, self.groups, self.issued = [], None, None
        if self.streams is not None:
            self.streams.wait(self.event)
            self.streams = None
        if self.buffers:
            unsafe_set_version_counter(tuple(self.buffers), tuple(self.versions))


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
        offload, pin_memory: keep the shards and their gradients in (pinned) CPU memory
            (``CPUOffloadPolicy``; see :class:`FlatParam`).
        replicate_comm: HSDP: the collectives across the replicas of this rank's shard (the
            ranks of the other shard groups with this rank's shard rank); each reduce-scattered
            gradient shard is all-reduced over them (``reduce.py``). None: no replicas.
        all_gather_dtype: None, or ``torch.int8``: the forward and backward all-gathers send the
            floating groups block-wise quantised to int8 and dequantise into ``param_dtype`` at
            the wait (ZeRO++ qwZ, Wang et al. 2023; ``quantized_gather.py``); the master shard
            and the gradients are unchanged. ValueError if the communicator or device cannot.
        reduce_quantization: None, or a ``quantized_reduce.QuantizedReducer``: the gradient
            reduce-scatter runs as ZeRO++ qgZ's quantised hierarchical all-to-all
            (``quantized_reduce.py``; built and checked by ``fully_shard``).
        spec: how the unit's chunks are shown (``ShardingSpec``: DTensors on its mesh with FSDP2's
            placements, or plain tensors without a mesh; default plain).
        shard_dims: each parameter's shard dim (FSDP2's ``shard_placement_fn``'s ``Shard(k)``,
            k >= 0; see [Note: Shard(k) parameters] in ``layout.py``); None: dim 0 for all.

    A parameter that is a DTensor (tensor parallelism) is sharded as its TP-local tensor and
    shown on the DP and TP meshes joined (``tensor_parallel.py``).

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
        offload: bool = False,
        pin_memory: bool = False,
        replicate_comm: Communicator | None = None,
        all_gather_dtype: torch.dtype | None = None,
        spec: ShardingSpec | None = None,
        shard_dims: Sequence[int] | None = None,
        reduce_quantization: QuantizedReducer | None = None,
    ):
        self.name = name
        self.spec = spec or ShardingSpec(None)
        self.comm = communicator
        self.replicate_comm = replicate_comm
        self.requires_all_reduce = True  # FSDPModule.set_requires_all_reduce (HSDP)
        # HSDP without all-reduce: per group (by id), the reduce-scattered shard summed so far and
        # which parameters got a gradient on this rank (see reduce.py)
        self.partial_reduce: dict[int, tuple[torch.Tensor, list[bool]]] = {}
        self.post_forward_comm = post_forward_comm
        self._secondary: list[torch.Tensor] = []
        self.device = device
        self.streams: DeviceStreams = streams_for(device)
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.all_gather_dtype = check_all_gather_dtype(all_gather_dtype, communicator, device, name)
        self.reduce_quantization = reduce_quantization  # ZeRO++ qgZ (reduce.py, quantized_reduce.py)
        # ids of the original parameters this unit took over (to detect sharing with other units)
        self.original_param_ids = {id(p) for p in params}
        self._make_groups(params, fqns, offload, pin_memory, shard_dims)
        self.state = ShardState.SHARDED
        self._all_gather: AllGatherResult | None = None
        self.all_reduce_hook = None  # FSDPModule.set_all_reduce_hook: called on FSDP2's reduce output (reduce.py)
        self.all_reduce_hook_stream = None
        self.force_sum_reduction = False  # set_force_sum_reduction_for_comms: what the hook sees (reduce.py)
        self.rs_comm: Communicator | None = None  # set_separate_reduce_scatter_group, set_custom_reduce_scatter
        self.ag_comm: Communicator | None = None  # set_custom_all_gather (custom_collectives.py)
        self.reduce_unused_params = False  # set_reduce_scatter_unused_params: zeros instead of None
        # FSDPModule.set_gradient_divide_factor: the gradients are the sum over ranks divided by it
        self.gradient_divide_factor: float | None = None
        # FSDP2's all-gather extensions (``extensions.py``): the module holding each parameter and the
        # mixed-precision policy, passed to ``fsdp_pre_all_gather`` (set by the bindings); the
        # parameters using them, found at the first unshard (after a monkey patch) and after adopt
        self.extension_modules: list = []
        self.mp_policy = None
        self._extensions: list[ParamExtension] | None = None
        self._tag_pieces()

    def _make_groups(self, params: Sequence[torch.Tensor], fqns: Sequence[str], offload: bool, pin_memory: bool,
                     shard_dims: Sequence[int] | None) -> None:
        """One FlatParam per (dtype, requires_grad) of ``params``: ``groups``, and ``param_slots``
        (index of each parameter -> (group, position in group))."""
        tp_specs = tensor_parallel_specs(self.spec, params, fqns)
        params = [tp_local_param(p) for p in params]  # a tensor-parallel DTensor: its TP-local tensor
        keys: dict[tuple[torch.dtype, bool], list[int]] = {}
        for i, p in enumerate(params):
            keys.setdefault((p.dtype, p.requires_grad), []).append(i)
        self.groups: list[FlatParam] = []
        self.param_slots: list[tuple[FlatParam, int]] = [None] * len(params)  # type: ignore[list-item]
        for (dtype, _), idx in keys.items():
            pdt = self.param_dtype if (self.param_dtype is not None and dtype.is_floating_point) else dtype
            align = align_elements([dtype.itemsize, pdt.itemsize, (self.reduce_dtype or pdt).itemsize])
            group = FlatParam(
                [params[i] for i in idx], [fqns[i] for i in idx], rank=self.comm.rank,
                world_size=self.comm.world_size, param_dtype=pdt, device=self.device, align=align,
                spec=self.spec, offload=offload, pin_memory=pin_memory,
                shard_dims=None if shard_dims is None else [shard_dims[i] for i in idx],
                specs=[tp_specs[i] for i in idx],
            )
            self.groups.append(group)
            for pos, i in enumerate(idx):
                self.param_slots[i] = (group, pos)

    @property
    def data_parallel_size(self) -> int:
        """The ranks whose gradients are averaged: W of the shard group, times the replicas (HSDP)."""
        return self.comm.world_size * (self.replicate_comm.world_size if self.replicate_comm is not None else 1)

    def _tag_pieces(self) -> None:
        for group in self.groups:
            group.unit = self

    def adopt(self, registered: Sequence[torch.Tensor], device: torch.device | None = None) -> bool:
        """Take back the parameters after ``nn.Module._apply`` changed them (``model.to(dtype)``,
        ``to_empty``): see :meth:`FlatParam.rehome`. ``registered[i]``: what the module now holds
        for parameter ``i``; ``device``: the compute device from now on (None: the parameters').
        Returns True if anything changed (the caller then re-checks the communicator).

        Raises:
            RuntimeError: the unit is unsharded (call it outside forward/backward).
            ValueError: a dtype the flat layout is not aligned for (a narrower one than at
                ``fully_shard``), or parameters of one group now on different devices or dtypes.
        """
        changed = False
        for group in self.groups:
            pieces = [registered[i] for i, (g, _) in enumerate(self.param_slots) if g is group]
            if len({p.device.type == "meta" for p in pieces}) > 1:
                continue  # a meta-device group loaded one parameter at a time: wait for the rest
            if len({(p.dtype, p.device) for p in pieces}) > 1:
                raise ValueError(
                    f"unit '{self.name}': after a module conversion its parameters have several dtypes or devices "
                    f"({sorted({(str(p.dtype), str(p.device)) for p in pieces})}); convert the whole module at once"
                )
            if pieces and pieces[0].dtype != group.dtype:
                self._check_alignment(group, pieces[0].dtype)
            if group.rehome_needed(pieces):
                if self.state is not ShardState.SHARDED:
                    raise RuntimeError(
                        f"unit '{self.name}' was converted (module.to / _apply) while its parameters are unsharded: "
                        f"convert it outside forward/backward, after module.reshard()"
                    )
                changed |= group.rehome(pieces, self.param_dtype, device)
        if changed:
            self._extensions = None
            self._tag_pieces()
            self.device = self.groups[0].device if self.groups else self.device
            self.streams = streams_for(self.device)
        return changed

    def _check_alignment(self, group: FlatParam, dtype: torch.dtype) -> None:
        pdt = self.param_dtype or dtype
        need = align_elements([dtype.itemsize, pdt.itemsize, (self.reduce_dtype or pdt).itemsize])
        if group.layout.align % need:
            raise ValueError(
                f"unit '{self.name}': its parameters were converted to {dtype}, but the flat layout was built "
                f"for {group.dtype} (offsets aligned to {group.layout.align} elements, {dtype} needs {need}); "
                f"convert the module before fully_shard, or keep {group.dtype} master weights and compute in "
                f"{dtype} with fully_shard(..., mp_policy=MixedPrecisionPolicy(param_dtype={dtype}))"
            )

    # ------------------------------------------------------------------ params
    def unsharded_param(self, i: int) -> torch.nn.Parameter:
        """The full-shape view of parameter ``i`` into its group's unsharded buffer."""
        group, pos = self.param_slots[i]
        return group.unsharded_params[pos]

    def sharded_param(self, i: int) -> torch.nn.Parameter:
        """Parameter ``i``'s sharded form (a DTensor over its chunk of the master shard)."""
        group, pos = self.param_slots[i]
        return group.sharded_params[pos]

    # ------------------------------------------------------------------ unshard / reshard
    def _post_forward_slot(self) -> tuple[int, int]:
        """(k, this rank's index) in the post-forward group of k consecutive ranks."""
        return self.post_forward_comm.world_size, self.post_forward_comm.rank

    def unshard(self) -> AllGatherResult | None:
        """Issue copy-in + all-gather of every group (asynchronous); None if already unsharded.

        From the post-forward (secondary) sharding, the copy-in takes this rank's 1/k slice of the
        gathered layout and the all-gather runs over the k ranks of the post-forward group.
        """
        if self.state not in (ShardState.SHARDED, ShardState.SECONDARY):
            return self._all_gather
        secondary = self._secondary if self.state is ShardState.SECONDARY else []
        comm = self.post_forward_comm if secondary else (self.ag_comm or self.comm)
        if not secondary and self.extensions:
            return self._unshard_packed()
        works = []
        buffers = [g.unsharded_flat for g in self.groups]
        versions = [b._version for b in buffers]
        ag = self.streams.all_gather
        with self.streams.use(ag), torch.no_grad():
            pairs, quantized = [], []  # (all-gather output, input) per group; the int8 all-gathers
            with trace.span("copy_in", self.name, "all_gather", ag):
                for i, group in enumerate(self.groups):
                    group.alloc_unsharded()
                    if secondary:
                        pairs.append((group.gathered, group.gathered_slice(*reversed(self._post_forward_slot()))))
                        pairs[-1][1].copy_(secondary[i])
                    elif self.all_gather_dtype is not None and group.param_dtype.is_floating_point:
                        quantized.append(QuantizedAllGather(group, comm))
                        pairs.append((quantized[-1].packed, quantized[-1].local))
                    elif group.param_dtype == group.dtype and not group.offload:
                        # nothing to cast: the shard itself is the all-gather's input (the
                        # collective copies it into its slot), as FSDP2's sharded parameters are
                        group.note_copy_in()
                        pairs.append((group.gathered, group.sharded_flat))
                    else:
                        group.copy_in()
                        pairs.append((group.gathered, group.gathered_slice()))
            with trace.issuing("all_gather", self.name, ag) as issued:
                for out, source in pairs:
                    works.append(issued.track(comm.all_gather_into_tensor(out, source)))
            event = self.streams.record(ag)
        self._all_gather = AllGatherResult(works, buffers, versions, event, self.streams, issued, quantized,
                                           list(self.groups))
        self.state = ShardState.UNSHARDING
        return self._all_gather

    @property
    def extensions(self) -> list[ParamExtension]:
        """The parameters whose local tensors define ``fsdp_pre_all_gather`` (found once, again after
        :meth:`adopt`).

        Raises:
            ValueError: see ``extensions.scan`` (one hook only, CPU offload, a dim other than 0), or
                int8 all-gathers (``all_gather_dtype``), which extensions replace.
        """
        if self._extensions is None:
            slots = {(id(g), pos): i for i, (g, pos) in enumerate(self.param_slots)}
            found = scan(self.groups, self.extension_modules, lambda g, pos: slots[(id(g), pos)])
            if found and self.all_gather_dtype is not None:
                raise ValueError(f"parameter '{found[0].fqn}' defines fsdp_pre_all_gather / fsdp_post_all_gather, "
                                 f"which choose what is all-gathered: unit '{self.name}' cannot also all-gather in "
                                 f"{self.all_gather_dtype} (MixedPrecisionPolicy.all_gather_dtype)")
            self._extensions = found
        return self._extensions

    def _unshard_packed(self) -> AllGatherResult:
        """Unshard of a unit with all-gather extensions: one all-gather of the byte-packed plain
        shards and extension inputs (``extensions.PackedAllGather``)."""
        buffers = [g.unsharded_flat for g in self.groups]
        versions = [b._version for b in buffers]
        ag = self.streams.all_gather
        mesh = self.spec.mesh
        if mesh is not None and mesh.ndim > 1 and mesh.mesh_dim_names:
            mesh = mesh[mesh.mesh_dim_names[-1]]
        with self.streams.use(ag), torch.no_grad():
            with trace.span("copy_in", self.name, "all_gather", ag):
                for group in self.groups:
                    group.alloc_unsharded()
                    group.copy_in()
                packed = PackedAllGather(self.groups, self.extensions, self.comm, mesh, self.mp_policy)
            with trace.issuing("all_gather", self.name, ag) as issued:
                works = [issued.track(packed.issue(self.ag_comm or self.comm))]
            event = self.streams.record(ag)
        self._all_gather = AllGatherResult(works, buffers, versions, event, self.streams, issued, packed=packed)
        self.state = ShardState.UNSHARDING
        return self._all_gather

    def join_all_gather(self, result: AllGatherResult) -> None:
        """Unshard through ``result``, an all-gather of several units that this unit's parameters
        are part of (``bucket.py``); the unit must be sharded."""
        self._all_gather = result
        self.state = ShardState.UNSHARDING

    def wait_unshard(self) -> None:
        """Make the current stream wait for the unshard in flight (issuing it if none is)."""
        if self.state in (ShardState.SHARDED, ShardState.SECONDARY):
            self.unshard()
        if self.state is ShardState.UNSHARDING:
            self._all_gather.wait()
            self._all_gather = None
            self.state = ShardState.UNSHARDED

    def gathered_is_stale(self) -> bool:
        """Whether an unsharded (or post-forward-sharded) unit's gathered parameters may be older
        than its shards (see [Note: stale unsharded parameters] in ``flat_param.py``)."""
        return self.state is not ShardState.SHARDED and any(g.gathered_is_stale() for g in self.groups)

    def reshard(self, to_secondary: bool = False) -> None:
        """Free the unsharded storage (waiting first for an all-gather still in flight).

        With ``to_secondary`` (and a post-forward group), keep this rank's 1/k slice first.
        """
        if self.state is ShardState.UNSHARDING:
            self.wait_unshard()
        # A unit with extensions reshards fully: its inputs come from fsdp_pre_all_gather on the shard
        keep = (to_secondary and self.post_forward_comm is not None and self.state is ShardState.UNSHARDED
                and not self.extensions)
        if keep:
            k, index = self._post_forward_slot()
            with torch.no_grad():
                self._secondary = [g.secondary_copy(k, index) for g in self.groups]
        elif not (to_secondary and self.state is ShardState.SECONDARY):
            self._secondary = []
        # The all-gather stream owns the buffers: order it after their readers before the free
        # (see [Note: memory safety without record_stream] in streams.py).
        self.streams.order_after_current(self.streams.all_gather)
        for group in self.groups:
            group.free_unsharded()
        for ext in self._extensions or ():
            ext.free()
        self.state = ShardState.SECONDARY if self._secondary else ShardState.SHARDED

    # ------------------------------------------------------------------ gradients
    def reduce_grads(self) -> list[PendingReduce]:
        """Pack, reduce-scatter (asynchronously) the unsharded gradients of every trainable group
        (``reduce.py``). The unsharded parameters' ``.grad`` are released (set to None), and so is
        the no-sync accumulation buffer. Returns one PendingReduce per group that had a gradient;
        call ``finish()`` on each before reading ``sharded_grad``."""
        return [p for p in (reduce_group(self, g) for g in self.groups) if p is not None]

    def accumulate_unsharded_grads(self) -> None:
        """A micro-batch without gradient sync ended: keep accumulating in ``reduce_dtype``
        (``reduce.accumulate_unsharded``)."""
        accumulate_unsharded(self)

    def has_unsharded_grads(self) -> bool:
        """Whether any unsharded parameter holds a gradient (accumulated without sync)."""
        return any(p.grad is not None for g in self.groups for p in g.unsharded_params) or any(
            g.unsharded_accum is not None for g in self.groups)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this rank holds now: master shard + gradient shard, unsharded buffers, and the
        gathered buffers alive besides them while an all-gather lands, until copy-out
        (``unsharded_max`` / ``gathered_max``: the same when allocated)."""
        return {
            "sharded": sum(g.sharded_nbytes() for g in self.groups),
            "secondary": sum(t.numel() * t.element_size() for t in self._secondary),
            "unsharded": sum(g.unsharded_flat.untyped_storage().nbytes() for g in self.groups),
            "gathered": sum(g.gathered.untyped_storage().nbytes() for g in self.groups if g.gathered_nbytes),
            "unsharded_max": sum(g.unsharded_nbytes for g in self.groups),
            "gathered_max": sum(g.gathered_nbytes for g in self.groups),
        }


def finish_packed(packed: PackedAllGather, works: Sequence[Work], streams: DeviceStreams | None,
                  event: "torch.cuda.Event | None") -> "torch.cuda.Event | None":
    """:func:`finish_copy_out` of a byte-packed all-gather (``PackedAllGather.finish``): on CUDA on
    the all-gather stream after ``event``, returning the event recorded there after it."""
    stream = streams.all_gather if streams is not None else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        if stream is not None and event is not None:
            stream.wait_event(event)
        packed.finish(works)
        return streams.record(stream) if stream is not None else None


def finish_copy_out(groups: Sequence[FlatParam], works: Sequence[Work], streams: DeviceStreams | None,
                    event: "torch.cuda.Event | None") -> "torch.cuda.Event | None":
    """Wait for the all-gathers and copy each group's gathered buffer out into its unsharded
    parameters; on CUDA both on the all-gather stream (after ``event``, what was enqueued there
    before), returning the event recorded after them there (the compute stream waits on it),
    else None. The gathered buffers were allocated on the all-gather stream and are freed after
    a copy-out enqueued on it, so their reuse is stream-ordered (see [Note: memory safety without
    record_stream] in ``streams.py``)."""
    stream = streams.all_gather if streams is not None else None
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext(), torch.no_grad():
        if stream is not None and event is not None:
            stream.wait_event(event)
        for work in works:
            work.wait()
        for group in groups:
            group.copy_out()
        return streams.record(stream) if stream is not None else None
