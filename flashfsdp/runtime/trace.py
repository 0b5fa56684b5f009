"""Per-unit, per-step traces of the schedule: what ran when, on which stream, and exposed communication.

``with flashfsdp.profile() as prof:`` records, for every unit and step, spans for copy-in,
all-gather, forward, backward, pack, reduce-scatter and accumulate, each on its stream ("compute",
"all_gather", "reduce_scatter"), plus **wait** spans (kinds ``wait_all_gather``,
``wait_reduce_scatter``) on the compute stream: time the compute stream spent waiting on
communication, the *exposed* communication.

Timing source and accuracy:

- **CPU**: wall clock (``time.perf_counter``, one monotonic clock shared by every thread). A
  collective runs on gloo's worker thread. Its span runs from the moment it was issued to the
  moment it *completed*, stamped by a done-callback on the gloo work handle's future
  (``Work.track_completion``; see ``flashfsdp.runtime.process_group``): it does not include the
  compute that ran between its completion and the consumer's ``wait()``. The stamp can be late by
  the time gloo's thread needs to take the GIL (microseconds while the compute thread is inside a
  torch op or a wait, which release it; at most about ``sys.getswitchinterval()`` = 5 ms while it
  runs pure Python). The span starts at issue, so a collective queued behind another one on the
  same stream counts its queueing time: that is why :meth:`Profile.summary` counts the *union* of
  a stream's spans. A collective that completes inside the issuing call (``LocalCommunicator`` at
  W = 1) ends when that call returns. A Work that cannot report its completion (a third-party
  ``Communicator``, or one still without a completion time when the next step starts) gets an
  upper bound, marked ``exact=False``: the start of its wait if it had already completed then,
  else the end of the wait. The profile reads each completion as soon as it is known and keeps no
  Work handle past the next step, so it holds no tensor however long it stays open. A wait span
  runs from the call to ``wait()`` to the collective's completion (the thread's wake-up after the
  completion is not counted), so every wait lies inside the communication it waited for.
- **CUDA**: events recorded on the spans' streams, resolved once at the end (one synchronisation,
  after the profiled region). A collective's span ends at an event recorded on its stream right
  after it was enqueued there: exact for ``NcclCommunicator``, which enqueues NCCL on that
  stream. (``ProcessGroupCommunicator`` on NCCL runs the collective on torch's internal NCCL
  stream, so there the span covers the enqueue only.) A wait span is measured on the compute
  stream between events recorded just before and just after ``wait_event``: the stall the compute
  stream saw.

Definitions in :meth:`Profile.summary`: *communication* = the busy time of each communication
stream (the union of its collectives' spans, so queued collectives are not counted twice), summed
over the all-gather and reduce-scatter streams; *exposed communication* = the total of the wait
spans. Hence exposed <= communication, and exposed <= the profiled wall time.

torch.profiler: every phase is labelled ``record_function("flashfsdp::<kind>::<unit>")`` whenever
a torch profiler is running, with or without ``flashfsdp.profile()``: ``copy_in``,
``all_gather`` (issuing it), ``wait_all_gather``, ``pack``, ``reduce_scatter`` (issuing it),
``wait_reduce_scatter``, ``accumulate``, and the module hooks through :func:`labelled`
(``pre_forward``, ``post_forward``, ``pre_backward``, ``post_backward``). With no profiler running
a label costs one check of ``torch._C._autograd._profiler_enabled()``.

``Profile.export_chrome_trace(path)`` writes Chrome/Perfetto JSON; ``Profile.summary()`` gives
exposed and total communication per unit and in total.
"""

from __future__ import annotations

import contextlib
import functools
import json
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from flashfsdp._torch_private import profiler_enabled

from . import flight
from .intervals import union_shares

COMM_KINDS = ("all_gather", "reduce_scatter")
STREAMS = ("compute", "all_gather", "reduce_scatter")
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


# ------------------------------------------------------------------------------ spans
@dataclass(slots=True)
class Span:
    """One recorded interval. Times in microseconds from the profile's start once resolved.

    ``exact`` is False when ``end`` is only an upper bound (a CPU collective whose Work could not
    report its completion; see the module docstring).
    """

    kind: str
    unit: str
    stream: str
    step: int
    start: object
    end: object = None
    exact: bool = True

    def duration_us(self) -> float:
        return float(self.end) - float(self.start)


