"""From measurements to the simulator's inputs: a trace (``flashfsdp.profile()``) to per-unit
compute and a :class:`~flashfsdp.sim.model.Model`, probes to a host contention.

On a CPU host everything but the collectives runs on the one Python thread, so a unit's own compute
is its span minus its nested units' spans and minus the host-side spans (waits, copy-ins, packs,
accumulates, :data:`HOST_KINDS`) inside it; its pack and accumulate are then added to its backward,
since they are compute the simulator has no other place for. The root's forward before its first
block and its backward after its last one give ``root_forward_before`` / ``root_backward_after``;
the time between the root's forward and backward is the loss.

The trace's communication busy time is counted as the simulator counts it
(:func:`flashfsdp.runtime.intervals.union_length` per collective kind), so that measured and
predicted figures compare.
"""

from __future__ import annotations

import statistics
from typing import Sequence

from flashfsdp.runtime.intervals import union_length

from .contention import Contention, fit_contention
from .engine import Span
from .model import Model, model_from_measurements

HOST_KINDS = ("wait_all_gather", "wait_reduce_scatter", "copy_in", "pack", "accumulate")
COLLECTIVES = ("all_gather", "reduce_scatter")

__all__ = ["HOST_KINDS", "comm_busy_ms", "copy_bandwidth", "fit_probe_contention", "inputs_from_profile",
           "median_inputs", "model_from_inputs", "timeline_of_profile"]


def _inside(span, outer) -> bool:
    return outer.start <= span.start and span.end <= outer.end


def _own_ms(span, children, host) -> float:
    """``span`` minus its child units' spans and the host-side spans between them (ms)."""
    inner = [c for c in children if _inside(c, span)]
    gaps = [h for h in host if _inside(h, span) and not any(_inside(h, c) for c in inner)]
    return (span.duration_us() - sum(c.duration_us() for c in inner) - sum(h.duration_us() for h in gaps)) / 1e3


def _between_ms(start: float, end: float, host) -> float:
    """Microsecond interval [start, end] minus the host-side spans inside it, in ms."""
    return max(0.0, (end - start) - sum(h.duration_us() for h in host if start <= h.start and h.end <= end)) / 1e3


def _host_ms(host, unit: str, kind: str) -> float:
    return sum(h.duration_us() for h in host if h.unit == unit and h.kind == kind) / 1e3


def comm_busy_ms(spans) -> float:
    """Per collective kind, the union of the collectives' spans (µs in, ms out); summed over kinds."""
    return sum(union_length((s.start, s.end) for s in spans if s.kind == kind) for kind in COLLECTIVES) / 1e3


def _step_inputs(spans, copy_bytes: dict[str, int], accumulate_scale: float, root: str) -> dict | None:
    """The inputs of one traced step (see :func:`inputs_from_profile`); None without the root."""
    host = [s for s in spans if s.kind in HOST_KINDS]
    fwd = {s.unit: s for s in spans if s.kind == "forward"}
    bwd = {s.unit: s for s in spans if s.kind == "backward"}
    if root not in fwd or root not in bwd:
        return None
    blocks = [u for u in fwd if u != root]
    units = {}
    for u in fwd:
        children = [fwd[b] for b in blocks] if u == root else []
        bchildren = [bwd[b] for b in blocks] if u == root else []
        pack, accumulate = _host_ms(host, u, "pack"), _host_ms(host, u, "accumulate")
        units[u] = {"forward_ms": _own_ms(fwd[u], children, host),
                    "backward_ms": _own_ms(bwd[u], bchildren, host) + pack + accumulate_scale * accumulate}
    first = min((fwd[b] for b in blocks), key=lambda s: s.start, default=None)
    last = max((bwd[b] for b in blocks), key=lambda s: s.end, default=None)
    r = units[root]
    before = _between_ms(fwd[root].start, first.start, host) if first else 0.0
    after = _between_ms(last.end, bwd[root].end, host) if last else 0.0
    copy = [h for h in host if h.kind == "copy_in"]
    return {
        "units": units,
        "root_forward_before": min(1.0, before / r["forward_ms"]) if r["forward_ms"] > 0 else 0.0,
        "root_backward_after": min(1.0, after / r["backward_ms"]) if r["backward_ms"] > 0 else 0.0,
        "loss_ms": _between_ms(fwd[root].end, bwd[root].start, host),
        "copy_in_ms": sum(h.duration_us() for h in copy) / 1e3,
        "copy_in_bytes": sum(copy_bytes.get(h.unit, 0) for h in copy),
        "exposed_ms": sum(s.duration_us() for s in spans if s.kind.startswith("wait_")) / 1e3,
        "comm_busy_ms": comm_busy_ms([s for s in spans if s.kind in COLLECTIVES]),
    }


