"""FSDP2's all-gather extensions: ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` on a local tensor.

A parameter's local tensor (a tensor subclass such as torch's ``TwoTensor``, or a plain local
tensor with the methods monkey-patched on it) may define the pair; FSDP2 then all-gathers what
``fsdp_pre_all_gather`` returns instead of the parameter's chunk, and builds the unsharded
parameter with ``fsdp_post_all_gather`` (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``,
``FSDPParam.all_gather_inputs`` / ``init_unsharded_param``). Here:

- A parameter whose class defines the pair at ``fully_shard`` keeps its subclass: its sharded
  parameter is a DTensor whose local tensor is the subclass's padded chunk, narrowed as FSDP2 cuts
  it (:func:`subclass_local`); its slot in the group's flat shard is not used. A plain local tensor
  patched later (after ``to_empty``, before the first forward) stays a view of the flat shard.
- A unit with such a parameter all-gathers by bytes (:class:`PackedAllGather`, FSDP2's
  ``foreach_all_gather`` with a ``uint8`` buffer when dtypes differ): each rank's part holds every
  plain group's copied-in shard, then every extension's all-gather inputs, each 16-byte aligned;
  one all-gather; after it, the groups' parts are copied into their gathered buffers (the usual
  copy-out follows) and the extensions' into their all-gather outputs, which
  ``fsdp_post_all_gather`` turns into the unsharded parameter (:class:`ParamExtension`). Units
  without extensions never come here.
- Gradients are reduce-scattered with the group's, as plain tensors of the parameter's dtype
  (:func:`as_plain`), as FSDP2's ``foreach_reduce`` copies them into its plain buffer.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
import torch.nn as nn

from flashfsdp._torch_private import unsafe_set_version_counter

from .communicator import Communicator, Work

_ALIGN_BYTES = 16


def defines_extension(obj: Any) -> bool:
    """Whether ``obj`` (a tensor or a tensor class) has ``fsdp_pre_all_gather``."""
    return hasattr(obj, "fsdp_pre_all_gather")


def check_pair(local: torch.Tensor, fqn: str) -> bool:
    """Whether parameter ``fqn``'s local tensor uses the extensions (defines both hooks).

    Raises:
        ValueError: only one of ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` is defined.
    """
    pre, post = hasattr(local, "fsdp_pre_all_gather"), hasattr(local, "fsdp_post_all_gather")
    if pre != post:
        raise ValueError(
            f"parameter '{fqn}': its local tensor ({type(local).__name__}) defines "
            f"{'fsdp_pre_all_gather' if pre else 'fsdp_post_all_gather'} only; all-gather extensions need both "
            f"fsdp_pre_all_gather and fsdp_post_all_gather")
    return pre


def check_kept_subclasses(params: Sequence[torch.Tensor], fqns: Sequence[str], offload: bool,
                          dims: Sequence[int]) -> frozenset[int]:
    """The positions of ``params`` (a flat group's full parameters) whose class defines FSDP2's
    all-gather extensions, checked where the group is made (``fully_shard``).

    Raises:
        ValueError: a class with one of the two hooks only; such a parameter with CPU offload, or
            sharded along a dim other than 0 (``dims``: each parameter's shard dim), naming it.
    """
    found = []
    for i, p in enumerate(params):
        if type(p) in (nn.Parameter, torch.Tensor) or not check_pair(p, fqns[i]):
            continue
        if offload:
            raise ValueError(
                f"parameter '{fqns[i]}' ({type(p).__name__}) defines fsdp_pre_all_gather / fsdp_post_all_gather, which "
                f"is not supported with CPU offload (CPUOffloadPolicy): shard it without offload_policy")
        if dims[i] != 0:
            raise ValueError(
                f"parameter '{fqns[i]}' ({type(p).__name__}) defines fsdp_pre_all_gather / fsdp_post_all_gather and "
                f"is sharded along dim {dims[i]} (shard_placement_fn): extensions are supported on Shard(0) only")
        found.append(i)
    return frozenset(found)


def refuse_subclass_params(groups, where: str, instead: str) -> None:
    """Raise if a parameter of ``groups`` (flat groups) keeps a tensor subclass for the all-gather
    extensions: ``where`` reads the flat shard, whose slot for such a parameter is zero.

    Raises:
        NotImplementedError: naming ``where``, the first such parameter and ``instead`` (what to use).
    """
    for group in groups:
        for pos in sorted(getattr(group, "subclass_positions", ())):
            local = getattr(group.sharded_params[pos], "_local_tensor", group.sharded_params[pos])
            raise NotImplementedError(
                f"{where} works on the unit's flat shard; parameter '{group.fqns[pos]}' is a tensor subclass "
                f"({type(local).__name__}) with fsdp_pre_all_gather / fsdp_post_all_gather, kept outside that shard: "
                f"{instead}")


def subclass_local(param: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s chunk of a tensor-subclass parameter along dim 0 as FSDP2 makes it: the
    subclass's own ``torch.chunk`` (``aten.split``), copied into a zero-padded ``new_zeros`` of the
    padded chunk size (the same subclass) narrowed from row 0, and returned narrowed to this rank's
    rows (shape ``(rows, *param.shape[1:])``). Only the ops FSDP2 uses are asked of the subclass:
    torchao's ``NF4Tensor`` splits but cannot slice from a row other than 0."""
    rows = param.shape[0]
    k = -(-rows // world_size)
    with torch.no_grad():
        chunks = torch.chunk(param.detach(), world_size, dim=0)
        mine = chunks[rank].shape[0] if rank < len(chunks) else 0
        padded = param.detach().new_zeros((k, *param.shape[1:]))
        if mine:
            padded.narrow(0, 0, mine).copy_(chunks[rank])
    return padded.narrow(0, 0, mine)


def as_plain(grad: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient as a plain tensor of its dtype (a tensor subclass's gradient copied into one, as
    FSDP2's reduce-scatter copy-in does); plain tensors and None are returned as they are."""
    if grad is None or type(grad) is torch.Tensor:
        return grad
    out = torch.empty(grad.shape, dtype=grad.dtype, device=grad.device)
    with torch.no_grad():
        out.copy_(grad)
    return out


def _free(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    if storage.nbytes():
        storage.resize_(0)


def _alloc(tensor: torch.Tensor) -> None:
    storage = tensor.untyped_storage()
    nbytes = (tensor.storage_offset() + tensor.numel()) * tensor.element_size()
    if storage.nbytes() < nbytes:
        storage.resize_(nbytes)


class ParamExtension:
    """The extension state of one parameter: its all-gather metadata, outputs and unsharded form.

    Args:
        group: the parameter's flat group (``FlatParam``); ``pos``: its index there.
        module: the module that holds the parameter (passed to ``fsdp_pre_all_gather``).
    """

    def __init__(self, group, pos: int, module: nn.Module | None):
        self.group, self.pos, self.module = group, pos, module
        self.fqn = group.fqns[pos]
        self.outputs: list[torch.Tensor] = []
        self.input_sizes: list[torch.Size] = []
        self.metadata: Any = None
        self.unsharded: nn.Parameter | None = None
        self.inner: Sequence[torch.Tensor] = ()

    @property
    def local(self) -> torch.Tensor:
        """The sharded parameter's local tensor (the subclass's chunk, or a patched plain view)."""
        param = self.group.sharded_params[self.pos]
        return getattr(param, "_local_tensor", param)

    def all_gather_inputs(self, mesh, mp_policy) -> list[torch.Tensor]:
        """Call ``fsdp_pre_all_gather`` (the 1-argument form ``(mesh)`` or the 5-argument form
        ``(mesh, outer_size, outer_stride, module, mp_policy)``) and check what it returns: 1-D
        views of the all-gather inputs (any dtypes), on the unit's device.

        Raises:
            TypeError: another signature, or a result that is not ``(tuple of tensors, metadata)``.
            ValueError: an input on another device, or (on a rank whose chunk is padded) inputs of
                another size than the padded chunk's.
        """
        local, shape = self.local, self.group.shapes[self.pos]
        fn = local.fsdp_pre_all_gather
        nargs = len(inspect.signature(fn).parameters)
        if nargs not in (1, 5):
            raise TypeError(
                f"parameter '{self.fqn}': fsdp_pre_all_gather{inspect.signature(fn)} has {nargs} parameters; FSDP2's "
                f"forms are fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy) and the older "
                f"fsdp_pre_all_gather(self, mesh)")
        if nargs == 1:
            result = fn(mesh)
        else:
            stride = torch.empty(shape, device="meta").stride()
            result = fn(mesh, torch.Size(shape), stride, self.module, mp_policy)
        inputs, self.metadata = self._check_result(result)
        padded = (self.group.layout.chunk_rows(self.pos), *shape[1:])
        if tuple(local.shape) != padded and any(tuple(t.shape) != padded for t in inputs):
            raise ValueError(
                f"parameter '{self.fqn}' is sharded unevenly (full shape {tuple(shape)}, {self.group.world_size} "
                f"ranks): fsdp_pre_all_gather must return all-gather inputs of the padded chunk size {padded}, got "
                f"{[tuple(t.shape) for t in inputs]}")
        self.input_sizes = [t.size() for t in inputs]
        return [t.contiguous().view(-1) for t in inputs]

    def _check_result(self, result) -> tuple[tuple[torch.Tensor, ...], Any]:
        device = self.group.device
        if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], (tuple, list))
                and result[0] and all(isinstance(t, torch.Tensor) for t in result[0])):
            raise TypeError(
                f"parameter '{self.fqn}': fsdp_pre_all_gather must return (all_gather_inputs, metadata) with "
                f"all_gather_inputs a non-empty tuple of tensors, got {type(result).__name__} "
                f"{_describe(result)}; return e.g. ((self.to(torch.bfloat16),), None)")
        for t in result[0]:
            if t.device != device:
                raise ValueError(f"parameter '{self.fqn}': fsdp_pre_all_gather returned an input on {t.device}; the "
                                 f"unit all-gathers on {device}: return inputs on {device}")
        return tuple(result[0]), result[1]

    def output_views(self, numels: Sequence[int], dtypes: Sequence[torch.dtype], world_size: int) -> list[torch.Tensor]:
        """The all-gather outputs (W·numel elements each, flat), made on the first all-gather and
        re-materialised in place after, so that the unsharded parameter built over them stays valid."""
        same = [(t.numel(), t.dtype) for t in self.outputs] == [(n * world_size, d) for n, d in zip(numels, dtypes)]
        if not same:
            self.outputs = [torch.empty(n * world_size, dtype=d, device=self.group.device)
                            for n, d in zip(numels, dtypes)]
            self.unsharded = None
        for t in self.outputs:
            _alloc(t)
        return self.outputs

    def post_all_gather(self) -> None:
        """Build (first time: ``fsdp_post_all_gather`` returns ``(tensor, inner_tensors)``) or refresh
        (``out=`` the unsharded parameter) the unsharded parameter from the all-gather outputs, and
        put it in the group's ``unsharded_params`` (what the module holds during forward/backward).

        Raises:
            TypeError: the first call does not return ``(tensor, tuple of tensors)``.
        """
        group, local = self.group, self.local
        outputs = tuple(t.view(-1, *s[1:]) for t, s in zip(self.outputs, self.input_sizes))
        if self.unsharded is not None:
            for t in self.inner:
                _alloc(t)
            local.fsdp_post_all_gather(outputs, self.metadata, group.param_dtype, out=self.unsharded)
        else:
            result = local.fsdp_post_all_gather(outputs, self.metadata, group.param_dtype)
            if not (isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], torch.Tensor)):
                raise TypeError(f"parameter '{self.fqn}': fsdp_post_all_gather without out= must return "
                                f"(unsharded_tensor, tensors_to_free), got {_describe(result)}")
            tensor, self.inner = result[0], tuple(result[1])
            shape = group.shapes[self.pos]
            full = torch.as_strided(tensor, shape, torch.empty(shape, device="meta").stride(), storage_offset=0)
            self.unsharded = nn.Parameter(full, requires_grad=group.sharded_params[self.pos].requires_grad)
        self.metadata = None
        group.unsharded_params[self.pos] = self.unsharded

    def free(self) -> None:
        """Free the storage of the all-gather outputs and of the tensors ``fsdp_post_all_gather``
        said to free (FSDP2's ``free_unsharded_param``)."""
        for t in (*self.outputs, *self.inner):
            _free(t)


def _describe(value) -> str:
    if isinstance(value, (tuple, list)):
        return f"({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


def scan(groups, modules: Sequence[nn.Module | None], offset_of) -> list[ParamExtension]:
    """The parameters of ``groups`` whose local tensor uses the extensions, as
    :class:`ParamExtension` (``modules[offset_of(group, pos)]``: the module holding each).

    Raises:
        ValueError: only one hook defined; an extension with CPU offload or along a dim other
            than 0 (not supported: keep such parameters plain, or the unit on the device).
    """
    found = []
    for group in groups:
        for pos, param in enumerate(group.sharded_params):
            local = getattr(param, "_local_tensor", param)
            if not check_pair(local, group.fqns[pos]):
                continue
            if group.offload:
                raise ValueError(
                    f"parameter '{group.fqns[pos]}' defines fsdp_pre_all_gather / fsdp_post_all_gather, which is not "
                    f"supported with CPU offload (CPUOffloadPolicy): shard it without offload_policy")
            if group.layout.dims[pos] != 0:
                raise ValueError(
                    f"parameter '{group.fqns[pos]}' defines fsdp_pre_all_gather / fsdp_post_all_gather and is sharded "
                    f"along dim {group.layout.dims[pos]}: extensions are supported on Shard(0) parameters only")
            index = offset_of(group, pos)
            found.append(ParamExtension(group, pos, modules[index] if index < len(modules) else None))
    return found


class PackedAllGather:
    """One unit's all-gather by bytes: plain groups' shards and extensions' inputs in one ``uint8``
    buffer (see the module docstring). Build it on the all-gather stream; :meth:`finish` after.

    Args:
        groups: the unit's flat groups (their unsharded buffers allocated and copied in).
        extensions: the unit's :class:`ParamExtension` s.
        comm: the communicator of the all-gather.
        mesh, mp_policy: passed to ``fsdp_pre_all_gather``.
    """

    def __init__(self, groups, extensions: Sequence[ParamExtension], comm: Communicator, mesh, mp_policy):
        self.groups, self.extensions, self.world_size = list(groups), list(extensions), comm.world_size
        pieces: list[torch.Tensor] = [g.gathered_slice() for g in self.groups]
        self.ext_inputs = [e.all_gather_inputs(mesh, mp_policy) for e in self.extensions]
        for inputs in self.ext_inputs:
            pieces += inputs
        self.offsets, cursor = [], 0
        for t in pieces:
            cursor = -(-cursor // _ALIGN_BYTES) * _ALIGN_BYTES
            self.offsets.append(cursor)
            cursor += t.numel() * t.element_size()
        self.stride = -(-cursor // _ALIGN_BYTES) * _ALIGN_BYTES
        device = self.groups[0].device if self.groups else self.extensions[0].group.device
        self.buffer = torch.empty(self.world_size * self.stride, dtype=torch.uint8, device=device)
        self.local = self.buffer[comm.rank * self.stride:][: self.stride]
        for t, o in zip(pieces, self.offsets):
            self.local[o : o + t.numel() * t.element_size()].copy_(t.view(torch.uint8))

    def issue(self, comm: Communicator) -> Work:
        """Start the all-gather of the packed buffer (asynchronous)."""
        return comm.all_gather_into_tensor(self.buffer, self.local)

    def finish(self, works: Sequence[Work]) -> None:
        """Wait for the all-gather, copy every part out (groups: into their gathered buffers, then
        their copy-out; extensions: into their all-gather outputs, then ``fsdp_post_all_gather``),
        keeping the outputs' version counters (as the groups' are kept, see [Note: version
        counters] in ``unit.py``), and free the packed buffer."""
        for work in works:
            work.wait()
        rows = self.buffer.view(self.world_size, self.stride)
        offsets = iter(self.offsets)
        with torch.no_grad():
            for group in self.groups:
                o = next(offsets)
                dest = group.gathered.view(torch.uint8).view(self.world_size, -1)
                dest.copy_(rows[:, o : o + dest.shape[1]])
                group.copy_out()
            for ext, inputs in zip(self.extensions, self.ext_inputs):
                outputs = ext.output_views([t.numel() for t in inputs], [t.dtype for t in inputs], self.world_size)
                versions = [t._version for t in outputs]
                for t in outputs:
                    o = next(offsets)
                    dest = t.view(torch.uint8).view(self.world_size, -1)
                    dest.copy_(rows[:, o : o + dest.shape[1]])
                unsafe_set_version_counter(tuple(outputs), tuple(versions))
                ext.post_all_gather()
        self.buffer = self.local = None
        self.ext_inputs = []
