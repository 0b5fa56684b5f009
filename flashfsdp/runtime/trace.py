"""Per-unit, per-step traces of the schedule: what ran when, on which stream, and exposed communication.

``with flashfsdp.profile() as prof:`` records, for every unit and step, spans for copy-in,
all-gather, forward, backward, pack, reduce-scatter and accumulate, each on its stream ("compute",
"all_gather", "reduce_scatter"), plus **wait** spans: time the compute stream spent waiting on
communication (the *exposed* communication). Timing source:

- CPU: wall clock (``time.perf_counter``). A collective runs on gloo's thread; its span runs from
  issue to the moment its ``wait()`` returned, and the wait span is the time blocked inside
  ``wait()``.
- CUDA: events recorded on the spans' streams, resolved once at the end (one synchronisation, after
  the profiled region). A wait span is measured on the compute stream between events recorded just
  before and just after ``wait_event``: the stall the compute stream saw.

Every span is also a ``torch.profiler.record_function("flashfsdp::<kind>::<unit>")`` so it shows in
torch.profiler traces. ``Profile.export_chrome_trace(path)`` writes Chrome/Perfetto JSON;
``Profile.summary()`` gives exposed and total communication per unit and in total.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

COMM_KINDS = ("all_gather", "reduce_scatter")
_active: "Profile | None" = None


@dataclass
class Span:
    """One recorded interval. Times in microseconds from the profile's start once resolved."""

    kind: str
    unit: str
    stream: str
    step: int
    start: object
    end: object = None

    def duration_us(self) -> float:
        return float(self.end) - float(self.start)


@dataclass
class Profile:
    """Spans recorded while active; see the module docstring."""

    device_type: str = "cpu"
    spans: list[Span] = field(default_factory=list)
    step: int = 0
    _t0: float = field(default_factory=time.perf_counter)
    _t0_event: object = None
    _resolved: bool = False

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
        self.spans.append(Span(kind, unit, stream, self.step, start, end))

    def next_step(self) -> None:
        """Mark the start of a new training step (the root's forward calls it)."""
        self.step += 1

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
        """Totals in milliseconds: communication, exposed communication, compute; per unit too.

        Returns ``{"steps", "comm_ms", "exposed_ms", "compute_ms", "units": {unit: {...}}}`` where
        ``comm_ms`` sums all-gather and reduce-scatter spans, ``exposed_ms`` the compute stream's
        waits on them, ``compute_ms`` forward and backward spans (each unit's own time).
        """
        self.resolve()
        units: dict[str, dict[str, float]] = {}
        for s in self.spans:
            u = units.setdefault(s.unit, {"comm_ms": 0.0, "exposed_ms": 0.0, "compute_ms": 0.0})
            ms = s.duration_us() / 1e3
            if s.kind in COMM_KINDS:
                u["comm_ms"] += ms
            elif s.kind.startswith("wait_"):
                u["exposed_ms"] += ms
        for s, ms in self._exclusive_compute_ms():
            units[s.unit]["compute_ms"] += ms
        total = {k: sum(u[k] for u in units.values()) for k in ("comm_ms", "exposed_ms", "compute_ms")}
        return {"steps": self.step, **total, "units": units}

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
        """Write the spans as Chrome/Perfetto trace JSON (one track per stream)."""
        self.resolve()
        tids = {"compute": 0, "all_gather": 1, "reduce_scatter": 2}
        events = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": f"{name} stream"}}
            for name, tid in tids.items()
        ]
        for s in self.spans:
            events.append({
                "name": f"{s.kind}::{s.unit}", "cat": s.kind, "ph": "X", "pid": 0,
                "tid": tids.get(s.stream, 3), "ts": s.start, "dur": max(s.duration_us(), 0.0),
                "args": {"step": s.step, "unit": s.unit},
            })
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)


def active() -> Profile | None:
    """The profile being recorded, or None (the runtime's hot paths check this and do nothing)."""
    return _active


@contextlib.contextmanager
def profile(device_type: str | None = None) -> Iterator[Profile]:
    """Record flashfsdp spans inside the block; yields the :class:`Profile`.

    Args:
        device_type: "cuda" to time with CUDA events, "cpu" for wall clock; default: "cuda" when
            CUDA is available, else "cpu".

    Raises:
        RuntimeError: if a profile is already active (profiles do not nest).
    """
    global _active
    if _active is not None:
        raise RuntimeError("flashfsdp.profile(): a profile is already active; profiles do not nest")
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    prof = Profile(device_type=device_type)
    _active = prof
    try:
        yield prof
    finally:
        _active = None
        prof.resolve()


@contextlib.contextmanager
def span(kind: str, unit: str, stream: str = "compute", cuda_stream=None) -> Iterator[None]:
    """Record the block as a span of ``kind`` for ``unit`` when a profile is active."""
    prof = _active
    if prof is None:
        yield
        return
    with torch.profiler.record_function(f"flashfsdp::{kind}::{unit}"):
        start = prof.now(cuda_stream)
        yield
        prof.add(kind, unit, stream, start, prof.now(cuda_stream))
