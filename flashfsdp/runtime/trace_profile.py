"""The :class:`Profile` a ``flashfsdp.profile()`` block records into: timestamps and the spans
they make, turned into times once the profiled region has run.

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

The reports (:meth:`Profile.summary`, :meth:`Profile.unit_compute_ms`,
:meth:`Profile.export_chrome_trace`) are ``trace_spans``' functions over the resolved spans.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from .trace_spans import Span, summarize, unit_compute_ms, write_chrome_trace


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
        self.resolve_spans(self.spans)
        self._resolved = True

    def resolve_spans(self, spans: list[Span]) -> None:
        """Turn ``spans``' timestamps into microseconds from this profile's start (CUDA: after one
        synchronisation)."""
        if self.device_type == "cuda":
            torch.cuda.synchronize()
            base = self._t0_event
            for s in spans:
                s.start, s.end = base.elapsed_time(s.start) * 1e3, base.elapsed_time(s.end) * 1e3
            return
        for s in spans:
            if hasattr(s.end, "seconds"):
                s.end, s.exact = s.end.seconds()
            s.start, s.end = (s.start - self._t0) * 1e6, (s.end - self._t0) * 1e6

    # ---------------------------------------------------------------- reports
    def summary(self) -> dict:
        """Totals over the profiled steps in milliseconds; per unit too (``trace_spans.summarize``:
        ``comm_ms``, ``comm_streams_ms``, ``exposed_ms``, ``compute_ms``, ``inexact_spans``,
        ``units``, ``counters``, ``counters_per_step``)."""
        self.resolve()
        return summarize(self.spans, self.step, self.counters)

    def unit_compute_ms(self) -> dict[str, dict[str, float]]:
        """Mean forward and backward milliseconds per unit per step, each unit's own time (nested
        units subtracted): the input the overlap simulator replays."""
        self.resolve()
        return unit_compute_ms(self.spans, self.step)

    def export_chrome_trace(self, path: str) -> None:
        """Write the spans as Chrome/Perfetto trace JSON (``trace_spans.write_chrome_trace``)."""
        self.resolve()
        write_chrome_trace(self.spans, self.device_type, path)