def inputs_from_profile(prof, copy_bytes: dict[str, int], accumulate_scale: float = 1.0,
                        root: str = "<root>") -> list[dict]:
    """The simulator's compute inputs from a CPU trace, one dict per traced step.

    Each is ``{"units": {name: {"forward_ms", "backward_ms"}}, "root_forward_before",
    "root_backward_after", "loss_ms", "copy_in_ms", "copy_in_bytes", "exposed_ms",
    "comm_busy_ms"}`` (see the module docstring); steps whose root has no forward and backward span
    are left out.

    Args:
        prof: a ``flashfsdp.runtime.trace_profile.Profile`` (resolved here).
        copy_bytes: bytes one copy-in moves, by unit name (for ``copy_in_bytes``).
        accumulate_scale: factor on the traced accumulate time (a twin at W = 1 accumulates W
            times the shard: ``1 / W``).
        root: the root unit's name.
    """
    prof.resolve()
    out = []
    for step in sorted({s.step for s in prof.spans}):
        inputs = _step_inputs([s for s in prof.spans if s.step == step], copy_bytes, accumulate_scale, root)
        if inputs is not None:
            out.append(inputs)
    return out


def median_inputs(steps: Sequence[dict]) -> dict:
    """The median, field by field and unit by unit, of :func:`inputs_from_profile`'s steps."""
    med = statistics.median
    units = {u: {k: med([s["units"][u][k] for s in steps]) for k in ("forward_ms", "backward_ms")}
             for u in steps[0]["units"]}
    scalars = {k: med([s[k] for s in steps]) for k in steps[0] if k != "units"}
    return {"units": units, **scalars}


def _block_order(names: list[str]) -> list[str]:
    """Blocks by the number their name ends with (``layers.10`` after ``layers.9``) where every name
    has one; otherwise as given."""
    suffixes = [n.rsplit(".", 1)[-1] for n in names]
    if all(s.isdigit() for s in suffixes):
        return [n for _, n in sorted(zip(map(int, suffixes), names))]
    return list(names)


def model_from_inputs(unit_meta: dict, inputs: dict, optimizer_ms: float, name: str,
                      root: str = "<root>") -> Model:
    """A :class:`Model` with the bytes of the runtime's units and the measured compute.

    Args:
        unit_meta: by unit name, ``{"numel", "param_bytes", "reduce_bytes"}``.
        inputs: one of :func:`inputs_from_profile`'s dicts (or their :func:`median_inputs`).
        optimizer_ms: the optimizer step's time.
        name: the model's name.
        root: the root unit's name.
    """
    ordered = [root] + _block_order([u for u in inputs["units"] if u != root])
    units = {n: {"numel": unit_meta[n]["numel"], "param_bytes": unit_meta[n]["param_bytes"],
                 "reduce_bytes": unit_meta[n]["reduce_bytes"], **inputs["units"][n]} for n in ordered}
    return model_from_measurements(
        units, root=root, root_forward_before=inputs["root_forward_before"],
        root_backward_after=inputs["root_backward_after"], loss_s=inputs["loss_ms"] / 1e3,
        optimizer_s=optimizer_ms / 1e3, name=name)


def copy_bandwidth(inputs: dict) -> float | None:
    """The copy-in's bytes per second in ``inputs`` (None when the trace has no copy-in time)."""
    return inputs["copy_in_bytes"] / (inputs["copy_in_ms"] / 1e3) if inputs["copy_in_ms"] > 0 else None


def fit_probe_contention(probes: Sequence[dict], name: str = "host") -> Contention | None:
    """One :class:`Contention` from contention probes of several ranks, their samples pooled.

    Args:
        probes: per rank, ``{"all_gather": samples, "reduce_scatter": samples}`` with the samples
            of :func:`~flashfsdp.sim.contention.fit_contention`.
        name: the contention's name.

    Returns:
        the fit, or None when a kind has no sample (nothing was measurable).
    """
    ag = [s for p in probes for s in p["all_gather"]]
    rs = [s for p in probes for s in p["reduce_scatter"]]
    if not ag or not rs:
        return None
    return fit_contention(ag, rs, name=name)


def timeline_of_profile(prof) -> list[Span]:
    """A trace's spans as the simulator's timeline (seconds; collectives on one "comm" stream)."""
    return [Span("compute" if s.kind not in COLLECTIVES else "comm", s.kind, s.unit,
                 float(s.start) / 1e6, float(s.end) / 1e6) for s in prof.spans]
