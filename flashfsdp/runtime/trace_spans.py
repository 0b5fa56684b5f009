"""Recorded spans and what they add up to: the :class:`Span` record, the summary's totals and
per-unit figures, each unit's own compute time, and the Chrome/Perfetto trace.

Every function here reads *resolved* spans (times in microseconds from the profile's start; see
``trace_profile.Profile.resolve``); the profiles' ``summary``, ``unit_compute_ms`` and
``export_chrome_trace`` call them.

Definitions in :func:`summarize`: *communication* = the busy time of each communication stream
(the union of its collectives' spans, so queued collectives are not counted twice), summed over
the all-gather and reduce-scatter streams; *exposed communication* = the total of the wait
spans. Hence exposed <= communication, and exposed <= the profiled wall time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Mapping, Sequence

from .intervals import union_shares

COMM_KINDS = ("all_gather", "reduce_scatter")
STREAMS = ("compute", "all_gather", "reduce_scatter")


@dataclass(slots=True)
class Span:
    """One recorded interval. Times in microseconds from the profile's start once resolved.

    ``exact`` is False when ``end`` is only an upper bound (a CPU collective whose Work could not
    report its completion; see ``trace_profile``).
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


def exclusive_compute_ms(spans: Sequence[Span]) -> list[tuple[Span, float]]:
    """Each forward/backward span with its own time: nested units' spans (a root's forward
    contains its blocks' forwards) are subtracted from the span that contains them."""
    compute = [s for s in spans if s.kind in ("forward", "backward")]
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


def summarize(spans: Sequence[Span], steps: int, counters: Mapping[tuple[str, str], int]) -> dict:
    """Totals over ``steps`` profiled steps in milliseconds; per unit too.

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
    - ``counters``: each counter's total over the profiled steps (``counters``: (name, unit) ->
      amount, e.g. ``all_gather_bytes_forward``, ``all_gather_bytes_backward``,
      ``backward_all_gather_bytes_elided``), and ``counters_per_step``: the same / steps.
    """
    units: dict[str, dict[str, float]] = {}

    def unit(name: str) -> dict[str, float]:
        return units.setdefault(name, {"comm_ms": 0.0, "exposed_ms": 0.0, "compute_ms": 0.0})

    streams: dict[str, float] = {}
    for stream in dict.fromkeys(s.stream for s in spans if s.kind in COMM_KINDS):
        shares = union_shares([s for s in spans if s.kind in COMM_KINDS and s.stream == stream],
                              lambda s: (float(s.start), float(s.end)))
        for s, us in shares:
            unit(s.unit)["comm_ms"] += us / 1e3
        streams[stream] = sum(us for _, us in shares) / 1e3
    for s in spans:
        u = unit(s.unit)
        if s.kind.startswith("wait_"):
            u["exposed_ms"] += s.duration_us() / 1e3
    for s, ms in exclusive_compute_ms(spans):
        unit(s.unit)["compute_ms"] += ms
    total = {k: sum(u[k] for u in units.values()) for k in ("exposed_ms", "compute_ms")}
    inexact = sum(1 for s in spans if not s.exact and s.kind in COMM_KINDS)
    by_name: dict[str, int] = {}
    for (name, _), amount in counters.items():
        by_name[name] = by_name.get(name, 0) + amount
    return {"steps": steps, "comm_ms": sum(streams.values()), "comm_streams_ms": streams, **total,
            "inexact_spans": inexact, "units": units, "counters": by_name,
            "counters_per_step": {k: v / max(1, steps) for k, v in by_name.items()}}


def unit_compute_ms(spans: Sequence[Span], steps: int) -> dict[str, dict[str, float]]:
    """Mean forward and backward milliseconds per unit per step over ``steps`` steps, each unit's
    own time (nested units subtracted): the input the overlap simulator replays."""
    out: dict[str, dict[str, list[float]]] = {}
    for s, ms in exclusive_compute_ms(spans):
        out.setdefault(s.unit, {"forward": [], "backward": []})[s.kind].append(ms)
    steps = max(1, steps)
    return {u: {k: sum(v) / steps for k, v in d.items()} for u, d in out.items()}


def write_chrome_trace(spans: Sequence[Span], device_type: str, path: str) -> None:
    """Write ``spans`` as Chrome/Perfetto trace JSON: one track (``tid``) per stream, named
    "<stream> stream"; one complete event (``ph: "X"``) per span named ``<kind>::<unit>``,
    category ``<kind>``, times in µs, ``args`` = step, unit, stream, exact."""
    tids = {name: i for i, name in enumerate(STREAMS)}
    for s in spans:
        tids.setdefault(s.stream, len(tids))
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": f"flashfsdp ({device_type})"}}]
    events += [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": f"{name} stream"}}
        for name, tid in tids.items()
    ]
    for s in spans:
        events.append({
            "name": f"{s.kind}::{s.unit}", "cat": s.kind, "ph": "X", "pid": 0,
            "tid": tids[s.stream], "ts": s.start, "dur": max(s.duration_us(), 0.0),
            "args": {"step": s.step, "unit": s.unit, "stream": s.stream, "exact": s.exact},
        })
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
