"""The soak run: ``steps`` training steps at W = 2, each rank's resident memory, threads and open
file descriptors sampled along the way, once plain and once inside ``flashfsdp.profile()`` held
open for the whole run.

A rank samples right after joining the process group and importing flashfsdp's training job
(step 0: the process overhead ``flashfsdp.train.checks.PROCESS_OVERHEAD_BYTES`` stands for), then
after the chosen steps, each time after ``gc.collect()`` (uncollected cycles are not leaks). A
leak is growth over the second half of the run, once every cache and pool has warmed up: more
threads or descriptors at the end than at the middle sample, or resident memory grown by more
than ``LEAK_RSS_MIB``.
"""

from __future__ import annotations

import contextlib
import gc

from benchmarks.soak import workload
from benchmarks.tables import memory_verdict
from flashfsdp_dev.ranks import spawn_ranks

WORLD_SIZE = 2
# Resident-memory growth over the second half of a run that counts as a leak (MiB).
LEAK_RSS_MIB = 4.0


def sample_steps(steps: int) -> tuple[int, ...]:
    """Where a run of ``steps`` steps is sampled: 1% in (at least step 1), the middle, the end
    (10, 500, 1000 for 1000 steps)."""
    return tuple(sorted({max(1, steps // 100), max(1, steps // 2), steps}))


def _profiled(profiled: bool | str):
    """The profile the run holds open: none (False), ``flashfsdp.profile()`` (True), or the
    aggregating one (``"aggregate"``: per-unit statistics, constant memory)."""
    import flashfsdp  # noqa: PLC0415

    if not profiled:
        return contextlib.nullcontext()
    return flashfsdp.profile("cpu", aggregate=profiled == "aggregate")


def _soak_rank(rank: int, world_size: int, steps: int, profiled: bool | str) -> dict:
    import flashfsdp  # noqa: PLC0415
    import flashfsdp.train.trainer  # noqa: F401, PLC0415 - what a training worker imports

    gc.collect()
    samples = [{"step": 0, **workload.process_stats()}]
    marks = sample_steps(steps)
    job = workload.build(rank)
    spans = None
    with _profiled(profiled) as prof:
        for step in range(1, steps + 1):
            workload.train_step(job)
            if step in marks:
                gc.collect()
                samples.append({"step": step, **workload.process_stats()})
        if prof is not None:
            spans = len(prof.spans)
    return {"samples": samples, "spans": spans}


def run_soak(steps: int, profiled: bool | str, timeout_s: float = 1800) -> list[dict]:
    """One soak run at W = 2 (gloo, one intra-op thread and the reference kernels per rank), with
    ``flashfsdp.profile()`` open the whole run if ``profiled`` (``"aggregate"``: the aggregating
    profile).

    Returns:
        One row per rank: the samples as ``rss_MiB@<step>``, ``threads@<step>``, ``fds@<step>``;
        the growth from the middle sample to the end (``rss_growth_MiB``, ``threads_growth``,
        ``fds_growth``); ``leak`` (see the module docstring) and ``verdict`` (the RSS growth against
        :data:`LEAK_RSS_MIB`, as "growth X MiB ≤ bound Y MiB"); ``spans`` held by the profile.
    """
    results = spawn_ranks(_soak_rank, WORLD_SIZE, (steps, profiled), threads=1, kernels="reference",
                          timeout=timeout_s)
    rows = []
    for rank, result in enumerate(results):
        run = {False: "plain", True: "profile() open", "aggregate": "profile(aggregate=True) open"}[profiled]
        row = {"run": run, "rank": rank, "steps": steps}
        by_step = {s["step"]: s for s in result["samples"]}
        for step, sample in by_step.items():
            row.update({f"{key}@{step}": sample[key] for key in ("rss_MiB", "threads", "fds")})
        middle, end = by_step[sample_steps(steps)[-2]], by_step[steps]
        row.update(rss_growth_MiB=end["rss_MiB"] - middle["rss_MiB"], threads_growth=end["threads"] - middle["threads"],
                   fds_growth=end["fds"] - middle["fds"], spans=result["spans"])
        row["leak"] = bool(row["rss_growth_MiB"] > LEAK_RSS_MIB or row["threads_growth"] > 0 or row["fds_growth"] > 0)
        row["verdict"] = memory_verdict(row["rss_growth_MiB"], LEAK_RSS_MIB)
        rows.append(row)
    return rows