class _CpuCompletion:
    """The end of a CPU collective, settled from its Work handles as soon as they tell it.

    ``works`` completed when the last of them did; without a completion time from every one, the
    end is bounded: ``waited`` if they had all completed before the wait started, else ``done``.
    [Note: bounded profiles] :meth:`settle` turns the handles into that one time and lets them go,
    so a profile held open over a whole run keeps no Work (nor anything a Work holds).
    """

    __slots__ = ("works", "waited", "done", "completed_before", "_settled")

    def __init__(self, works: Sequence, waited: float, done: float, completed_before: bool):
        self.works, self.waited, self.done, self.completed_before = list(works), waited, done, completed_before
        self._settled: tuple[float, bool] | None = None

    def settle(self, final: bool) -> bool:
        """Read the completion from the Works and drop them; without a time from every Work, only
        when ``final`` (then the bound). Returns whether it is settled."""
        if self._settled is None:
            times = [w.completion_time() for w in self.works]
            if times and all(t is not None for t in times):
                self._settled = (max(times), True)
            elif final:
                self._settled = ((self.waited if self.completed_before else self.done), False)
            else:
                return False
            self.works = []
        return True

    def seconds(self) -> tuple[float, bool]:
        """(perf_counter seconds, exact)."""
        self.settle(final=True)
        return self._settled


class _WaitEnd:
    """The end of a CPU wait: the collective's completion, clamped into [waited, done]."""

    __slots__ = ("completion",)

    def __init__(self, completion: _CpuCompletion):
        self.completion = completion

    def seconds(self) -> tuple[float, bool]:
        t, exact = self.completion.seconds()
        c = self.completion
        return min(c.done, max(c.waited, t)), exact


