"""FlatParam: one flat group of a unit — the shard, its DTensor parameters, the unsharded buffers.

A unit's parameters are grouped by (original dtype, requires_grad at ``fully_shard`` time); each
group is one FlatParam (almost always a unit has exactly one). ``requires_grad_`` may change a
parameter's flag later: the sharded parameter carries it, :meth:`FlatParam.sync_requires_grad`
gives it to the unsharded parameter before each forward, and a group reduces if any of its
parameters is trainable (a frozen one is left out of the reduce-scatter and gets no ``.grad``).
Per rank it holds (``layout.py`` for the offsets):

- ``sharded_flat``: S elements in the original dtype: this rank's chunk of every parameter
  (along dim 0, or along its ``Shard(k)`` dim: [Note: Shard(k) parameters] in ``layout.py``),
  padded as FSDP2 pads it, back to back — the master weights, and FSDP2's all-gather input.
- ``sharded_params``: what ``module.parameters()`` yields outside forward/backward: per parameter
  an ``nn.Parameter`` holding a DTensor with FSDP2's placements and global shape whose local tensor
  is a view into ``sharded_flat`` (``sharding_spec.py``), so stock optimizers, ``clip_grad_norm_``,
  DCP and DSD see what FSDP2 gives them, and an optimizer step writes the shard in place.
  Each is recorded with this group and its index there (``param_tags.py``).
- ``sharded_grad`` (``grad_shard.py``): S elements laid out as ``sharded_flat``; the DTensor
  gradients' local tensors are views into it.
- ``gathered``: W·S elements in ``param_dtype``, rank-major: the all-gather output.
- ``unsharded_flat``: the unsharded parameters end to end; the module's parameters during
  forward/backward are views ``unsharded_params`` into it, created once. Copy-out (one
  ``unflatten`` launch) moves every chunk from ``gathered`` into place (the chunks of ``Shard(k)``
  parameters, k != 0, with torch ops: ``dim_chunks.py``); where the layout is
  zero-copy (one rank, or one parameter filling the shard) ``gathered`` *is* ``unsharded_flat``
  and nothing is copied. Both buffers' storage is alive only while needed: ``gathered`` until
  copy-out, ``unsharded_flat`` until reshard, which frees only the storage; unshard
  re-materialises it in place, so tensors autograd saved in forward are valid again in backward.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from flashfsdp._torch_private import set_dtensor_local
from flashfsdp.kernels import UnflattenPlan, flatten, quantize_int8

from .dim_chunks import chunks_to_full, full_to_chunks
from .extensions import as_plain, check_kept_subclasses, subclass_local
from .grad_shard import GradShard
from .layout import ShardLayout
from .param_tags import set_tag
from .sharding_spec import ShardingSpec, is_dtensor, local_of


# [Note: stale unsharded parameters]
# A unit may stay unsharded across a step (reshard_after_forward=False with a forward that had no
# backward, reshard_after_backward=False, a prefetch that was not used). Its unsharded parameters
# are then stale once the shard is written: an optimizer step, a loaded state dict, an
# initialisation. Each copy-in records the shard's version counter and the process-wide shard
# epoch, which those writers advance (fused optimizers do not bump version counters); the root's
# next forward gathers again whatever either has moved since.
_shard_epoch = 0


def shards_written() -> None:
    """Note that shards may have been written outside the runtime (optimizer step, load)."""
    global _shard_epoch
    _shard_epoch += 1


class FlatParam(GradShard):
    """The flat storage of one group of parameters of one unit on one rank.

    Args:
        params: the original full parameters (any shapes with at least one dimension, one
            floating dtype, one requires_grad), identical on every rank; read once to cut this
            rank's chunks.
        fqns: a name per parameter (for errors and state dicts); see :meth:`prefix_fqns`.
        rank, world_size: this rank and W (of the group the unit is sharded over).
        param_dtype: dtype of the unsharded buffers (forward/backward compute).
        device: the compute device: the unsharded buffers and the collectives' buffers live there,
            and so does the shard unless ``offload``.
        align: element alignment of the layout (see ``layout.align_elements``).
        spec: how the chunks are shown (``ShardingSpec``: DTensors on a mesh, or plain tensors).
        offload: keep the shard and its gradient in CPU memory (``CPUOffloadPolicy``): copy-in
            is a host-to-device copy into the gathered buffer, and a reduced gradient shard is
            copied to the host before it is accumulated there; the optimizer steps on the CPU.
        pin_memory: pin the CPU shard and gradient (asynchronous copies; only with CUDA).
        shard_dims: each parameter's shard dim (FSDP2's ``Shard(k)``, k >= 0); None: all 0.
        specs: per parameter, None (``spec``) or a tensor-parallel parameter's ``TensorParallelSpec``
            (``params`` then holds its TP-local tensor; ``tensor_parallel.py``); None: ``spec`` for all.

    Raises:
        ValueError: if the parameters mix dtypes or requires_grad (group them first), one is
            0-dim, or a shard dim is out of range; a tensor subclass with FSDP2's all-gather
            extensions that defines one hook only, or with ``offload`` or a shard dim other than 0
            (``extensions.check_kept_subclasses``).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        fqns: Sequence[str],
        *,
        rank: int,
        world_size: int,
        param_dtype: torch.dtype,
        device: torch.device,
        align: int,
        spec: ShardingSpec | None = None,
        offload: bool = False,
        pin_memory: bool = False,
        shard_dims: Sequence[int] | None = None,
        specs: Sequence[ShardingSpec | None] | None = None,
    ):
        if len({p.dtype for p in params}) != 1 or len({p.requires_grad for p in params}) != 1:
            raise ValueError("FlatParam: parameters of one group must share dtype and requires_grad")
        self.fqns = list(fqns)
        self.shapes = [tuple(p.shape) for p in params]
        self.dtype = params[0].dtype
        requires_grad = params[0].requires_grad
        self.param_dtype = param_dtype
        self.device = device
        self.offload = offload
        self.pin_memory = pin_memory and offload and torch.cuda.is_available()
        self.rank = rank
        self.world_size = world_size
        self.spec = spec or ShardingSpec(None)
        self.specs = [s or self.spec for s in (specs or [None] * len(params))]  # per parameter
        self.unit = None  # the ShardedUnit that owns the group (set by it)
        self.layout = ShardLayout.build(self.shapes, world_size, align, shard_dims)
        # this rank's chunk of each parameter: (offset in the shard, elements, shape), read per step
        self._chunks = [(self.layout.offsets[i], self.layout.local_numel(rank, i), self.layout.local_shape(rank, i))
                        for i in range(len(self.shapes))]
        # This rank's chunks of the master weights (nothing to copy from parameters on the meta
        # device: they get values after to_empty, see rehome).
        # A parameter whose class defines FSDP2's all-gather extensions keeps its subclass as its
        # local tensor (``extensions.py``); its slot in the flat shard is left zero.
        self.subclass_positions = check_kept_subclasses(params, self.fqns, offload, self.layout.dims)
        self.subclass_locals: dict[int, torch.Tensor] = {}
        self.sharded_flat = self._new_shard(self.dtype)
        if self.shard_device.type != "meta":
            self._fill_shard(self.sharded_flat, [None if i in self.subclass_positions else self.chunk_of(p.detach(), i)
                                                 for i, p in enumerate(params)])
        self.sharded_params = [self._make_sharded_param(i, requires_grad, p) for i, p in enumerate(params)]
        GradShard.__init__(self)
        self._make_unsharded()

    # ---------------------------------------------------------------- the shard
    @property
    def shard_device(self) -> torch.device:
        """Where the shard and its gradient live: the CPU with ``offload``, else the compute device
        (the meta device until materialised)."""
        if self.offload and self.device.type != "meta":
            return torch.device("cpu")
        return self.device

    def _new_shard(self, dtype: torch.dtype, zeros: bool = False) -> torch.Tensor:
        """A new S-element tensor on :attr:`shard_device` (pinned when asked)."""
        make = torch.zeros if zeros else torch.empty
        return make(self.layout.shard_size, dtype=dtype, device=self.shard_device, pin_memory=self.pin_memory)

    def local_view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s chunk of an S-element buffer laid out like the shard (its local shape)."""
        o, n, shape = self._chunks[i]
        return flat[o : o + n].view(shape)

    def local_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`local_view` of every parameter."""
        return [flat[o : o + n].view(shape) for o, n, shape in self._chunks]

    def chunk_of(self, full: torch.Tensor, i: int) -> torch.Tensor:
        """This rank's chunk of a full-shape tensor of parameter ``i`` along its shard dim (FSDP2's
        ``torch.chunk``): a view, not contiguous along a dim other than 0."""
        k, rows, dim = self.layout.chunk_rows(i), self.layout.local_rows(self.rank, i), self.layout.dims[i]
        start = min(self.rank * k, full.shape[dim])
        return full.narrow(dim, start, rows)

    def _fill_shard(self, flat: torch.Tensor, chunks: Sequence[torch.Tensor | None]) -> None:
        """Write ``chunks`` (one per parameter, local shape, any device; None: zeros) into ``flat``,
        padding zeroed."""
        with torch.no_grad():
            sources = [None if c is None else c.to(flat.device).reshape(-1) for c in chunks]
            numels = [self.layout.local_numel(self.rank, i) for i in range(len(chunks))]
            flatten(sources, list(self.layout.offsets), flat, numels=numels)

    def _make_sharded_param(self, i: int, requires_grad: bool, full: torch.Tensor) -> nn.Parameter:
        if i in self.subclass_positions:
            local = self.subclass_locals[i] = subclass_local(full, self.rank, self.world_size)
        else:
            local = self.local_view(self.sharded_flat, i)
        param = self.specs[i].parameter(local, self.shapes[i], requires_grad, self.layout.dims[i])
        self._tag(param, i)
        return param

    def wrap_local(self, local: torch.Tensor, i: int) -> torch.Tensor:
        """``local`` (a tensor of parameter ``i``'s local shape, e.g. a view of an optimizer state
        laid out like the shard) as parameter ``i``'s DTensor: its global shape and placements."""
        return self.specs[i].wrap(local, self.shapes[i], self.layout.dims[i])

    def _tag(self, param: torch.Tensor, i: int) -> None:
        set_tag(param, self, i)

    def prefix_fqns(self, prefix: str) -> None:
        """Prepend ``prefix`` (e.g. ``"layers.0."``) to every parameter's name in ``fqns``."""
        for pos in range(len(self.fqns)):
            self.prefix_fqn(pos, prefix)

    def prefix_fqn(self, pos: int, prefix: str) -> None:
        """Prepend ``prefix`` to the name of parameter ``pos`` only (a grouped unit's parameters are
        named relative to the module each belongs to)."""
        self.fqns[pos] = prefix + self.fqns[pos]

    @property
    def requires_grad(self) -> bool:
        """Whether any parameter of the group is trainable now (its sharded parameter's flag)."""
        return any(p.requires_grad for p in self.sharded_params)

    def sync_requires_grad(self) -> bool:
        """Give each unsharded parameter its sharded one's ``requires_grad``; True if one changed."""
        changed = False
        for sharded, unsharded in zip(self.sharded_params, self.unsharded_params):
            if unsharded.requires_grad != sharded.requires_grad:
                unsharded.requires_grad_(sharded.requires_grad)
                changed = True
        return changed

    # ---------------------------------------------------------------- taking converted parameters back
    def rehome_needed(self, registered: Sequence[torch.Tensor]) -> bool:
        """Whether ``registered`` (what the modules hold now) are not this group's sharded parameters
        viewing ``sharded_flat`` (``module.to``, ``to_empty``, an assignment replaced them)."""
        if self.device.type == "meta":
            return any(local_of(p).device.type != "meta" or p is not q for p, q in zip(registered, self.sharded_params))
        lo = self.sharded_flat.data_ptr()
        hi = lo + self.sharded_flat.nbytes
        for i, (p, q) in enumerate(zip(registered, self.sharded_params)):
            local = local_of(p)
            if i in self.subclass_positions:
                if p is not q or local is not self.subclass_locals[i]:
                    return True
                continue
            if (p is not q or local.dtype != self.dtype or local.device != self.shard_device
                    or (local.numel() > 0 and not lo <= local.data_ptr() < hi)):
                return True
        return False

    def _chunk_values(self, tensor: torch.Tensor, i: int) -> torch.Tensor:
        """This rank's chunk of parameter ``i`` from what a module holds for it: a DTensor of this
        group's placements (its local tensor), or a full-shape tensor (its rows).

        Raises:
            ValueError: a DTensor of other placements or local shape, or a tensor of another shape.
        """
        want = self.layout.local_shape(self.rank, i)
        if is_dtensor(tensor):
            local = local_of(tensor)
            placements = self.specs[i].placements_for(self.layout.dims[i])
            if tuple(local.shape) == want and tuple(tensor.placements) == placements:
                return local
            raise ValueError(
                f"parameter '{self.fqns[i]}' was replaced by a DTensor with placements {tensor.placements} and local "
                f"shape {tuple(local.shape)}, but its unit shards it as {placements} with local shape "
                f"{want}: assign a full-shape tensor or a DTensor of the unit's placements")
        full_shape = self.specs[i].global_shape_of(self.shapes[i])
        if tuple(tensor.shape) == full_shape:
            return self.chunk_of(self.specs[i].local_of_full(tensor.detach()), i)
        raise ValueError(f"parameter '{self.fqns[i]}' was replaced by a tensor of shape {tuple(tensor.shape)}; its "
                         f"full shape is {full_shape}")

    def rehome(self, registered: Sequence[torch.Tensor], param_dtype: torch.dtype | None,
               device: torch.device | None = None) -> bool:
        """Take back parameters that ``nn.Module._apply`` (``to``, ``double``, ``to_empty``),
        ``load_state_dict(assign=True)`` or an assignment put in place of the sharded ones; True if
        anything changed.

        ``_apply`` gives a DTensor parameter a new local tensor (``swap_tensors``, same object),
        which no longer views ``sharded_flat``: the optimizer would step storage the all-gather
        never reads. Here the group adopts the new dtype and device: a new ``sharded_flat`` gets
        the values, each DTensor parameter's local tensor is pointed back into it (same objects,
        so optimizers and the module keep them; a full-shape tensor put in its place gets a new
        DTensor parameter), gradients follow, and the unsharded buffers are rebuilt in
        ``param_dtype`` (None: the new dtype). The layout is kept: its offsets are multiples of
        the alignment, so a wider dtype stays aligned (a narrower one is refused by the caller).

        Args:
            registered: what the modules now hold for each parameter.
            param_dtype: the unsharded dtype (the policy's), or None to follow the parameters.
            device: the compute device from now on (None: the parameters'); with ``offload``
                the shard goes to the CPU whatever the parameters' device.
        """
        if not self.rehome_needed(registered):
            return False
        for i in self.subclass_positions:
            raise ValueError(
                f"parameter '{self.fqns[i]}' keeps its tensor subclass ({type(local_of(self.sharded_params[i])).__name__}"
                f", for its fsdp_pre_all_gather / fsdp_post_all_gather) and was converted or replaced after "
                f"fully_shard (module.to, to_empty, an assignment): convert the module before fully_shard")
        first = local_of(registered[0]) if registered else self.sharded_flat
        self.device = device or first.device
        self.dtype = first.dtype
        grads = [getattr(p, "grad", None) for p in registered]
        with torch.no_grad():
            flat = self._new_shard(self.dtype)
            if flat.device.type != "meta" and first.device.type != "meta":
                self._fill_shard(flat, [self._chunk_values(p, i) for i, p in enumerate(registered)])
            grad_flat = None
            if any(g is not None for g in grads):
                grad_flat = self._new_shard(self.dtype, zeros=True)
                self._fill_shard(grad_flat, [None if g is None else self._chunk_values(g, i)
                                             for i, g in enumerate(grads)])
        self.sharded_flat = flat
        params = []
        for i, p in enumerate(registered):
            view = self.local_view(flat, i)
            if is_dtensor(p) and p.dtype == view.dtype:
                p.grad = None
                set_dtensor_local(p, view)
            elif not self.spec.is_dtensor and isinstance(p, nn.Parameter):
                p.grad = None
                p.data = view
            else:
                p = self.specs[i].parameter(view, self.shapes[i], p.requires_grad, self.layout.dims[i])
            self._tag(p, i)
            params.append(p)
        self.sharded_params = params
        self.param_dtype = param_dtype or self.dtype
        self.reset_grads(grad_flat, [g is not None for g in grads])
        self._make_unsharded()
        return True

    # ---------------------------------------------------------------- the unsharded side
    def _make_unsharded(self) -> None:
        """The unsharded (and gathered) buffers and their views: created once (again after
        :meth:`rehome`), storage freed until the first unshard."""
        lay = self.layout
        self.unsharded_flat = torch.empty(lay.unsharded_size, dtype=self.param_dtype, device=self.device)
        self.unsharded_params = [spec.unsharded_parameter(self.unsharded_data(i), p.requires_grad)
                                 for i, (p, spec) in enumerate(zip(self.sharded_params, self.specs))]
        if lay.zero_copy:
            self.gathered = self.unsharded_flat
            self._copy_out_targets: list[torch.Tensor] = []
        else:
            self.gathered = torch.empty(lay.gathered_size, dtype=self.param_dtype, device=self.device)
            self._copy_out_targets = [
                self.unsharded_flat[lay.unsharded_offsets[s.param_index] + s.param_offset:][: s.numel]
                for s in lay.segments]
            self._copy_out = UnflattenPlan([s.gathered_offset for s in lay.segments], self._copy_out_targets)
        self._own_slice = self.gathered_slice(self.rank, self.world_size)
        self._unsharded_nbytes = lay.unsharded_size * self.unsharded_flat.element_size()
        self._gathered_nbytes = lay.gathered_size * self.unsharded_flat.element_size()
        self.free_unsharded()

    def unsharded_data(self, i: int) -> torch.Tensor:
        """Parameter ``i``'s full-shape view of the unsharded buffer, as a plain tensor."""
        u, n = self.layout.unsharded_offsets[i], self.layout.numels[i]
        return self.unsharded_flat[u : u + n].view(self.shapes[i])

    def unsharded_grads(self) -> list[torch.Tensor | None]:
        """The unsharded parameters' gradients to reduce, as plain tensors (a tensor-parallel
        parameter's gradient redistributed to its TP placements: its local tensor; a tensor
        subclass's copied into a plain tensor)."""
        return [as_plain(spec.local_grad(p.grad)) for spec, p in zip(self.specs, self.unsharded_params)]

    def unsharded_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's 1-D range of a buffer laid out like the unsharded one."""
        return [flat[u : u + n] for u, n in zip(self.layout.unsharded_offsets, self.layout.numels)]

    @property
    def is_unsharded(self) -> bool:
        """Whether the unsharded buffer's storage is allocated."""
        return self.unsharded_flat.untyped_storage().nbytes() > 0

    def alloc_unsharded(self, gathered: bool = True) -> None:
        """Re-materialise the unsharded and (unless ``gathered`` is False: an all-gather into a
        bucket's buffer, ``bucket.py``) the gathered buffers' storage in place (contents undefined)."""
        storage = self.unsharded_flat.untyped_storage()
        if storage.nbytes() != self._unsharded_nbytes:
            storage.resize_(self._unsharded_nbytes)
        if gathered and self.gathered is not self.unsharded_flat:
            storage = self.gathered.untyped_storage()
            if storage.nbytes() != self._gathered_nbytes:
                storage.resize_(self._gathered_nbytes)

    def free_gathered(self) -> None:
        """Free the gathered buffer's storage once copied out (nothing when it is the unsharded one)."""
        if self.gathered is not self.unsharded_flat:
            self.gathered.untyped_storage().resize_(0)

    def free_unsharded(self) -> None:
        """Free the unsharded (and gathered) storage; the tensor objects and views stay alive."""
        self.unsharded_flat.untyped_storage().resize_(0)
        self.free_gathered()

    def gathered_slice(self, rank: int | None = None, parts: int | None = None) -> torch.Tensor:
        """Slice ``rank`` of ``parts`` equal slices of the gathered buffer (default: this rank's
        S elements, where copy-in writes and the all-gather reads)."""
        if rank is None and parts is None and hasattr(self, "_own_slice"):
            return self._own_slice
        parts = self.world_size if parts is None else parts
        rank = self.rank if rank is None else rank
        n = self.layout.gathered_size // parts
        return self.gathered[rank * n : (rank + 1) * n]

    def copy_out(self) -> None:
        """Move every chunk from the gathered buffer into the unsharded parameters (one launch of
        the kept ``UnflattenPlan``), then free the gathered buffer; nothing to do when zero-copy.

        The kernel's segments are runs of elements, which a chunk along a dim k != 0 is not
        (``Shard(k)`` parameters, ``layout.strided``): those parameters are reassembled along k
        with torch ops instead (``dim_chunks.chunks_to_full``: at most two strided copies each,
        on the current stream), after the launch for the others."""
        if self.gathered is self.unsharded_flat:
            return
        with torch.no_grad():
            if self._copy_out_targets:
                self._copy_out.run(self.gathered)
            for i in self.layout.strided:
                chunks_to_full(self.gathered, self.layout, i, self.unsharded_data(i))
        self.free_gathered()

    def secondary_copy(self, parts: int, index: int) -> torch.Tensor:
        """A copy of slice ``index`` of ``parts`` of the gathered layout, built from the unsharded
        parameters (the gathered buffer is freed by then): what a rank keeps after forward when
        it reshards to a group of ``parts`` ranks (``reshard_after_forward=<int>``); the chunks of
        ``Shard(k)`` parameters, k != 0, of the slice's ranks are cut along k with torch ops."""
        n = self.layout.gathered_size // parts
        if self.gathered is self.unsharded_flat:
            return self.unsharded_flat[index * n : (index + 1) * n].clone()
        out = torch.empty(n, dtype=self.param_dtype, device=self.device)
        lo = index * n
        picked = [(s, t) for s, t in zip(self.layout.segments, self._copy_out_targets)
                  if lo <= s.gathered_offset < lo + n]
        with torch.no_grad():
            flatten([t for _, t in picked], [s.gathered_offset - lo for s, _ in picked], out)
            per = self.world_size // parts
            for i in self.layout.strided:
                full_to_chunks(self.unsharded_data(i), self.layout, i, out,
                               ranks=range(index * per, (index + 1) * per))
        return out

    def note_copy_in(self) -> None:
        """Record that the shard is being copied in now (see [Note: stale unsharded parameters])."""
        self.gathered_at = (_shard_epoch, self.sharded_flat._version)

    def copy_in(self) -> None:
        """Cast ``sharded_flat`` to ``param_dtype`` into this rank's slice of the gathered buffer
        (with ``offload``: a host-to-device copy, asynchronous from pinned memory)."""
        self.gathered_at = (_shard_epoch, self.sharded_flat._version)
        # One S-element tensor into an S-element slice: ``copy_`` is the one cast launch that
        # ``flatten`` would make (the same rounding, nearest even), without its per-call
        # validation of a multi-tensor layout, the host cost of every unshard of small units.
        with torch.no_grad():
            self._own_slice.copy_(self.sharded_flat, non_blocking=self.pin_memory)

    def quantize_in(self, packed: torch.Tensor) -> None:
        """Copy-in of an int8 all-gather (ZeRO++ qwZ, ``runtime/quantized_gather.py``): quantise
        ``sharded_flat`` block-wise into ``packed``, this rank's chunk of the all-gather buffer
        (``packed_nbytes(S)`` int8 bytes on the compute device); with ``offload`` the shard is
        quantised on the host and its int8 chunk copied over (a quarter of fp32's bytes)."""
        self.gathered_at = (_shard_epoch, self.sharded_flat._version)
        with torch.no_grad():
            if packed.device == self.sharded_flat.device:
                quantize_int8(self.sharded_flat, packed)
                return
            host = torch.empty(packed.numel(), dtype=torch.int8, pin_memory=self.pin_memory)
            packed.copy_(quantize_int8(self.sharded_flat, host), non_blocking=self.pin_memory)

    def gathered_is_stale(self) -> bool:
        """Whether the shard may have changed since the last copy-in (see [Note: stale unsharded
        parameters])."""
        return getattr(self, "gathered_at", None) != (_shard_epoch, self.sharded_flat._version)

    @property
    def unsharded_nbytes(self) -> int:
        """Bytes of the unsharded buffer when allocated (its elements · itemsize of ``param_dtype``)."""
        return self._unsharded_nbytes

    @property
    def gathered_nbytes(self) -> int:
        """Bytes of the gathered buffer while an all-gather lands (0 when it is the unsharded one)."""
        return 0 if self.gathered is self.unsharded_flat else self._gathered_nbytes

    def sharded_nbytes(self) -> int:
        """Bytes this rank holds for the group's master weights and gradient shard."""
        grad = 0 if self.sharded_grad is None else self.sharded_grad.numel() * self.sharded_grad.element_size()
        return self.sharded_flat.numel() * self.sharded_flat.element_size() + grad
