"""Initialising sharded parameters as if they were full: meta-device construction done right.

Big models are built on the meta device, sharded, materialised with ``to_empty`` (only this rank's
shard is ever allocated) and then initialised: ``module.reset_parameters()``, torchtitan's
``init_weights()``, a Hugging Face ``_init_weights``. On a DTensor parameter that code already
sees the full shape (``kaiming_uniform_`` computes the fan-in from it), but a random op draws
each rank's chunk from the rank's own generator: the values then differ from what an unsharded
model gets from the same seed (FSDP2 on CPU, or without torch's DTensor RNG tracker), and
rank-local tensor code (``trunc_normal_`` samples by rejection) sees only the chunk.

So, where the unit asks for it (``FSDPModule.set_unsharded_init``; by default the parameters
stay FSDP2's DTensors and DTensor's random ops draw per shard, as FSDP2's do), from ``to_empty``
until the model is first used (a forward, a state dict, an optimizer step,
gradient clipping, another ``module.to``: see :func:`close_init_windows`), each sharded
parameter's class is swapped to :class:`ShardedInitParameter` (the same object: optimizers built
meanwhile keep it). Inside this *init window*:

- metadata (shape, dtype, device, placements, ``requires_grad_``, hashing) is the DTensor's own;
- DTensor methods (``to_local``, ``full_tensor``, ``redistribute``) see the shard, with the
  window's writes copied back first;
- any other operation runs on the parameter's **full-shape stand-in**: its flat group is
  *activated* — a plain buffer of the group's unsharded layout (the master dtype) holding this
  rank's rows of every parameter and NaN elsewhere — and the operation gets the parameter's view
  of it. Every rank runs the same initialisation code on the same full shapes with the same
  generator, so each draws the full tensors exactly as the unsharded model would and its own rows
  hold exactly the unsharded model's values (no collective is needed, so rank-local code cannot
  hang). When the group is deactivated (a few groups stay active at once, the least recently used
  goes first; all go when the window closes) its rows are copied back into the shard. What is left
  NaN is what no rank could know without a collective: code that reads values it did not write in
  this window across ranks (``p / p.norm()`` right after a load) gets NaN, visibly, instead of
  silently wrong numbers.

Memory: at most :data:`MAX_ACTIVE` groups' full buffers at a time (a unit's unsharded size in the
master dtype), as during a forward. Plain parameters (one process without ``torch.distributed``)
hold the whole tensor already and get no window.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict

import torch
from torch.distributed.tensor import DTensor

from flashfsdp._torch_private import DisableTorchFunctionSubclass, pytree
from flashfsdp.runtime.flat_param import shards_written
from flashfsdp.runtime.param_tags import group_of, tag_of
from flashfsdp.runtime.tensor_parallel import TensorParallelSpec

MAX_ACTIVE = 3

# id -> weak reference of every piece whose window is open (tensors compare element-wise, so no WeakSet)
_OPEN: dict[int, weakref.ref] = {}
# id(group) -> (group, full flat buffer), least recently used first
_ACTIVE: "OrderedDict[int, tuple[object, torch.Tensor]]" = OrderedDict()

_PASSTHROUGH_NAMES = {
    "__hash__", "__repr__", "__format__", "__reduce_ex__", "__deepcopy__", "__setstate__",
    "requires_grad_", "is_floating_point", "is_complex", "element_size", "data_ptr", "untyped_storage",
    "_typed_storage", "register_hook", "register_post_accumulate_grad_hook", "retain_grad", "_is_view",
    "get_device", "is_pinned", "__dlpack_device__", "__set__", "size", "dim", "ndimension", "numel", "nelement",
    "__len__", "stride", "is_contiguous",
}
_PASSTHROUGH_GETTERS = {"requires_grad", "is_leaf", "grad", "dtype", "device", "layout", "is_cuda", "is_cpu",
                        "is_meta", "is_sparse", "_version", "grad_fn", "names", "name", "is_quantized", "shape",
                        "ndim", "placements", "device_mesh"}
# What reads the shard itself: pickling, copying, autograd Functions applied to the parameter
# (DTensor's own, e.g. from_local's); DTensor's methods are overridden below.
_SHARD_READERS = {"__reduce_ex__", "__deepcopy__", "apply"}


class ShardedInitParameter(DTensor):
    """A sharded DTensor parameter inside the init window (module docstring). Never constructed:
    the class of an existing parameter is swapped to this one by :func:`open_init_window` and back
    by :func:`close_init_windows`."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _SHARD_READERS:
            return _as_dtensors(func, args, kwargs)
        if _is_passthrough(func):
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = pytree.tree_map(_full_or_same, (args, kwargs))
        with DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    # DTensor's methods read ``_local_tensor`` directly (no torch function): the window's writes
    # are copied back into the shard first.
    def to_local(self, *args, **kwargs):  # noqa: D102 - DTensor's
        return _as_dtensors(DTensor.to_local, (self, *args), kwargs)

    def full_tensor(self, *args, **kwargs):  # noqa: D102 - DTensor's
        return _as_dtensors(DTensor.full_tensor, (self, *args), kwargs)

    def redistribute(self, *args, **kwargs):  # noqa: D102 - DTensor's
        return _as_dtensors(DTensor.redistribute, (self, *args), kwargs)