@dataclass
class Profile:
    """Spans recorded while active; see the module docstring."""

    device_type: str = "cpu"
    spans: list[Span] = field(default_factory=list)
    step: int = 0
    _t0: float = field(default_factory=time.perf_counter)
    _t0_event: object = None
    _resolved: bool = False
    _unsettled: list = field(default_factory=list)  # CPU completions still holding their Works
    counters: dict = field(default_factory=dict)  # (name, unit) -> total, see count()

    # ---------------------------------------------------------------- recording
    def now(self, stream: "torch.cuda.Stream | None" = None):
        """A timestamp: perf_counter seconds on CPU, a recorded CUDA event on GPU."""
        if self.device_type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record(stream)
            if self._t0_event is None:
                self._t0_event = event
            return event
        return time.perf_counter()

    def add(self, kind: str, unit: str, stream: str, start, end) -> None:
        """Append a span of ``kind`` for ``unit`` on ``stream`` (timestamps from :meth:`now`)."""
        self.spans.append(Span(kind, unit, stream, self.step, start, end))

    def add_collective(self, kind: str, unit: str, works: Sequence, issued, issued_end, waited, done,
                       completed_before: bool, wait_span: bool = True) -> None:
        """Record a collective and the wait on it.

        Args:
            kind: ``"all_gather"`` or ``"reduce_scatter"`` (also the span's stream).
            unit: the unit's name.
            works: the collective's Work handles (CPU: their completion times end the span; they
                must have had ``track_completion()`` called right after issue).
            issued: :meth:`now` just before the collective was issued.
            issued_end: CUDA: :meth:`now` on the collective's stream right after it was enqueued
                (its completion on that stream); CPU: ignored.
            waited, done: :meth:`now` just before and just after the wait.
            completed_before: whether every Work had completed when the wait started (the bound
                used when a Work reports no completion time).
            wait_span: record ``wait_<kind>`` on the compute stream (False where the compute
                stream did not wait: a CUDA reduce-scatter finished on its own stream).
        """
        if self.device_type == "cuda":
            self.add(kind, unit, kind, issued, issued_end)
            if wait_span:
                self.add(f"wait_{kind}", unit, "compute", waited, done)
            return
        completion = _CpuCompletion(works, waited, done, completed_before)
        if not completion.settle(final=False):  # gloo's callback has stamped it: settled at once
            self._unsettled.append(completion)
        if wait_span:
            self.add(f"wait_{kind}", unit, "compute", waited, _WaitEnd(completion))
        self.add(kind, unit, kind, issued, completion)

    def count(self, name: str, unit: str, amount: int) -> None:
        """Add ``amount`` to the counter ``name`` of ``unit`` (e.g. bytes all-gathered)."""
        key = (name, unit)
        self.counters[key] = self.counters.get(key, 0) + amount

    def next_step(self) -> None:
        """Mark the start of a new training step (the root's forward calls it). Collectives of
        the steps before whose Works still report no completion time are bounded now and let go
        ([Note: bounded profiles])."""
        self.step += 1
        for completion in self._unsettled:
            completion.settle(final=True)
        self._unsettled.clear()

    def resolve(self) -> None:
        """Turn every timestamp into microseconds from the start (synchronises CUDA once)."""
        if self._resolved:
            return
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            base = self._t0_event
            for s in self.spans:
                s.start = base.elapsed_time(s.start) * 1e3
                s.end = base.elapsed_time(s.end) * 1e3
        else:
            for s in self.spans:
                if hasattr(s.end, "seconds"):
                    s.end, s.exact = s.end.seconds()
                s.start = (s.start - self._t0) * 1e6
                s.end = (s.end - self._t0) * 1e6
        self._resolved = True

    # ---------------------------------------------------------------- reports
    def _exclusive_compute_ms(self) -> list[tuple[Span, float]]:
        """Each forward/backward span with its own time: nested units' spans (a root's forward
        contains its blocks' forwards) are subtracted from the span that contains them."""
        compute = [s for s in self.spans if s.kind in ("forward", "backward")]
        out = []
        for s in compute:
            inner = [
                c for c in compute
                if c is not s and c.kind == s.kind and c.step == s.step
                and float(s.start) <= float(c.start) and float(c.end) <= float(s.end)
            ]
            # only directly nested spans: drop those inside another inner span
            direct = [c for c in inner if not any(o is not c and float(o.start) <= float(c.start)
                                                  and float(c.end) <= float(o.end) for o in inner)]
            out.append((s, (s.duration_us() - sum(c.duration_us() for c in direct)) / 1e3))
        return out

    def summary(self) -> dict:
        """Totals over the profiled steps in milliseconds; per unit too.

        Returns ``{"steps", "comm_ms", "comm_streams_ms", "exposed_ms", "compute_ms",
        "inexact_spans", "units": {unit: {"comm_ms", "exposed_ms", "compute_ms"}}}``:

        - ``comm_ms``: busy time of the communication streams, each stream's union of collective
          spans, summed over streams (``comm_streams_ms`` per stream). A unit's ``comm_ms`` is its
          share of that union (each span counts only the time after the same stream's earlier
          spans ended), so the units' values sum to the total.
        - ``exposed_ms``: the wait spans, time the compute stream waited on communication;
          ``exposed_ms <= comm_ms``.
        - ``compute_ms``: forward and backward spans, each unit's own time (nested units removed).
        - ``inexact_spans``: collective spans whose end is only an upper bound.
        - ``counters``: each counter's total over the profiled steps (:func:`count`: e.g.
          ``all_gather_bytes_forward``, ``all_gather_bytes_backward``,
          ``backward_all_gather_bytes_elided``), and ``counters_per_step``: the same / steps.
        """
        self.resolve()
        units: dict[str, dict[str, float]] = {}

        def unit(name: str) -> dict[str, float]:
            return units.setdefault(name, {"comm_ms": 0.0, "exposed_ms": 0.0, "compute_ms": 0.0})

        streams: dict[str, float] = {}
        for stream in dict.fromkeys(s.stream for s in self.spans if s.kind in COMM_KINDS):
            shares = union_shares([s for s in self.spans if s.kind in COMM_KINDS and s.stream == stream],
                                  lambda s: (float(s.start), float(s.end)))
            for s, us in shares:
                unit(s.unit)["comm_ms"] += us / 1e3
            streams[stream] = sum(us for _, us in shares) / 1e3
        for s in self.spans:
            u = unit(s.unit)
            if s.kind.startswith("wait_"):
                u["exposed_ms"] += s.duration_us() / 1e3
        for s, ms in self._exclusive_compute_ms():
            unit(s.unit)["compute_ms"] += ms
        total = {k: sum(u[k] for u in units.values()) for k in ("exposed_ms", "compute_ms")}
        inexact = sum(1 for s in self.spans if not s.exact and s.kind in COMM_KINDS)
        counters: dict[str, int] = {}
        for (name, _), amount in self.counters.items():
            counters[name] = counters.get(name, 0) + amount
        return {"steps": self.step, "comm_ms": sum(streams.values()), "comm_streams_ms": streams, **total,
                "inexact_spans": inexact, "units": units, "counters": counters,
                "counters_per_step": {k: v / max(1, self.step) for k, v in counters.items()}}

    def unit_compute_ms(self) -> dict[str, dict[str, float]]:
        """Mean forward and backward milliseconds per unit per step, each unit's own time (nested
        units subtracted): the input the overlap simulator replays."""
        self.resolve()
        out: dict[str, dict[str, list[float]]] = {}
        for s, ms in self._exclusive_compute_ms():
            out.setdefault(s.unit, {"forward": [], "backward": []})[s.kind].append(ms)
        steps = max(1, self.step)
        return {u: {k: sum(v) / steps for k, v in d.items()} for u, d in out.items()}

    def export_chrome_trace(self, path: str) -> None:
        """Write the spans as Chrome/Perfetto trace JSON: one track (``tid``) per stream, named
        "<stream> stream"; one complete event (``ph: "X"``) per span named ``<kind>::<unit>``,
        category ``<kind>``, times in µs, ``args`` = step, unit, stream, exact."""
        self.resolve()
        tids = {name: i for i, name in enumerate(STREAMS)}
        for s in self.spans:
            tids.setdefault(s.stream, len(tids))
        events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"flashfsdp ({self.device_type})"}}]
        events += [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": f"{name} stream"}}
            for name, tid in tids.items()
        ]
        for s in self.spans:
            events.append({
                "name": f"{s.kind}::{s.unit}", "cat": s.kind, "ph": "X", "pid": 0,
                "tid": tids[s.stream], "ts": s.start, "dur": max(s.duration_us(), 0.0),
                "args": {"step": s.step, "unit": s.unit, "stream": s.stream, "exact": s.exact},
            })
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


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
