"""Text of a :class:`~flashfsdp.estimate.pipeline.PipelineEstimate`: a row per pipeline rank (its
stages and blocks, ZeRO-3 states over its dp ranks, the unit working set, the micro-batches in
flight and their activations, the total), the rank that sets the peak, the bubble and the
point-to-point bytes per step."""

from __future__ import annotations

from .pipeline import PipelineEstimate, StageEstimate
from .report import _table, human_bytes


def _holds(r: StageEstimate) -> str:
    """"embedding + blocks 0-7", "blocks 8-15 + output", ... of a pipeline rank."""
    runs, start = [], 0
    for i in range(1, len(r.layers) + 1):  # consecutive runs of blocks (a rank's stages need not be adjacent)
        if i == len(r.layers) or r.layers[i] != r.layers[i - 1] + 1:
            a, b = r.layers[start], r.layers[i - 1]
            runs.append(f"{a}-{b}" if b > a else str(a))
            start = i
    spans = f"block{'s' if len(r.layers) > 1 else ''} {', '.join(runs)}"
    return ("embedding + " if r.holds_embedding else "") + spans + (" + norm, output" if r.holds_output else "")


def pipeline_table(est: PipelineEstimate) -> str:
    """The per-rank table, the peak's line, the bubble and the point-to-point bytes (bytes in
    binary units; the bubble as a share of the step)."""
    rows = [(str(r.pp_rank), ",".join(map(str, r.stages)), _holds(r), human_bytes(r.fsdp.model_state_bytes),
             human_bytes(r.fsdp.transient_peak_bytes), str(r.in_flight), human_bytes(r.activation_bytes),
             human_bytes(r.total_bytes)) for r in est.ranks]
    header = ("pp rank", "stages", "holds", "states", "unit working set", "in flight", "activations", "total")
    peak = est.peak_rank
    v = est.virtual_stages
    formula = f"(pp-1)/({'v*' if v > 1 else ''}M+pp-1) = {est.pp - 1}/{v * est.microbatches + est.pp - 1}"
    return "\n".join([
        _table(header, rows),
        f"peak set by: pp rank {peak.pp_rank} ({_holds(peak)}): {human_bytes(peak.total_bytes)} per rank "
        f"({peak.total_bytes:,} bytes)",
        f"bubble: {est.bubble_fraction:.1%} of the step, {formula} ({est.schedule}, M = {est.microbatches}"
        f"{f', v = {v}' if v > 1 else ''})",
        f"point-to-point per step and pipeline: {human_bytes(est.p2p_bytes_per_step)} ({est.p2p_bytes_per_step:,} "
        f"bytes) = 2 ways x {est.microbatches} micro-batches x {est.boundaries} boundaries x "
        f"{human_bytes(est.p2p_bytes_per_microbatch)} (b {est.microbatch_size} x s {est.seq_len} x dim {est.dim} x "
        f"{est.activation_bytes_per_element} bytes); most sent by one rank: {human_bytes(est.p2p_sent_per_rank)}",
    ])
