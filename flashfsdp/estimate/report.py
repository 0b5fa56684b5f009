"""Text tables of an :class:`~flashfsdp.estimate.Estimate`: the per-rank breakdown and the units
that set its peak, the step's communication, and memory over world sizes beside DeepSpeed's ZeRO-3
formula (its states beside flashfsdp's, its total beside flashfsdp's, its assumptions stated)."""

from __future__ import annotations

import textwrap
from typing import Callable, Mapping, Sequence

from .deepspeed import ZERO3_ASSUMPTIONS, zero3_model_states
from .estimate import Estimate
from .units import UnitSpec

GIB = 2**30
_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(nbytes: float) -> str:
    """`nbytes` in the largest binary unit that keeps it at 1 or more, 3 significant digits:
    "512 B", "1.5 KiB", "820 MiB", "8.18 GiB"."""
    value, unit = float(nbytes), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    if unit == 0:
        return f"{int(value)} B"
    return f"{value:.0f} {_UNITS[unit]}" if abs(value) >= 100 else f"{value:.3g} {_UNITS[unit]}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns padded to their widest cell, the first left-aligned, the others right-aligned."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    def line(cells):
        return "  ".join(str(c).ljust(w) if i == 0 else str(c).rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))
    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def _row(label: str, nbytes: float) -> tuple[str, str, str]:
    return label, f"{int(nbytes):,}", human_bytes(nbytes)


def _params_peak_label(units: int) -> str:
    """The row of the unsharded parameters at their peak (all-gather outputs not yet copied out
    included)."""
    return f"unsharded parameters: {units} unit{'' if units == 1 else 's'} at the peak"


def memory_table(est: Estimate, members: Mapping[str, Sequence[str]] | None = None) -> str:
    """Per-rank memory: model states, then what the step allocates, then the total, and a line
    naming the units unsharded at the peak (the root's modules from ``members``, by unit name, as
    ``units.unit_members`` gives them) and the largest unit."""
    rows = [
        _row("master parameters (sharded)", est.master_bytes),
        _row("gradients (sharded)", est.grad_bytes),
        _row(f"optimizer state ({est.optimizer})", est.optimizer_bytes),
        _row(_params_peak_label(len(est.units_at_peak)), est.params_peak_bytes),
        _row("unsharded gradients (units not yet reduced)", est.unsharded_grad_bytes),
        _row("reduce-scatter pack + output buffers", est.reduce_buffer_bytes),
        _row("step peak on top of the states", est.transient_peak_bytes),
        _row("total per rank (no activations)", est.total_bytes),
    ]
    return _table(("per rank", "bytes", "size"), rows) + "\n" + peak_line(est, members)


def peak_line(est: Estimate, members: Mapping[str, Sequence[str]] | None = None) -> str:
    """Which units set the peak of the unsharded parameters, and the largest unit: "peak set by:
    <root> (tok_embeddings, norm, output: 1,050,677,248 params, 1.96 GiB unsharded); largest unit:
    <root>". The root's modules are named from ``members`` (a block's name says what it is)."""
    units = {u.name: u for u in est.units}
    at_peak = "; ".join(_describe_unit(units[name], members) for name in est.units_at_peak) or "none"
    return f"peak set by: {at_peak}; largest unit: {est.largest_unit.name}"


def _describe_unit(unit: UnitSpec, members: Mapping[str, Sequence[str]] | None) -> str:
    held = list((members or {}).get(unit.name, ())) if unit.name == "<root>" else []
    what = f"{', '.join(held)}: " if held else ""
    return f"{unit.name} ({what}{unit.numel:,} params, {human_bytes(unit.unsharded_bytes())} unsharded)"


