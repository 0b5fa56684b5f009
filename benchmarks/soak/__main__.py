"""``python -m benchmarks.soak``: the soak run and the fault table (see ``benchmarks.soak``).

Prints the tables and writes ``soak.csv`` / ``soak.md``, ``faults.csv`` / ``faults.md`` and the
fault table's disagreement scenarios ``disagreements.csv`` / ``disagreements.md`` (``*_quick.*``
with ``--quick``; ``--only soak|faults|disagreements``: that part and its files alone) to
``--out`` (default ``bench-results/cpu/``; ``--record``: ``benchmarks/results/cpu/``).
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from flashfsdp.debug import desync_window

from benchmarks.environment import device_setup, environment_columns
from benchmarks.outputs import add_output_arguments, output_dir
from benchmarks.soak.disagreements import DESYNC_TIMEOUT_S, DISAGREEMENTS, QUICK_DISAGREEMENT, run_disagreement
from benchmarks.soak.faults import FAULTS, TARGET_SLACK_S, run_fault
from benchmarks.soak.leaks import LEAK_RSS_MIB, run_soak, sample_steps
from benchmarks.tables import format_table, write_csv, write_markdown

FAULT_COLUMNS = ["fault", "victim", "fault_reached", "rank0", "rank0_error_s", "rank0_destroyed_s", "rank0_end_s",
                 "rank1", "rank1_error_s", "rank1_destroyed_s", "rank1_end_s", "all_ended", "loaded_step", "expected_step", "load_ok",
                 "meets_target"]
PARTS = ("soak", "faults", "disagreements")
DISAGREEMENT_COLUMNS = ["scenario", "timeout_s", "window_s", "rank0", "rank0_surfaced_s", "rank0_named", "rank1", "rank1_surfaced_s",
                        "rank1_named", "all_ended", "meets_target"]


def parse_args(argv=None) -> argparse.Namespace:
    """The command line; ``--quick``: a plain soak run of 4 steps, the first fault only and one
    disagreement (the one that surfaces without waiting for the timeout); ``--only PART``: that
    part alone (its files alone written).

    Raises SystemExit (argparse's error) for fewer than 2 steps or a non-positive timeout.
    """
    parser = argparse.ArgumentParser(description="Soak (leaks) and fault benchmarks, W = 2 on CPU.")
    parser.add_argument("--quick", action="store_true",
                        help="a smoke run: 4 soak steps without the profiled run, one fault")
    parser.add_argument("--steps", type=int, default=None, help="soak steps (default 1000; 4 with --quick)")
    parser.add_argument("--timeout", type=float, default=10.0,
                        help="collective timeout of the fault runs, seconds (default 10)")
    parser.add_argument("--only", choices=PARTS, default=None,
                        help="run and write one part only: the soak, the faults or the disagreements")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 4 if args.quick else 1000
    if args.steps < 2:
        parser.error(f"--steps must be >= 2 (a middle and an end sample), got {args.steps}")
    if not args.timeout > 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    return args


def _soak_columns(steps: int) -> list[str]:
    marks = (0, *sample_steps(steps))
    return (["run", "rank"] + [f"{k}@{s}" for k in ("rss_MiB", "threads", "fds") for s in marks]
            + ["rss_growth_MiB", "threads_growth", "fds_growth", "spans", "leak", "verdict"])


def main(argv=None) -> tuple[list[dict], list[dict]]:
    """Run the soak and fault benchmarks (see ``benchmarks.soak``); return (soak rows, fault rows)."""
    args = parse_args(argv)
    torch.set_num_threads(1)
    _, env, _ = device_setup("cpu")
    runs = {part: args.only in (None, part) for part in PARTS}
    window = desync_window()  # the default (FLASHFSDP_DESYNC_WINDOW)
    soak = run_soak(args.steps, profiled=False) if runs["soak"] else []
    if runs["soak"] and not args.quick:
        soak += run_soak(args.steps, profiled=True) + run_soak(args.steps, profiled="aggregate")
    faults = [run_fault(fault, args.timeout) for fault in (FAULTS[:1] if args.quick else FAULTS) if runs["faults"]]
    with tempfile.TemporaryDirectory() as ckpt_dir:
        disagreements = [run_disagreement(d, args.timeout, ckpt_dir, window) for d in DISAGREEMENTS
                         if runs["disagreements"] and (not args.quick or d.name == QUICK_DISAGREEMENT)]
        # the desync window's figures: gloo's default timeout, the default window
        disagreements += [run_disagreement(d, DESYNC_TIMEOUT_S, ckpt_dir, window) for d in DISAGREEMENTS
                          if runs["disagreements"] and not args.quick and d.name != QUICK_DISAGREEMENT]
    soak, faults = [r | env.stamp() for r in soak], [r | env.stamp() for r in faults]
    disagreements = [r | env.stamp() for r in disagreements]
    columns = _soak_columns(args.steps)
    if runs["soak"]:
        print(f"{env.device_name}: soak, W = 2 gloo, {args.steps} steps\n{format_table(soak, columns)}\n")
    if runs["faults"]:
        print(f"faults, W = 2 gloo, collective timeout {args.timeout:g} s\n{format_table(faults, FAULT_COLUMNS)}\n")
    if runs["disagreements"]:
        print(f"faults: ranks that disagree, W = 2 gloo, collective timeout {args.timeout:g} s (and "
              f"{DESYNC_TIMEOUT_S:g} s), desync window {window} s\n"
              f"{format_table(disagreements, DISAGREEMENT_COLUMNS)}")
    for row in disagreements:
        print(f"  {row['scenario']}: {row['diagnosis']}")
    out = output_dir(env.slug, out=args.out, record=args.record)
    suffix = "_quick" if args.quick else ""
    if runs["soak"]:
        write_csv(soak, out / f"soak{suffix}.csv")
        write_markdown(soak, columns + environment_columns(), out / f"soak{suffix}.md",
                       title="Soak: leaks over a long run", env=env, notes=_soak_notes(args.steps))
    if runs["faults"]:
        write_csv(faults, out / f"faults{suffix}.csv")
        write_markdown(faults, FAULT_COLUMNS + ["survivor_error"], out / f"faults{suffix}.md", title="Faults",
                       env=env, notes=_fault_notes(args.timeout))
    if runs["disagreements"]:
        write_csv(disagreements, out / f"disagreements{suffix}.csv")
        write_markdown(disagreements, DISAGREEMENT_COLUMNS + ["diagnosis"], out / f"disagreements{suffix}.md",
                       title="Faults: ranks that disagree", env=env, notes=_disagreement_notes(args.timeout, window))
    return soak, faults


def _soak_notes(steps: int) -> list[str]:
    return [
        f"W = 2 ranks (gloo, 1 intra-op thread each), tiny Llama (dim 32, 2 blocks, 1 unit per block + root), "
        f"AdamW, {steps} steps; 'profile() open': the whole run inside flashfsdp.profile('cpu'); "
        f"'profile(aggregate=True) open': inside the aggregating profile (per-unit statistics, one step's spans).",
        "Samples after gc.collect(): rss_MiB (VmRSS), threads (/proc/self/task), fds (/proc/self/fd); @0 is right "
        "after joining the process group and importing flashfsdp.train (the per-process overhead).",
        f"Growth is from the middle sample to the end; leak = RSS grew by more than {LEAK_RSS_MIB:g} MiB, or threads "
        "or fds grew. spans: spans the open profile holds at the end (the plain profile records every span by design, "
        "about 250 bytes each: its growth is the spans', not a leak; the aggregating one holds the last step's).",
    ]


def _fault_notes(timeout_s: float) -> list[str]:
    return [
        "W = 2 ranks (gloo) that each end on their own (no launcher tears the job down): 6 steps of the tiny model, "
        "flashfsdp.checkpoint.save after steps 2 and 4; the fault strikes the victim during step 4 or its save.",
        f"Collective timeout {timeout_s:g} s. rankN: ok / error / killed (by its fault) / stopped (SIGSTOP; killed by "
        "the supervisor once the other rank ended) / hung (still running 60 s past the timeout). *_error_s, "
        "*_destroyed_s, *_end_s: seconds from the fault to that rank's exception, to the end of its "
        "destroy_process_group(), and to its exit (seen by the supervisor, which polls every 20 ms).",
        "loaded_step: the checkpoint flashfsdp.checkpoint.latest picks afterwards, loaded at W = 1 and trained one "
        "more step (load_ok: loaded and a finite loss); expected_step: 4 when the crash came after the rename, else 2.",
        f"meets_target: the fault struck, the other rank raised within the timeout + {TARGET_SLACK_S:g} s, every rank "
        "ended, and the expected checkpoint loads.",
    ]


def _disagreement_notes(timeout_s: float, window_s: float | None) -> list[str]:
    return [
        "W = 2 ranks (gloo) that each end on their own, the tiny model of the fault runs; the ranks part ways "
        "after a step or two (see benchmarks.soak.disagreements for each scenario).",
        f"Collective timeout {timeout_s:g} s, then {DESYNC_TIMEOUT_S:g} s (gloo's default), both with the desync "
        f"window of {window_s} s (flashfsdp.debug.set_desync_window's default): past it the ranks compare their "
        "flight-recorder positions through the store. rankN: what the rank raised; *_surfaced_s: seconds from its "
        "divergent call to its exception; *_named: its message names both ranks' positions (or the setting that "
        "differs).",
        "diagnosis: rank 0's message, its lines joined by ' | '.",
        f"meets_target: every rank raised, named both, within the timeout or the window (the shorter) + "
        f"{TARGET_SLACK_S:g} s, and ended.",
    ]


if __name__ == "__main__":
    main()
