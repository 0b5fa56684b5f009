"""Flat runs: the parameters of one optimizer group that can be stepped as one contiguous tensor.

A flashfsdp unit's sharded parameters are DTensors whose local tensors (this rank's dim-0 chunks)
are views into its flat group's master shard (``FlatParam.sharded_flat``, see
``runtime/flat_param.py``) and, after a reduction, their ``.grad`` fields are DTensors over views
into the flat gradient shard laid out the same way. The chunks of parameters ``i`` and ``i + 1`` of
one flat group are separated by padding only, so a *run* of consecutive parameters can be stepped
as the single slice ``sharded_flat[start_i : end_j]`` (the padding is stepped too: its gradient is
zero, so its values and state stay zero, and nobody reads it).

This module finds the runs from the local tensors themselves (storage, offsets, strides), so
nothing is assumed that was not checked: a parameter joins a run only if its local tensor is
contiguous, it is a flashfsdp parameter (``runtime/param_tags.py``), its index follows the previous
one's, and its gradient lies at the same distance from it as the previous gradient does (one flat
gradient buffer). Each run also needs its members to be in the same state "age" (steps taken),
given by the optimizer.

State tensors are views into one flat buffer per master shard and state key (:class:`FlatStates`),
so that a run's state is one slice too, while ``state_dict()`` still holds one tensor per parameter
— a DTensor of the parameter's placements, as torch's optimizers keep over FSDP2's parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from flashfsdp.runtime.sharding_spec import local_of
from flashfsdp.runtime.param_tags import tag_of

def _index(p: torch.Tensor) -> int:
    return tag_of(p).index


@dataclass
class Run:
    """Consecutive pieces of one master shard, stepped as one tensor.

    Attributes:
        params: the pieces, in storage order (at least one).
        flat: the slice of the master shard from the first piece's start to the last one's end.
        lo: ``flat``'s storage offset (elements), where its state slices start.
        shift: the gradients' storage offset minus the pieces' (the same for every piece).
    """

    params: list[torch.Tensor] = field(default_factory=list)
    flat: torch.Tensor | None = None
    lo: int = 0
    shift: int = 0

    def grad(self) -> torch.Tensor:
        """The run's range of the flat gradient shard, built from the gradients the parameters hold
        now (not kept: a gradient shard freed by ``zero_grad`` must not stay alive in a plan)."""
        g = local_of(self.params[0].grad)
        return g.new_empty(0).set_(g.untyped_storage(), self.lo + self.shift, self.flat.shape, (1,))


def signature(params: Sequence[torch.Tensor]) -> tuple:
    """What a plan of ``params`` depends on: where each local tensor and its gradient's are (-1: no
    gradient)."""
    return tuple((local_of(p).data_ptr(), -1 if p.grad is None else local_of(p.grad).data_ptr()) for p in params)


def _storage_key(t: torch.Tensor) -> tuple:
    storage = t.untyped_storage()
    return (storage.data_ptr(), storage.nbytes(), t.dtype, t.device)


def is_flat_candidate(p: torch.Tensor) -> bool:
    """Whether ``p`` (with a gradient) may join a run: a flashfsdp parameter (also one whose chunk
    is empty) whose local tensor is real floating point and contiguous, with a dense contiguous
    gradient chunk of its own dtype, device and size.

    Raises:
        RuntimeError: a parameter's gradient chunk has another number of elements than its own (a
            ``.grad`` replaced by a tensor of the wrong shape), naming the parameter.
    """
    tag = tag_of(p)
    if tag is None:
        return False
    local, g = local_of(p), local_of(p.grad)
    if g.numel() != local.numel():
        raise RuntimeError(
            f"flashfsdp.optim: the gradient of {tag.fqn} has "
            f"{g.numel()} local elements but the parameter's chunk has {local.numel()}; a .grad assigned by hand "
            f"must have the parameter's shape {tuple(p.shape)} and placements")
    return (local.is_floating_point() and not local.is_complex() and local.is_contiguous() and not g.is_sparse
            and g.is_contiguous() and g.dtype == local.dtype and g.device == local.device)


def _joins(run: Run, p: torch.Tensor, age: Callable[[torch.Tensor], object]) -> bool:
    last = run.params[-1]
    a, b = local_of(p), local_of(last)
    ga, gb = local_of(p.grad), local_of(last.grad)
    return (_storage_key(a) == _storage_key(b)
            and _index(p) == _index(last) + 1
            and a.storage_offset() >= b.storage_offset() + b.numel()
            and _storage_key(ga) == _storage_key(gb)
            and ga.storage_offset() - a.storage_offset() == gb.storage_offset() - b.storage_offset()
            and age(p) == age(last))


def _close(run: Run) -> Run:
    first, last = local_of(run.params[0]), local_of(run.params[-1])
    lo, hi = first.storage_offset(), last.storage_offset() + last.numel()
    run.flat = first.new_empty(0).set_(first.untyped_storage(), lo, (hi - lo,), (1,))
    run.lo, run.shift = lo, local_of(run.params[0].grad).storage_offset() - lo
    return run


def plan_runs(params: Sequence[torch.Tensor], age: Callable[[torch.Tensor], object]
              ) -> tuple[list[Run], list[torch.Tensor]]:
    """Split the parameters of one optimizer group that have a gradient into runs and the rest.

    Args:
        params: parameters with a ``.grad`` (any kind), in the group's order.
        age: a parameter's state age (e.g. Adam's step count); only equal ages share a run.

    Returns:
        ``(runs, rest)``: the runs, and the parameters to step one by one (not flashfsdp
        parameters, sparse, complex or non-contiguous ones).
    """
    candidates, rest = [], []
    for p in params:
        (candidates if is_flat_candidate(p) else rest).append(p)
    # Empty chunks (parameters this rank holds no rows of) sit at their neighbours' offsets: they
    # join runs (torch steps them too, their step counts must advance) in parameter order.
    candidates.sort(key=lambda p: (_storage_key(local_of(p))[0], local_of(p).storage_offset(), _index(p)))
    runs: list[Run] = []
    for p in candidates:
        if runs and _joins(runs[-1], p, age):
            runs[-1].params.append(p)
        else:
            runs.append(Run([p]))
    return [_close(r) for r in runs], rest


class FlatStates:
    """Optimizer state tensors of parameters as views into one flat buffer per master shard and key.

    A buffer spans the whole storage of the master shard (S elements, zeros when created), so a
    parameter's state is (a DTensor of its placements over) ``buffer[local.storage_offset() : ...
    + numel]`` and a run's is one slice.
    Step counters (Adam's ``step``) are 0-d views into one vector per shard indexed by parameter
    index, so a run's counters are one slice too and advance with one operation.
    Buffers of a shard no optimizer group steps any more are dropped at the next :meth:`retain`.
    """

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}

    def buffer(self, p: torch.Tensor, key: str) -> torch.Tensor:
        """The flat ``key`` buffer of ``p``'s master shard (allocated with zeros on first use)."""
        local = local_of(p)
        skey = _storage_key(local) + (key,)
        buf = self._buffers.get(skey)
        if buf is None:
            numel = local.untyped_storage().nbytes() // local.element_size()
            buf = self._buffers[skey] = torch.zeros(numel, dtype=local.dtype, device=local.device)
        return buf

    def view(self, p: torch.Tensor, key: str) -> torch.Tensor:
        """``p``'s slice of its ``key`` buffer, shaped like its local tensor (plain)."""
        local = local_of(p)
        o = local.storage_offset()
        return self.buffer(p, key)[o : o + local.numel()].view_as(local)

    def run_view(self, run: Run, key: str) -> torch.Tensor:
        """The run's slice of the ``key`` buffer (same range as ``run.flat``)."""
        return self.buffer(run.params[0], key)[run.lo : run.lo + run.flat.numel()]

    def adopt(self, p: torch.Tensor, state: dict, key: str) -> None:
        """Make ``state[key]`` (a tensor like ``p``, or absent: zeros) ``p``'s view — a DTensor of
        ``p``'s placements over it where ``p`` is one —, copying values over if it is another tensor
        (a state dict loaded from elsewhere)."""
        view = self.view(p, key)
        value = state.get(key)
        if value is None:
            view.zero_()
        else:
            local = local_of(value)
            if (local.data_ptr() != view.data_ptr()
                    or local.untyped_storage().data_ptr() != view.untyped_storage().data_ptr()):
                view.copy_(local.reshape(view.shape))
        tag = tag_of(p)
        state[key] = tag.group.wrap_local(view, tag.index)

    def reserve_steps(self, runs: Sequence[Run], device_of, dtype: torch.dtype) -> None:
        """Make every shard's step-counter vector long enough for ``runs`` (before any
        :meth:`step_view`: a vector that grows is replaced, and views into the old one are copied
        over by :meth:`adopt_step`). ``device_of(param)`` gives where a piece's counter lives."""
        need: dict[tuple, int] = {}
        for run in runs:
            key = _storage_key(local_of(run.params[0])) + ("step", device_of(run.params[0]), dtype)
            need[key] = max(need.get(key, 0), _index(run.params[-1]) + 1)
        for key, n in need.items():
            buf = self._buffers.get(key)
            if buf is None or buf.numel() < n:
                self._buffers[key] = torch.zeros(n, dtype=dtype, device=key[5])

    def run_steps(self, run: Run, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        """The step counters of the run's parameters: one each, consecutive (their indices are),
        0-d views of which are the parameters' ``state["step"]``."""
        buf = self._buffers[_storage_key(local_of(run.params[0])) + ("step", device, dtype)]
        first = _index(run.params[0])
        return buf[first : first + len(run.params)]

    def adopt_step(self, p: torch.Tensor, state: dict, counter: torch.Tensor) -> None:
        """Make ``state["step"]`` the 0-d tensor ``counter``, with the value it held (0 if none)."""
        value = state.get("step")
        if value is None:
            counter.zero_()
        elif value.data_ptr() != counter.data_ptr() or value.device != counter.device:
            counter.copy_(value)
        state["step"] = counter

    def retain(self, runs: Sequence[Run]) -> None:
        """Drop the buffers of shards that none of ``runs`` uses (after a re-home or re-wrap)."""
        live = {_storage_key(local_of(r.params[0])) for r in runs}
        self._buffers = {k: v for k, v in self._buffers.items() if k[:4] in live}
