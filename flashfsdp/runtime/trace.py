"""Per-unit, per-step traces of the schedule: what ran when, on which stream, and exposed communication.

``with flashfsdp.profile() as prof:`` records, for every unit and step, spans for copy-in,
all-gather, forward, backward, pack, reduce-scatter and accumulate, each on its stream ("compute",
"all_gather", "reduce_scatter"), plus **wait** spans (kinds ``wait_all_gather``,
``wait_reduce_scatter``) on the compute stream: time the compute stream spent waiting on
communication, the *exposed* communication.

This module holds what the runtime calls while it runs (:func:`span`, :func:`issuing`,
:func:`waiting`, :func:`count`, :func:`labelled`) and the profile being recorded
(:func:`profile`, :func:`active`). The profile itself, its timestamps and their accuracy on CPU
and CUDA: ``trace_profile``; the spans and what they add up to (``Profile.summary()``: exposed
and total communication per unit and in total; ``Profile.export_chrome_trace(path)``:
Chrome/Perfetto JSON): ``trace_spans``; ``profile(aggregate=True)``, in constant memory over a
whole run: ``trace_aggregate``.

torch.profiler: every phase is labelled ``record_function("flashfsdp::<kind>::<unit>")`` whenever
a torch profiler is running, with or without ``flashfsdp.profile()``: ``copy_in``,
``all_gather`` (issuing it), ``wait_all_gather``, ``pack``, ``reduce_scatter`` (issuing it),
``wait_reduce_scatter``, ``accumulate``, and the module hooks through :func:`labelled`
(``pre_forward``, ``post_forward``, ``pre_backward``, ``post_backward``). With no profiler running
a label costs one check of ``torch._C._autograd._profiler_enabled()``.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch

from flashfsdp._torch_private import profiler_enabled

from . import flight
from .trace_profile import Profile

_active: "Profile | None" = None
_NO_LABEL = contextlib.nullcontext()


# ------------------------------------------------------------------------------ torch.profiler labels
def torch_profiler_enabled() -> bool:
    """Whether a torch profiler (``torch.profiler.profile`` or the autograd profiler) is running."""
    return profiler_enabled()


def label(kind: str, unit: str) -> contextlib.AbstractContextManager:
    """``record_function("flashfsdp::<kind>::<unit>")`` while a torch profiler runs, else a shared
    no-op context (one C call: nothing is formatted or allocated)."""
    if not torch_profiler_enabled():
        return _NO_LABEL
    return torch.profiler.record_function(f"flashfsdp::{kind}::{unit}")


def _unit_name_of(owner) -> str:
    return owner.unit.name


def labelled(kind: str, unit_name: Callable[[object], str] = _unit_name_of) -> Callable:
    """Decorator for a method: label each call ``flashfsdp::<kind>::<unit>`` in torch.profiler.

    Args:
        kind: the phase, e.g. ``"pre_forward"``.
        unit_name: the unit's name from the method's ``self``; default ``self.unit.name`` (an
            object holding a ``ShardedUnit`` as ``.unit``, such as the bindings' ``FSDPState``).

    With no torch profiler running the method is called directly after one check. Either way the
    flight recorder is told which hook runs (``flight.enter_hook``: the phase and step of the
    collectives the hook issues).
    """

    def decorate(method: Callable) -> Callable:
        @functools.wraps(method)
        def wrapper(self, *args, **kwargs):
            saved = flight.enter_hook(kind, self, unit_name(self))
            try:
                if not torch_profiler_enabled():  # no name to format
                    return method(self, *args, **kwargs)
                with label(kind, unit_name(self)):
                    return method(self, *args, **kwargs)
            finally:
                flight.exit_hook(saved)

        return wrapper

    return decorate


def bucket_name(names: Sequence[str]) -> str:
    """The name under which the collectives several units share (a bucket, ``bucket.py``) are
    traced and recorded: the first and last unit's names and their number (``"a .. c (3 units)"``);
    one unit's own name."""
    return f"{names[0]} .. {names[-1]} ({len(names)} units)" if len(names) > 1 else names[0]


# ------------------------------------------------------------------------------ the active profile
def active() -> Profile | None:
    """The profile being recorded, or None (the runtime's hot paths check this and do nothing)."""
    return _active


# The aggregating profile (``trace_aggregate.AggregatingProfile``, a subclass of Profile) registers
# itself here when its module is imported: this module does not import it back.
_AGGREGATING: "type[Profile] | None" = None


def register_aggregating_profile(cls: "type[Profile]") -> None:
    """Make ``cls`` the profile ``profile(aggregate=True)`` records into (called once, by
    ``trace_aggregate``)."""
    global _AGGREGATING
    _AGGREGATING = cls


@contextlib.contextmanager
def profile(device_type: str | None = None, aggregate: bool = False) -> Iterator[Profile]:
    """Record flashfsdp spans inside the block; yields the :class:`Profile`.

    Args:
        device_type: "cuda" to time with CUDA events, "cpu" for wall clock; default: "cuda" when
            CUDA is available, else "cpu".
        aggregate: keep running per-unit statistics instead of every span, in constant memory,
            for a profile held open over a whole run (``trace_aggregate.AggregatingProfile``).

    Raises:
        RuntimeError: if a profile is already active (profiles do not nest).
        ValueError: if ``device_type`` is neither "cpu" nor "cuda".
    """
    global _active
    if _active is not None:
        raise RuntimeError("flashfsdp.profile(): a profile is already active; profiles do not nest")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"flashfsdp.profile(): device_type must be 'cpu' or 'cuda', got {device_type!r}")
    if aggregate and _AGGREGATING is None:
        raise RuntimeError("flashfsdp.profile(aggregate=True): flashfsdp.runtime.trace_aggregate is not imported "
                           "(import flashfsdp, which registers it)")
    prof = (_AGGREGATING if aggregate else Profile)(device_type=device_type)
    _active = prof
    try:
        yield prof
    finally:
        _active = None
        prof.resolve()


