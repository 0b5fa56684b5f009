"""Flat runs: consecutive parameters of one flat group stepped as one contiguous tensor, and
optimizer states kept in flat buffers laid out like the shard.

A unit's sharded parameters have local tensors (this rank's chunks) that are views into its flat
group's master shard (``FlatParam.sharded_flat``, ``flat_param.py``) and, after a reduction,
``.grad`` fields over views into the gradient shard laid out the same way (``grad_shard.py``).
The chunks of parameters ``i`` and ``i + 1`` of one flat group are separated by padding only, so a
*run* of consecutive parameters can be stepped by an element-wise optimizer as the single slice
``sharded_flat[start_i : end_j]``, its gradient the same range of the gradient shard. The padding
is stepped too: its gradient, value and state are zero, and an update whose zero input gives zero
keeps them so (``padding=False`` keeps padding out of runs for an update that does not, e.g.
Adamax's ``max(|g| + eps)``).

:func:`plan_runs` finds the runs from the local tensors themselves (storage, offsets, strides), so
nothing is assumed that was not checked: a parameter joins a run only if its local tensor is
contiguous, it is a flashfsdp parameter (``param_tags.py``), its index follows the previous
one's, its gradient lies at the same distance from it as the previous gradient does (one flat
gradient buffer), and it has the same state "age" (steps taken, state keys) as the previous one.

[Note: CPU vector tails]
torch's element-wise CPU kernels run a vectorised body and a scalar tail (the last ``numel mod
V`` elements, V the SIMD width), and the fused optimizer kernels (``_fused_adam(w)_``,
``_fused_sgd_``) compute the two differently where the compiler contracts into FMA: stepping a
longer tensor moves an element from a parameter's tail into the body and can change its last
bit. (torch 2.13 on AVX2 and AVX512 CPUs, checked element by element: fused Adam/AdamW/SGD differ;
the single-tensor and foreach paths of every element-wise optimizer do not.) ``vector_bytes``
splits a run after every parameter whose chunk is not a whole number of that many bytes: each
piece then starts where a parameter starts and every element but the last parameter's tail is
in the vectorised body, as when the parameter is stepped alone (the kernels' thread chunks are
whole cache lines of 64 bytes). :data:`CPU_VECTOR_BYTES` covers every SIMD width torch's CPU
``Vectorized`` has (16-byte NEON to 256-byte SVE).

:class:`FlatStates` keeps state tensors as views into flat buffers laid out like the master shard,
so that a run's state is one slice, and 0-d states (a step count) as 0-d views into vectors with
one slot per parameter, so that a run's counters are one slice too; ``optimizer.state`` still
holds one tensor per parameter (a DTensor of its placements over its view, as torch's optimizers
keep over FSDP2's parameters).

[Note: state segments]
A state buffer costs what the optimizer's own parameters need, not its unit's shard: the
parameters an optimizer holds (:meth:`FlatStates.cover`) are cut, per master shard, into
*segments* of consecutive indices, and a buffer (per segment, key and dtype) spans one segment's
range of the shard: its chunks and the padding between them. An optimizer per parameter (stepped
in a post-accumulate-grad hook) thus keeps state for its parameter only; one over every parameter
has one segment per unit (a run, of consecutive indices, lies in one segment). A buffer is made
when a state is first taken in: a run that spans its segment gives the state torch made for it as
the buffer itself (no copy, so the first step costs no more than FSDP2's); otherwise zeros, the
states copied in. When the segments change (a param group added), new buffers are made and each
parameter's state is copied into its new view when next gathered (:meth:`FlatStates.is_view` no
longer holds for the old one).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from .param_tags import tag_of
from .sharding_spec import local_of

# The widest SIMD vector of torch's CPU kernels, in bytes (see [Note: CPU vector tails]).
CPU_VECTOR_BYTES = 256


def _index(p: torch.Tensor) -> int:
    return tag_of(p).index


def _wrap(p: torch.Tensor, view: torch.Tensor) -> torch.Tensor:
    """``view`` (of ``p``'s local shape) as ``p``'s state: a DTensor of its placements where it is one."""
    tag = tag_of(p)
    return tag.group.wrap_local(view, tag.index)


@dataclass
class Run:
    """Consecutive parameters of one master shard, stepped as one tensor.

    Attributes:
        params: the sharded parameters, in index order (at least one).
        flat: the slice of the master shard from the first one's chunk start to the last one's
            chunk end (1-D, the shard's dtype and device).
        lo: ``flat``'s storage offset (elements), where its state slices start.
        shift: the gradients' storage offset minus the chunks' (the same for every parameter).
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

    @property
    def first(self) -> int:
        """The index of the run's first parameter in its flat group."""
        return _index(self.params[0])


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
            f"flashfsdp: the gradient of {tag.fqn} has "
            f"{g.numel()} local elements but the parameter's chunk has {local.numel()}; a .grad assigned by hand "
            f"must have the parameter's shape {tuple(p.shape)} and placements")
    return (local.is_floating_point() and not local.is_complex() and local.is_contiguous() and not g.is_sparse
            and g.is_contiguous() and g.dtype == local.dtype and g.device == local.device)


def _joins(run: Run, p: torch.Tensor, age: Callable[[torch.Tensor], object], padding: bool,
           vector_bytes: int | None) -> bool:
    last = run.params[-1]
    a, b = local_of(p), local_of(last)
    ga, gb = local_of(p.grad), local_of(last.grad)
    end = b.storage_offset() + b.numel()
    return (_storage_key(a) == _storage_key(b)
            and _index(p) == _index(last) + 1
            and (a.storage_offset() == end if not padding else a.storage_offset() >= end)
            and (vector_bytes is None or b.numel() * b.element_size() % vector_bytes == 0)
            and _storage_key(ga) == _storage_key(gb)
            and ga.storage_offset() - a.storage_offset() == gb.storage_offset() - b.storage_offset()
            and age(p) == age(last))


def _close(run: Run) -> Run:
    first, last = local_of(run.params[0]), local_of(run.params[-1])
    lo, hi = first.storage_offset(), last.storage_offset() + last.numel()
    run.flat = first.new_empty(0).set_(first.untyped_storage(), lo, (hi - lo,), (1,))
    run.lo, run.shift = lo, local_of(run.params[0].grad).storage_offset() - lo
    return run


def plan_runs(params: Sequence[torch.Tensor], age: Callable[[torch.Tensor], object], *, padding: bool = True,
              vector_bytes: int | None = None) -> tuple[list[Run], list[torch.Tensor]]:
    """Split the parameters of one optimizer group that have a gradient into runs and the rest.

    Args:
        params: parameters with a ``.grad`` (any kind), in the group's order.
        age: a parameter's state age (e.g. Adam's step count); only equal ages share a run.
        padding: whether a run may hold the padding between two chunks (False: only chunks that
            end where the next one starts join).
        vector_bytes: None, or split a run after each parameter whose chunk is not a multiple of
            this many bytes (see [Note: CPU vector tails]).

    Returns:
        ``(runs, rest)``: the runs (in storage order), and the parameters to step one by one (not
        flashfsdp parameters, sparse, complex or non-contiguous ones).

    Raises:
        ValueError: ``vector_bytes`` is not None nor a positive int.
        RuntimeError: a gradient chunk of another size than its parameter's (:func:`is_flat_candidate`).
    """
    if vector_bytes is not None and (not isinstance(vector_bytes, int) or vector_bytes <= 0):
        raise ValueError(f"plan_runs: vector_bytes must be None or a positive int, got {vector_bytes!r}")
    candidates, rest = [], []
    for p in params:
        (candidates if is_flat_candidate(p) else rest).append(p)
    # Empty chunks (parameters this rank holds no rows of) sit at their neighbours' offsets: they
    # join runs (torch steps them too, their step counts must advance) in parameter order.
    candidates.sort(key=lambda p: (_storage_key(local_of(p))[0], local_of(p).storage_offset(), _index(p)))
    runs: list[Run] = []
    for p in candidates:
        if runs and _joins(runs[-1], p, age, padding, vector_bytes):
            runs[-1].params.append(p)
        else:
            runs.append(Run([p]))
    return [_close(r) for r in runs], rest


@dataclass(frozen=True)
class Segment:
    """Parameters of consecutive indices in one master shard whose states share flat buffers (see
    [Note: state segments]).

    Attributes:
        lo, hi: the range of the shard (elements) its buffers span, from the first chunk's start
            to the last chunk's end.
        first, stop: the parameters' indices in their flat group, ``[first, stop)``.
    """

    lo: int
    hi: int
    first: int
    stop: int


def _cut(locals_: dict[int, torch.Tensor]) -> dict[int, Segment]:
    """The segments of one shard's covered local tensors (by index): runs of consecutive indices,
    taken in :func:`plan_runs`'s order."""
    pieces: list[list[tuple[int, torch.Tensor]]] = []
    for index, local in sorted(locals_.items(), key=lambda item: (item[1].storage_offset(), item[0])):
        if pieces and index == pieces[-1][-1][0] + 1:
            pieces[-1].append((index, local))
        else:
            pieces.append([(index, local)])
    out = {}
    for members in pieces:
        segment = Segment(members[0][1].storage_offset(), max(t.storage_offset() + t.numel() for _, t in members),
                          members[0][0], members[-1][0] + 1)
        out.update((i, segment) for i, _ in members)
    return out


class FlatStates:
    """Optimizer states of sharded parameters as views into flat buffers (see the module docstring).

    The parameters are first covered (:meth:`cover`): cut into segments ([Note: state segments]).
    A state buffer spans one segment (its chunks and the padding between them; zeros when made),
    so a parameter's state is ``buffer[o - lo : o - lo + numel]`` (o its chunk's offset, lo the
    segment's) and a run's one slice; its padding stays zero. A slot vector holds one 0-d state
    per parameter of a segment, so a run's 0-d states are one slice.
    """

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._segments: dict[tuple, dict[int, Segment]] = {}  # shard's storage key -> index -> segment

    def cover(self, params: Sequence[torch.Tensor]) -> bool:
        """Cut the parameters among ``params`` that may join runs (flashfsdp parameters whose local
        tensor is real floating point and contiguous; others are left out) into segments,
        replacing the last cover; buffers of segments that are gone are dropped (a state still
        viewing one keeps it alive until gathered).

        Returns:
            Whether the segments changed.
        """
        by_storage: dict[tuple, dict[int, torch.Tensor]] = {}
        for p in params:
            tag = tag_of(p)
            local = None if tag is None else local_of(p)
            if local is not None and local.is_floating_point() and not local.is_complex() and local.is_contiguous():
                by_storage.setdefault(_storage_key(local), {})[tag.index] = local
        segments = {skey: _cut(locals_) for skey, locals_ in by_storage.items()}
        if segments == self._segments:
            return False
        self._segments = segments
        live = {(skey, segment) for skey, of in segments.items() for segment in of.values()}
        self._buffers = {k: v for k, v in self._buffers.items() if k[:2] in live}
        return True

    def segment_of(self, p: torch.Tensor) -> Segment | None:
        """``p``'s segment in the last cover (None: not covered)."""
        tag = tag_of(p)
        of = None if tag is None else self._segments.get(_storage_key(local_of(p)))
        return None if of is None else of.get(tag.index)

    def _segment(self, p: torch.Tensor) -> tuple[tuple, Segment]:
        skey = _storage_key(local_of(p))
        segment = self._segments.get(skey, {}).get(_index(p))
        if segment is None:
            raise ValueError(f"FlatStates: {tag_of(p).fqn} is not among the parameters covered (cover() first)")
        return skey, segment

    def _buffer(self, p: torch.Tensor, key: str, dtype: torch.dtype | None) -> tuple[torch.Tensor, Segment]:
        """The ``key`` buffer of ``p``'s segment in ``dtype`` (default: the shard's), allocated with
        zeros on first use, and the segment."""
        local = local_of(p)
        skey, segment = self._segment(p)
        bkey = (skey, segment, key, dtype or local.dtype)
        buf = self._buffers.get(bkey)
        if buf is None:
            buf = self._buffers[bkey] = torch.zeros(segment.hi - segment.lo, dtype=bkey[3], device=local.device)
        return buf, segment

    def view(self, p: torch.Tensor, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``p``'s slice of its ``key`` buffer, shaped like its local tensor (plain)."""
        local = local_of(p)
        buf, segment = self._buffer(p, key, dtype)
        o = local.storage_offset() - segment.lo
        return buf[o : o + local.numel()].view(local.shape)

    def run_view(self, run: Run, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The run's slice of the ``key`` buffer (the range of ``run.flat``).

        Raises:
            ValueError: the run reaches out of its first parameter's segment.
        """
        buf, segment = self._buffer(run.params[0], key, dtype)
        if run.lo < segment.lo or run.lo + run.flat.numel() > segment.hi:
            raise ValueError(f"FlatStates.run_view: the run [{run.lo}, {run.lo + run.flat.numel()}) reaches out of "
                             f"its segment [{segment.lo}, {segment.hi})")
        return buf[run.lo - segment.lo : run.lo - segment.lo + run.flat.numel()]

    def is_view(self, p: torch.Tensor, key: str, value: torch.Tensor) -> bool:
        """Whether ``value`` (a tensor, or a DTensor over one) is ``p``'s view of its ``key`` buffer
        of ``value``'s dtype: the same storage, offset, size and shape."""
        local, mine = local_of(value), local_of(p)
        skey = _storage_key(mine)
        segment = self._segments.get(skey, {}).get(_index(p))
        buf = None if segment is None else self._buffers.get((skey, segment, key, local.dtype))
        return (buf is not None and local.device == buf.device and local.shape == mine.shape
                and local.is_contiguous()
                and local.untyped_storage().data_ptr() == buf.untyped_storage().data_ptr()
                and local.storage_offset() == buf.storage_offset() + mine.storage_offset() - segment.lo)

    def take(self, p: torch.Tensor, key: str, value: torch.Tensor) -> torch.Tensor:
        """``p``'s view of the ``key`` buffer of ``value``'s dtype, holding ``value`` (a tensor of
        ``p``'s local shape, or a DTensor over one): copied in unless it is that view already
        (:meth:`is_view`).

        Raises:
            ValueError: ``value``'s local tensor has another number of elements than ``p``'s chunk.
        """
        local = local_of(value)
        view = self.view(p, key, local.dtype)
        if local.numel() != view.numel():
            raise ValueError(f"FlatStates.take: state {key!r} has {local.numel()} local elements, the parameter's "
                             f"chunk {view.numel()}")
        if not self.is_view(p, key, value):
            view.copy_(local.reshape(view.shape))
        return view

    def adopt(self, p: torch.Tensor, state: dict, key: str) -> None:
        """Make ``state[key]`` (a tensor like ``p``, or absent: zeros) ``p``'s view — a DTensor of
        ``p``'s placements over it where ``p`` is one —, copying values over if it is another tensor
        (a state dict loaded from elsewhere)."""
        value = state.get(key)
        if value is None:
            view = self.view(p, key)
            view.zero_()
        else:
            view = self.take(p, key, value)
        state[key] = _wrap(p, view)

    def _slot_vector(self, p: torch.Tensor, key: str, dtype: torch.dtype,
                     device: torch.device) -> tuple[torch.Tensor, Segment]:
        skey, segment = self._segment(p)
        vkey = (skey, segment, key, dtype, torch.device(device), "slots")
        vec = self._buffers.get(vkey)
        if vec is None:
            vec = self._buffers[vkey] = torch.zeros(segment.stop - segment.first, dtype=dtype, device=device)
        return vec, segment

    def slot(self, p: torch.Tensor, key: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``p``'s 0-d ``key`` state slot (a view into its segment's slot vector, zeros when made)."""
        vec, segment = self._slot_vector(p, key, dtype, device)
        return vec[_index(p) - segment.first]

    def run_slots(self, run: Run, key: str, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The ``key`` slots of the run's parameters: one each, consecutive (their indices are)."""
        vec, segment = self._slot_vector(run.params[0], key, dtype, device)
        first = run.first - segment.first
        return vec[first : first + len(run.params)]

    def adopt_slot(self, p: torch.Tensor, state: dict, key: str, dtype: torch.dtype, device: torch.device) -> None:
        """Make ``state[key]`` ``p``'s 0-d slot, holding the value ``state[key]`` held (0 if none)."""
        slot = self.slot(p, key, dtype, device)
        value = state.get(key)
        if value is None:
            slot.zero_()
        elif not isinstance(value, torch.Tensor) or value.data_ptr() != slot.data_ptr() or value.device != slot.device:
            slot.copy_(value)
        state[key] = slot

    def gather(self, run: Run, states: Sequence[dict]) -> tuple[dict, list[torch.Tensor]]:
        """The state one step of ``run`` as one tensor takes, made from its parameters' states.

        Args:
            run: the run.
            states: the optimizer's state dict of each of its parameters (all with the same keys,
                in the same order as ``run.params``); each is pointed at its views here: per state
                tensor of the parameter's shape, a DTensor of its placements over its view of the
                buffer (the values copied in where it held another tensor: loaded, assigned, or
                made by a step that did not take this run); per 0-d tensor, its slot (value
                copied in likewise).

        Returns:
            ``(state, slots)``: per key the run's slice of the buffer, the first parameter's 0-d
            slot, or the first parameter's value (not a tensor); and for each 0-d key the run's
            slots (a step advances the first: copy it into the others after it).
        """
        mine, slots = {}, []
        for key, value in (states[0] if states else {}).items():
            if not isinstance(value, torch.Tensor):
                mine[key] = value
            elif value.dim() > 0:
                for p, state in zip(run.params, states):
                    if not self.is_view(p, key, state[key]):
                        state[key] = _wrap(p, self.take(p, key, state[key]))
                mine[key] = self.run_view(run, key, local_of(value).dtype)
            else:
                vector = self.run_slots(run, key, value.dtype, value.device)
                for state, slot in zip(states, vector):
                    if state[key].data_ptr() != slot.data_ptr() or state[key].device != slot.device:
                        slot.copy_(state[key])
                        state[key] = slot
                mine[key] = states[0][key]
                slots.append(vector)
        return mine, slots

    def scatter(self, run: Run, key: str, value: object, states: Sequence[dict]) -> tuple[object, torch.Tensor | None]:
        """Take ``value``, the ``key`` state a step of ``run`` as one tensor made (or replaced), into
        the buffers and point the parameters' states (``states``, one per parameter) at it.

        Returns:
            ``(kept, slots)``: what the run's state holds from now on (the run's slice of the
            buffer, holding ``value``'s values; the first parameter's slot; ``value`` itself if
            not a tensor), and the run's slots for a 0-d ``value`` (else None), whose first a
            step advances.

        Raises:
            ValueError: ``value`` is a tensor neither 0-d nor of ``run.flat``'s shape.
        """
        if not isinstance(value, torch.Tensor):
            for state in states:
                state[key] = value
            return value, None
        if value.dim() == 0:
            vector = self.run_slots(run, key, value.dtype, value.device)
            vector.copy_(value)
            for state, slot in zip(states, vector):
                state[key] = slot
            return states[0][key], vector
        if value.shape != run.flat.shape:
            raise ValueError(f"FlatStates.scatter: state {key!r} has shape {tuple(value.shape)}, the run "
                             f"{tuple(run.flat.shape)}")
        view = value if self._adopt_buffer(run, key, value) else self.run_view(run, key, value.dtype)
        if view.data_ptr() != value.data_ptr() or view.device != value.device:
            view.copy_(value)
        for p, state in zip(run.params, states):
            state[key] = _wrap(p, self.view(p, key, value.dtype))
        return view, None

    def _adopt_buffer(self, run: Run, key: str, value: torch.Tensor) -> bool:
        """Make ``value`` (a state a step of ``run`` made, of its shape) the run's ``key`` buffer
        itself, where none exists yet and the run spans its segment, and ``value`` is a plain
        tensor of its own storage (not the parameters' nor the gradients'): its padding holds
        what a copy would (see [Note: state segments])."""
        skey, segment = self._segment(run.params[0])
        if ((skey, segment, key, value.dtype) in self._buffers or run.lo != segment.lo
                or run.lo + run.flat.numel() != segment.hi or type(value) is not torch.Tensor or value.requires_grad
                or value.device != run.flat.device or not value.is_contiguous() or value.storage_offset() != 0
                or value.untyped_storage().nbytes() != value.numel() * value.element_size()):
            return False
        taken = {run.flat.untyped_storage().data_ptr()}
        grad = run.params[0].grad
        if grad is not None:
            taken.add(local_of(grad).untyped_storage().data_ptr())
        if value.untyped_storage().data_ptr() in taken:
            return False
        self._buffers[(skey, segment, key, value.dtype)] = value
        return True

    def nbytes(self) -> int:
        """The bytes of every buffer and slot vector held."""
        return sum(t.numel() * t.element_size() for t in self._buffers.values())
