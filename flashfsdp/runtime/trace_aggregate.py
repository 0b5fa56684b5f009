"""``flashfsdp.profile(aggregate=True)``: a profile for a whole run, in constant memory.

A plain :class:`~flashfsdp.runtime.trace_profile.Profile` keeps every span (about 250 bytes each
on CPU, ten spans per unit per step: 12 MiB per 1000 steps of a 49-unit model), which is what a
Chrome trace or the simulator's calibration needs, but grows without bound over a run. The
aggregating profile keeps only the spans of the step in progress: when the next step starts (the
root's forward), the finished step's spans are resolved (CPU: their completion times; CUDA: one
synchronisation), folded into running statistics and dropped. What it keeps is bounded by the
number of units and span kinds:

- the :meth:`~flashfsdp.runtime.trace_profile.Profile.summary` totals, summed step by step (the
  union of each stream's collectives is taken within a step; a collective that spans a step
  boundary counts in the step that issued it);
- per unit and span kind: count, total, min and max milliseconds (``summary()["units"][u]["spans"]``).

``export_chrome_trace`` writes the spans of the last step only; ``unit_compute_ms`` works as on
the plain profile (per-step means).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .trace import register_aggregating_profile
from .trace_profile import Profile
from .trace_spans import summarize, unit_compute_ms, write_chrome_trace

_TOTALS = ("comm_ms", "exposed_ms", "compute_ms")


@dataclass
class AggregatingProfile(Profile):
    """A :class:`Profile` that folds each finished step into running statistics (see the module
    docstring). ``steps_folded``: the steps folded so far."""

    totals: dict = field(default_factory=lambda: {"comm_streams_ms": {}, "inexact_spans": 0, "units": {}})
    compute_by_unit: dict = field(default_factory=dict)  # unit -> {"forward": ms, "backward": ms}
    steps_folded: int = 0
    _last_step: list = field(default_factory=list)  # the last folded step's spans (for the trace)

    def next_step(self) -> None:
        """Fold the step that ended, then start the next one (see ``Profile.next_step``)."""
        super().next_step()
        self._fold()

    def _fold(self) -> None:
        """Resolve the spans recorded so far, add them to the running statistics, drop them."""
        spans, self.spans = self.spans, []
        if not spans:
            return
        self.resolve_spans(spans)
        part = summarize(spans, 1, {})
        for stream, ms in part["comm_streams_ms"].items():
            self.totals["comm_streams_ms"][stream] = self.totals["comm_streams_ms"].get(stream, 0.0) + ms
        self.totals["inexact_spans"] += part["inexact_spans"]
        for unit, values in part["units"].items():
            mine = self.totals["units"].setdefault(unit, {**dict.fromkeys(_TOTALS, 0.0), "spans": {}})
            for key in _TOTALS:
                mine[key] += values[key]
        for s in spans:
            _add_stat(self.totals["units"][s.unit]["spans"], s.kind, s.duration_us() / 1e3)
        for unit, kinds in unit_compute_ms(spans, 1).items():
            mine = self.compute_by_unit.setdefault(unit, {"forward": 0.0, "backward": 0.0})
            for kind, ms in kinds.items():
                mine[kind] += ms
        self.steps_folded += 1
        self._last_step = spans

    def resolve(self) -> None:
        """Fold what is left (the profile's end)."""
        self._fold()
        self._resolved = True

    def summary(self) -> dict:
        """As ``Profile.summary``, over every folded step; each unit also has ``spans``:
        ``{kind: {"count", "total_ms", "min_ms", "max_ms", "mean_ms"}}``."""
        self._fold()
        units = {u: {**{k: v[k] for k in _TOTALS},
                     "spans": {kind: {**stat, "mean_ms": stat["total_ms"] / stat["count"]}
                               for kind, stat in v["spans"].items()}}
                 for u, v in self.totals["units"].items()}
        counters: dict[str, int] = {}
        for (name, _), amount in self.counters.items():
            counters[name] = counters.get(name, 0) + amount
        streams = dict(self.totals["comm_streams_ms"])
        return {"steps": self.step, "comm_ms": sum(streams.values()), "comm_streams_ms": streams,
                "exposed_ms": sum(u["exposed_ms"] for u in units.values()),
                "compute_ms": sum(u["compute_ms"] for u in units.values()),
                "inexact_spans": self.totals["inexact_spans"], "units": units, "counters": counters,
                "counters_per_step": {k: v / max(1, self.step) for k, v in counters.items()}}

    def unit_compute_ms(self) -> dict[str, dict[str, float]]:
        """Mean forward and backward milliseconds per unit per step (as ``Profile.unit_compute_ms``)."""
        self._fold()
        steps = max(1, self.step)
        return {u: {k: v / steps for k, v in kinds.items()} for u, kinds in self.compute_by_unit.items()}

    def export_chrome_trace(self, path: str) -> None:
        """The spans of the last folded step as a Chrome/Perfetto trace (earlier steps are not kept)."""
        self._fold()
        write_chrome_trace(self._last_step, self.device_type, path)


def _add_stat(stats: dict, kind: str, ms: float) -> None:
    """Count one span of ``kind`` lasting ``ms`` into ``stats``."""
    stat = stats.get(kind)
    if stat is None:
        stats[kind] = {"count": 1, "total_ms": ms, "min_ms": ms, "max_ms": ms}
        return
    stat["count"] += 1
    stat["total_ms"] += ms
    stat["min_ms"], stat["max_ms"] = min(stat["min_ms"], ms), max(stat["max_ms"], ms)


register_aggregating_profile(AggregatingProfile)