def comm_table(est: Estimate) -> str:
    """Per-step communication of one rank, and DDP's all-reduce."""
    c = est.comm
    rows = [
        _row("all-gathered, forward", c.all_gather_forward),
        _row("all-gathered, backward", c.all_gather_backward),
        _row(f"reduce-scattered (over {est.shard_group_size} ranks)", c.reduce_scatter),
    ]
    if est.replicas > 1:
        rows.append(_row(f"all-reduced across {est.replicas} replicas", c.all_reduce))
    rows += [_row("sent per rank (ring)", c.sent), _row("DDP all-reduce of the gradients", c.ddp_all_reduce),
             _row("DDP sent per rank (ring)", c.ddp_sent)]
    table = _table(("per step", "bytes", "size"), rows) + f"\nsent / DDP's: {c.ratio_to_ddp:.2f}x"
    table += "\n" + collectives_line(est)
    return table if est.tp_comm is None else table + "\n\n" + tp_comm_table(est)


def collectives_line(est: Estimate) -> str:
    """How many collectives carry the step's bytes on one rank, and the bucket size: "collectives
    per step: 4 = 2 all-gathers (8 unit all-gathers), 2 reduce-scatters; buckets of up to 4 MiB"."""
    c = est.comm
    text = f"collectives per step: {c.collectives} = {_count(c.all_gathers, 'all-gather')}"
    if c.units_gathered != c.all_gathers:
        text += f" ({_count(c.units_gathered, 'unit all-gather')})"
    text += f", {_count(c.reduce_scatters, 'reduce-scatter')}"
    if c.all_reduces:
        text += f", {_count(c.all_reduces, 'all-reduce')}"
    buckets = f"buckets of up to {human_bytes(est.bucket_bytes)}" if est.bucket_bytes else "no buckets"
    return f"{text}; {buckets}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def tp_comm_table(est: Estimate) -> str:
    """Per-step TP communication of one rank (the activations of the TP plan, sequence parallel)."""
    t = est.tp_comm
    rows = [_row(f"TP all-gathered ({t.collectives} collectives over {t.tp} ranks, {t.tokens:,} tokens)",
                 t.all_gather),
            _row("TP reduce-scattered", t.reduce_scatter), _row("TP all-reduced (norm gradients)", t.all_reduce),
            _row("TP sent per rank (ring)", t.sent)]
    return _table(("per step, tensor parallel", "bytes", "size"), rows)


def world_size_table(estimate_at: Callable[[int], Estimate], world_sizes: Sequence[int],
                     deepspeed_params: tuple[int, int]) -> str:
    """Per-rank memory over world sizes: flashfsdp's model states, unsharded parameters at their
    peak and the units that hold it, step peak and total, and DeepSpeed's ZeRO-3 estimate
    without offload in the same two parts — its model states (18 bytes per parameter / W) beside
    flashfsdp's states, its GPU figure (+ 4 bytes per parameter of the largest layer) beside the
    total — then a line stating DeepSpeed's assumptions (``deepspeed.py``).

    Args:
        estimate_at: the estimate at a given world size.
        world_sizes: the W of each row.
        deepspeed_params: (total parameters, largest layer's) as DeepSpeed counts them.
    """
    rows = []
    for w in world_sizes:
        est = estimate_at(w)
        ds = zero3_model_states(*deepspeed_params, num_nodes=w)  # its GPU figure depends on W alone
        rows.append((str(w), human_bytes(est.model_state_bytes), human_bytes(est.params_peak_bytes),
                     _peak_units(est), human_bytes(est.transient_peak_bytes), human_bytes(est.total_bytes),
                     human_bytes(ds.state_bytes), human_bytes(ds.gpu_bytes)))
    header = ("W", "states", "unsharded", "peak set by", "step peak", "total", "DeepSpeed ZeRO-3 states",
              "DeepSpeed ZeRO-3 total")
    note = f"({ZERO3_ASSUMPTIONS}; its largest layer here: {deepspeed_params[1]:,} params)"
    return _table(header, rows) + "\n" + textwrap.fill(note, width=100)


def _peak_units(est: Estimate) -> str:
    """The units unsharded at the peak: "<root>", "<root>, layers.31", "<root> + 3 units"."""
    names = est.units_at_peak
    if len(names) <= 2:
        return ", ".join(names) or "none"
    return f"{names[0]} + {len(names) - 1} units"
