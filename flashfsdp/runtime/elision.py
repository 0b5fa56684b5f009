"""Backward all-gather elision: which units' backward reads no unsharded parameter.

FSDP all-gathers a unit again before its backward because ``dL/dx = dL/dy · W`` reads the weights.
Some backwards read none: an embedding's backward reads only the indices (``embedding_backward``
saves them and the number of rows), a linear layer whose input requires no gradient saves only
the input (autograd saves what the derivatives it will compute need, ``derivatives.yaml``), and
the weights' own gradients never need the weights (``dL/dW = dL/dy^T · x``). Such a unit need not
be unsharded for its backward; its gradients are still accumulated into its (storage-less)
unsharded parameters and reduce-scattered as usual.

Detection is exact for what autograd keeps: every tensor an op saves for backward goes through
the saved-tensor pack hook (``torch.autograd.graph.saved_tensors_hooks``), both the tensors that
PyTorch's own ops save and those of ``ctx.save_for_backward`` in custom Functions. While a unit's
forward runs, :class:`SavedTensorWatch` checks each one against the address ranges of the unit's
unsharded buffers: a tensor whose storage overlaps them (a parameter, a view of it, the buffer
itself) is one the backward will read. A tensor that cannot be inspected (a tensor subclass
without storage) counts as overlapping.

The hooks are pass-through: ``unpack(pack(t))`` is ``t``; once every active watch has found an
overlapping tensor they are popped, so a unit whose backward reads its weights (most) pays for the
hooks only until its first weight is saved. Autograd skips its check that a saved
tensor was not modified in place since it was saved when hooks are installed, so the unpack hook
repeats it with the tensor's version counter and raises the same error.

:class:`BackwardNeeds` keeps the verdicts of the forwards since the last backward ended: a unit's
backward all-gather is skipped only if at least one forward was watched and none of them saved an
overlapping tensor or ran where a watch is not possible (see ``flashfsdp.bindings.elision``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from flashfsdp._torch_private import saved_tensors_hooks_is_enabled, top_saved_tensors_default_hooks

__all__ = ["BackwardNeeds", "SavedTensorWatch", "buffer_ranges", "overlaps", "start_watch", "stop_all_watches",
           "stop_watch", "watch_possible"]


def buffer_ranges(buffers: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """``[start, end)`` byte addresses of the storages of ``buffers`` (unsharded flat buffers,
    materialised); empty storages are left out."""
    ranges = []
    for buf in buffers:
        storage = buf.untyped_storage()
        if storage.nbytes() > 0:
            ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
    return ranges


def overlaps(tensor: torch.Tensor, ranges: Sequence[tuple[int, int]]) -> bool:
    """Whether the storage of ``tensor`` shares a byte with any of ``ranges`` (a view of a buffer,
    or the buffer itself, does). True where the storage cannot be read (a tensor subclass or a
    functorch wrapper): such a tensor may alias the buffer."""
    try:
        storage = tensor.untyped_storage()
        lo = storage.data_ptr()
        hi = lo + storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):
        return True
    return any(lo < end and start < hi for start, end in ranges)


class SavedTensorWatch:
    """One unit's forward under watch: ``found`` turns True when autograd saves a tensor that
    overlaps ``ranges`` (see :func:`overlaps`). Started and ended by :func:`start_watch` /
    :func:`stop_watch`; several watches can be active at once (nested units, a grouped unit
    whose modules run apart), each checking every saved tensor."""

    __slots__ = ("ranges", "found")

    def __init__(self, ranges: Sequence[tuple[int, int]]):
        self.ranges = list(ranges)
        self.found = False


_ACTIVE: list[SavedTensorWatch] = []


def _pack(tensor: torch.Tensor):
    newly_found = False
    for watch in _ACTIVE:
        if not watch.found and overlaps(tensor, watch.ranges):
            watch.found = newly_found = True
    if newly_found and all(watch.found for watch in _ACTIVE) and _ours_on_top():
        # Every active watch has its answer: the rest of the forward saves without hooks (the
        # tensors packed so far keep theirs). A later watch pushes them again.
        _HOOKS.__exit__(None, None, None)
    return tensor, tensor._version


def _unpack(packed) -> torch.Tensor:
    tensor, version = packed
    if tensor._version != version:
        raise RuntimeError(
            f"one of the variables needed for gradient computation has been modified by an inplace "
            f"operation: [{tensor.type()} {list(tensor.shape)}] is at version {tensor._version}; expected "
            f"version {version} instead (checked by flashfsdp's backward all-gather elision, which watches "
            f"the tensors autograd saves; FSDPModule.set_backward_all_gather_elision(False) turns it off)"
        )
    return tensor


_HOOKS = torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)  # entered and exited by hand, see start_watch


def _ours_on_top() -> bool:
    """Whether the innermost saved-tensor hooks are this module's."""
    top = top_saved_tensors_default_hooks(True)
    return top is not None and top[0] is _pack


def watch_possible() -> bool:
    """Whether a watch can start now: saved-tensor hooks are enabled and the innermost ones, if any,
    are ours (another pair — ``torch.utils.checkpoint``, ``save_on_cpu`` — would be hidden by ours,
    and it decides what the backward reads: no watch then)."""
    if not saved_tensors_hooks_is_enabled():
        return False
    return top_saved_tensors_default_hooks(True) is None or _ours_on_top()


def start_watch(ranges: Sequence[tuple[int, int]]) -> SavedTensorWatch:
    """Start watching the tensors autograd saves for overlaps with ``ranges`` (call
    :func:`watch_possible` first). The hooks are pushed by the first active watch."""
    watch = SavedTensorWatch(ranges)
    if not _ours_on_top():
        _HOOKS.__enter__()
    _ACTIVE.append(watch)
    return watch


def stop_watch(watch: SavedTensorWatch) -> None:
    """End ``watch`` (no-op if it already ended); the hooks go with the last active watch. Hooks
    pushed above ours and never popped (a forward that raised) keep ours below them, passing
    tensors through unchanged, until :func:`stop_all_watches`."""
    if watch in _ACTIVE:
        _ACTIVE.remove(watch)
    if not _ACTIVE and _ours_on_top():
        _HOOKS.__exit__(None, None, None)


def stop_all_watches() -> list[SavedTensorWatch]:
    """End every active watch (a forward that raised left them open); returns them."""
    stopped = list(_ACTIVE)
    _ACTIVE.clear()
    while _ours_on_top():
        _HOOKS.__exit__(None, None, None)
    return stopped


@dataclass
class BackwardNeeds:
    """What the forwards of one unit since its last backward ended say about that backward.

    Attributes:
        watched: a forward of the unit ran under a watch.
        reads_params: some forward saved a tensor overlapping the unsharded buffers, or ran where it
            could not be watched (under other saved-tensor hooks, with activation recomputation).
    """

    watched: bool = False
    reads_params: bool = False

    def record(self, watch: SavedTensorWatch | None) -> None:
        """One forward's verdict: its ended watch, or None where it could not be watched."""
        if watch is None:
            self.reads_params = True
        else:
            self.watched = True
            self.reads_params |= watch.found

    def elidable(self) -> bool:
        """Whether the backward may run without the unit's unsharded parameters."""
        return self.watched and not self.reads_params

    def reset(self) -> None:
        """The unit's backward ended: the next forward starts a new record."""
        self.watched = False
        self.reads_params = False
