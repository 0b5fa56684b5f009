"""The benchmarks' figures, checked on the matplotlib objects (Agg, tiny inputs): log axes and
labels, error bars from the rounds, ceilings drawn as lines, legends placed off the data; and the
memory verdict's wording."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

pytest.importorskip("matplotlib")
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
from matplotlib.collections import LineCollection  # noqa: E402
from matplotlib.container import BarContainer  # noqa: E402

from benchmarks import checkpoint, kernels, plots, step, tables  # noqa: E402
from benchmarks.overlap import report  # noqa: E402


def _extent(artist):
    """Where ``artist`` lies in the saved figure (display units), on a fresh Agg canvas: pyplot's
    own was detached when the figure was closed."""
    figure = artist.figure
    canvas = figure.canvas if isinstance(figure.canvas, FigureCanvasAgg) else FigureCanvasAgg(figure)
    return artist.get_window_extent(canvas.get_renderer())


def _right_of(legend, axis) -> bool:
    return _extent(legend).x0 >= _extent(axis).x1 - 1


def _error_spans(axis) -> list[tuple[float, float]]:
    """(low, high) of every error bar drawn on ``axis``."""
    spans = []
    for container in axis.containers:
        if isinstance(container, BarContainer) and container.errorbar is not None:
            for segment in container.errorbar.lines[2][0].get_segments():
                spans.append((float(segment[0][1]), float(segment[1][1])))
    return spans


def test_bar_chart_log_axis_labels_error_bars_and_ceilings(tmp_path):
    fig = plots.bar_chart(tmp_path / "x.png", {"panel": (["a", "b"], {"s": [2.0, 5.0]}, {"s": [(1.0, 3.0), (4.0, 9.0)]})},
                          ylabel="GB/s", xlabel="case", title="t", log=True, ceilings={"panel": [10.0, 20.0]},
                          ceiling_label="copy ceiling")
    axis = fig.axes[0]
    assert (tmp_path / "x.png").stat().st_size > 0
    assert axis.get_yscale() == "log" and axis.get_xlabel() == "case" and axis.get_ylabel() == "GB/s"
    assert _error_spans(axis) == [(1.0, 3.0), (4.0, 9.0)]
    lines = [c for c in axis.collections if isinstance(c, LineCollection) and c.get_label() == "copy ceiling"]
    assert [seg[0][1] for seg in lines[0].get_segments()] == [10.0]
    assert "copy ceiling" in [t.get_text() for t in axis.get_legend().get_texts()]
    assert _right_of(axis.get_legend(), axis)


def _kernel_rows():
    rows = []
    for dtypes, ours, theirs in (("fp32->bf16", 3.0, 2.0), ("fp32->fp32", 4.0, 5.0)):
        for impl, gbps in (("flashfsdp", ours), ("torch._foreach_copy_", theirs), ("copy ceiling", 20.0)):
            rows.append({"op": "flatten", "case": "llama-h64", "dtypes": dtypes, "impl": impl, "GB/s": gbps})
    return rows


def test_kernels_plot_is_log_scaled_labelled_and_under_one_ceiling_per_case(tmp_path):
    fig = kernels.plot(_kernel_rows(), tmp_path / "kernels.png", title="t")
    axis = fig.axes[0]
    assert axis.get_yscale() == "log" and axis.get_xlabel() == "case and dtypes (input -> output)"
    ceiling = next(c for c in axis.collections if isinstance(c, LineCollection))
    heights = [seg[0][1] for segs in [ceiling.get_segments()] for seg in segs]
    all_heights = heights + [seg[0][1] for c in axis.collections if isinstance(c, LineCollection) and c is not ceiling
                             for seg in c.get_segments()]
    assert sorted(all_heights) == [20.0, 20.0]
    assert [p.get_height() for p in axis.containers[0]] == [3.0, 4.0]


def test_step_bars_carry_the_rounds_spread_and_the_timeline_a_legend(tmp_path):
    run = lambda ms, peak: [{"step_ms": ms, "peak_bytes": peak * 2**20}]  # noqa: E731 - one rank per round
    rounds = {"flashfsdp": [run(10.0, 5), run(12.0, 6), run(11.0, 7)], "unsharded": [run(8.0, 1), run(9.0, 1), run(9.5, 1)]}
    spreads = step._round_spreads(rounds)
    assert spreads["flashfsdp"]["step_ms"] == (10.0, 12.0)
    assert spreads["flashfsdp"]["overhead_ms"] == (1.5, 3.0) and spreads["flashfsdp"]["peak_mem_MiB"] == (5.0, 7.0)
    rows = [{"system": s, "step_ms": 11.0 if s == "flashfsdp" else 9.0, "overhead_ms": 2.0 if s == "flashfsdp" else 0.0,
             "traced_exposed_ms": math.nan, "peak_mem_MiB": 6.0 if s == "flashfsdp" else 1.0} for s in rounds]
    fig = step._plot(tmp_path / "step.png", rows, spreads, title="t")
    assert _error_spans(fig.axes[0]) == [(10.0, 12.0), (8.0, 9.5)]
    assert fig.axes[0].get_xlabel() == "system"

    spans = [("forward", "u0", "compute", 0, 0.0, 2e3), ("all_gather", "u0", "all_gather", 0, 0.0, 1e3),
             ("wait_all_gather", "u0", "compute", 0, 1e3, 1.5e3), ("reduce_scatter", "u0", "reduce_scatter", 0, 2e3, 3e3),
             ("copy_in", "u0", "all_gather", 0, 0.0, 0.1e3), ("pack", "u0", "reduce_scatter", 0, 1.8e3, 2e3)]
    fig = step._timeline(tmp_path / "timeline.png", spans)
    legend = fig.axes[0].get_legend()
    labels = [t.get_text() for t in legend.get_texts()]
    assert labels == ["forward", "all gather", "reduce scatter", "copy in / pack", "wait (exposed communication)"]
    assert _right_of(legend, fig.axes[0])


def test_overlap_sweep_has_one_legend_below_the_curves(tmp_path):
    rows = [{"model": "Llama-8B", "link": link, "setting": setting, "world_size": w, "step_ms": 100.0 * w,
             "efficiency": 1.0 / w, "compute_ms": 90.0}
            for link in ("NVLink", "IB") for setting in ("fwd+bwd (default)", "no prefetch") for w in (8, 64)]
    fig = report._plot_sweep(rows, tmp_path / "overlap.png", "t")
    assert all(axis.get_legend() is None for axis in fig.axes)
    (legend,) = fig.legends
    assert len(legend.get_texts()) == 5  # 2 links x 2 settings + pure compute
    assert _extent(legend).y1 <= min(_extent(axis).y0 for axis in fig.axes) + 1
    assert fig.axes[0].get_xscale() == "log" and fig.axes[0].get_yscale() == "log"


def test_overlap_validation_timelines_have_legends_beside_them(tmp_path):
    row = {"config": "c", "schedule": "s", "measured_noncompute_ms": 1.0, "sim_noncompute_ms": 1.1,
           "host_noncompute_ms": 1.2, "traced_sim_noncompute_ms": 0.9}
    span = lambda kind, stream, start, end: SimpleNamespace(kind=kind, stream=stream, start=start, end=end)  # noqa: E731
    timelines = {"c": [span("forward", "compute", 0.0, 0.002), span("all_gather", "comm", 0.0, 0.001),
                       span("wait_all_gather", "compute", 0.001, 0.0015)]}
    fig = report._plot_validation([row], timelines, tmp_path / "validation.png")
    timeline = fig.axes[1]
    labels = [t.get_text() for t in timeline.get_legend().get_texts()]
    assert labels == ["forward", "all gather", "wait (exposed)"]
    assert _right_of(timeline.get_legend(), timeline) and _right_of(fig.axes[0].get_legend(), fig.axes[0])


def test_checkpoint_plot_and_the_memory_verdict(tmp_path):
    assert tables.memory_verdict(12.34, 45.6, "rank 0") == "rank 0: growth 12.3 MiB ≤ bound 45.6 MiB"
    assert tables.memory_verdict(50.0, 45.6) == "growth 50.0 MiB > bound 45.6 MiB (over)"
    rows = [{"system": system, "state_dict": kind, "op": op, "ms": 10.0, "growth_MiB": 3.0,
             "bound_MiB": "4.0 / 5.0" if kind == "full" and system == "flashfsdp" else ""}
            for system in ("flashfsdp", "fsdp2") for kind in ("sharded", "full") for op in ("save", "load")]
    fig = checkpoint.plot(rows, tmp_path / "checkpoint.png", title="t")
    time_axis, memory_axis = fig.axes
    assert [t.get_text() for t in time_axis.get_xticklabels()] == ["sharded save", "sharded load", "full save",
                                                                   "full load"]
    bound = memory_axis.containers[2]
    assert [p.get_height() for p in bound][2:] == [5.0, 5.0] and (tmp_path / "checkpoint.png").exists()