def count(name: str, unit: str, amount: int) -> None:
    """Add ``amount`` to the active profile's counter ``name`` for ``unit`` (no profile: nothing)."""
    if _active is not None:
        _active.count(name, unit, amount)


@contextlib.contextmanager
def span(kind: str, unit: str, stream: str = "compute", cuda_stream=None) -> Iterator[None]:
    """Label the block ``flashfsdp::<kind>::<unit>`` for torch.profiler (when one runs) and record
    it as a span of ``kind`` for ``unit`` on ``stream`` (when a flashfsdp profile is active)."""
    prof = _active
    with label(kind, unit):
        if prof is None:
            yield
            return
        start = prof.now(cuda_stream)
        yield
        prof.add(kind, unit, stream, start, prof.now(cuda_stream))


@dataclass
class Issued:
    """When a collective was issued, for the profile that records it (None fields: no profile).

    ``issued``: :meth:`Profile.now` just before the collective was issued; ``issued_end``: on CUDA,
    :meth:`Profile.now` on its stream right after it was enqueued (its completion there).
    """

    kind: str
    unit: str
    cuda_stream: object = None
    issued: object = None
    issued_end: object = None

    def track(self, work):
        """Let the profile time ``work``'s completion (CPU: its done-callback) and name the unit in
        ``work``'s errors (``Work.set_unit``); returns ``work``."""
        name_unit = getattr(work, "set_unit", None)  # a Communicator's own Work may lack it
        if name_unit is not None:
            name_unit(self.unit)
        if self.issued is not None and self.cuda_stream is None:
            work.track_completion()
        return work


@contextlib.contextmanager
def issuing(kind: str, unit: str, cuda_stream=None) -> Iterator[Issued]:
    """Around issuing one unit's collectives of ``kind`` ("all_gather", "reduce_scatter"): labels the
    block for torch.profiler and, when a profile is active, notes when they were issued. Pass each
    Work through ``record.track(...)``; later wait inside :func:`waiting` with the same record.
    ``cuda_stream``: the collective's stream (None on CPU)."""
    prof = _active
    record = Issued(kind, unit, cuda_stream)
    with label(kind, unit):
        if prof is not None:
            record.issued = prof.now(cuda_stream)
        yield record
        if prof is not None and cuda_stream is not None:
            record.issued_end = prof.now(cuda_stream)


@contextlib.contextmanager
def waiting(record: Issued | None, works: Sequence, cuda_stream=None, wait_span: bool = True) -> Iterator[None]:
    """Around waiting for the collectives ``record`` issued: labels the block ``wait_<kind>`` and,
    when a profile is active, records the collectives and the wait (see :meth:`Profile.add_collective`;
    ``cuda_stream``: the stream the wait is timed on, None for the current one)."""
    prof = _active
    if record is None:
        yield
        return
    with label(f"wait_{record.kind}", record.unit):
        timed = prof is not None and bool(works) and record.issued is not None
        if timed:
            waited = prof.now(cuda_stream)
            completed_before = all(w.is_completed() for w in works)
        yield
        if timed:
            prof.add_collective(record.kind, record.unit, works, record.issued, record.issued_end, waited,
                                prof.now(cuda_stream), completed_before, wait_span=wait_span)