def _as_dtensors(func, args: tuple, kwargs: dict):
    """Run a DTensor method on the parameters as the plain DTensors they are outside the window
    (their groups' stand-ins copied back first): its collectives must run as DTensor runs them."""
    params = [a for a in (*args, *kwargs.values()) if isinstance(a, ShardedInitParameter)]
    for p in params:
        if id(group_of(p)) in _ACTIVE:
            _deactivate(id(group_of(p)))
        p.__class__ = DTensor
    try:
        return func(*args, **kwargs)
    finally:
        for p in params:
            p.__class__ = ShardedInitParameter


def _is_passthrough(func) -> bool:
    name = getattr(func, "__name__", "")
    if name in _PASSTHROUGH_NAMES:
        return True
    if name == "__get__":  # attribute getters: those that do not read values
        owner = getattr(func, "__self__", None)
        return getattr(owner, "__name__", None) in _PASSTHROUGH_GETTERS
    return False


def _full_or_same(a):
    return full_view(a) if isinstance(a, ShardedInitParameter) else a


def full_view(param: torch.Tensor) -> torch.Tensor:
    """The full-shape stand-in of a sharded parameter inside the init window (activating its group)."""
    tag = tag_of(param)
    group = tag.group
    key = id(group)
    if key in _ACTIVE:
        _ACTIVE.move_to_end(key)
    else:
        while len(_ACTIVE) >= MAX_ACTIVE:
            _deactivate(next(iter(_ACTIVE)))
        flat = torch.full((group.layout.unsharded_size,), float("nan"), dtype=group.dtype,
                          device=group.sharded_flat.device)
        with torch.no_grad(), DisableTorchFunctionSubclass():
            for i, full in enumerate(_full_views(group, flat)):
                group.chunk_of(full, i).copy_(group.local_view(group.sharded_flat, i))
        _ACTIVE[key] = (group, flat)
    return _full_views(group, _ACTIVE[key][1])[tag.index]


def _full_views(group, flat: torch.Tensor) -> list[torch.Tensor]:
    return [v.view(shape) for v, shape in zip(group.unsharded_views(flat), group.shapes)]


def _deactivate(key: int) -> None:
    """Copy a group's rows of its full stand-in back into its shard and drop the stand-in."""
    group, flat = _ACTIVE.pop(key)
    with torch.no_grad(), DisableTorchFunctionSubclass():
        for i, full in enumerate(_full_views(group, flat)):
            group.local_view(group.sharded_flat, i).copy_(group.chunk_of(full, i))
    shards_written()


def open_init_window(params: list[torch.Tensor]) -> None:
    """Swap these sharded parameters' class to :class:`ShardedInitParameter` until
    :func:`close_init_windows` (DTensor parameters only: a plain one holds its whole tensor; a
    tensor-parallel one stays a DTensor, initialised per shard as FSDP2's, since its group's
    stand-in would have the TP-local shape, not the global one its initialisation reads)."""
    for p in params:
        if type(p) is DTensor and not isinstance(tag_of(p).group.specs[tag_of(p).index], TensorParallelSpec):
            p.__class__ = ShardedInitParameter
            _OPEN[id(p)] = weakref.ref(p)


def close_init_windows(pieces: list[torch.Tensor] | None = None) -> None:
    """End the init window of every piece (or only of ``pieces``): the active stand-ins are copied
    back into their shards and the pieces get their ``nn.Parameter`` class back. Cheap when no
    window is open."""
    if not _OPEN:
        return
    if pieces is None:
        for key in list(_ACTIVE):
            _deactivate(key)
        pieces = [r() for r in _OPEN.values()]
    else:
        groups = {id(group_of(p)) for p in pieces if type(p) is ShardedInitParameter}
        for key in [k for k in _ACTIVE if k in groups]:
            _deactivate(key)
    for p in pieces:
        if p is not None and type(p) is ShardedInitParameter:
            p.__class__ = DTensor
            _OPEN.pop(id(p), None)
