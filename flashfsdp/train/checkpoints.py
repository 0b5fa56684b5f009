"""The checkpoints of a `flashfsdp-train` run directory: naming, finding, saving with rotation.

A run directory `<out>` holds `<out>/checkpoints/step_<N>`, the checkpoint after N optimizer
steps, written and read by `flashfsdp.checkpoint` (torch.distributed.checkpoint), so a run saved
at one number of ranks loads at any other. When the ranks stop early on a signal, rank 0 writes
`<out>/stopped.json` (`record_stop`), from which the launcher checks that the final checkpoint it
announces is on disk (`final_checkpoint`).
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
from torch import nn

from flashfsdp import checkpoint
from flashfsdp.checkpoint.files import write_file

CHECKPOINTS = "checkpoints"
# The record of the last early stop of the run (`record_stop`).
STOP_RECORD = "stopped.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


def checkpoints_dir(out: str) -> str:
    """`<out>/checkpoints`: the directory of the run's checkpoints."""
    return os.path.join(out, CHECKPOINTS)


def checkpoint_dir(out: str, step: int) -> str:
    """`<out>/checkpoints/step_<step>`: where the checkpoint after `step` steps goes."""
    return os.path.join(checkpoints_dir(out), f"step_{step}")


def latest_checkpoint(out: str) -> str | None:
    """The newest complete checkpoint of the run in `out`, or None."""
    directory = checkpoints_dir(out)
    return checkpoint.latest(directory) if os.path.isdir(directory) else None


def rotate(out: str, keep: int) -> None:
    """Delete all but the `keep` newest `step_<N>` checkpoints of the run in `out` (keep ≤ 0:
    keep all). Call it on one rank only."""
    if keep <= 0:
        return
    parent = checkpoints_dir(out)
    steps = sorted(int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(parent)) if m)
    for old in steps[:-keep]:
        shutil.rmtree(os.path.join(parent, f"step_{old}"), ignore_errors=True)


def save_checkpoint(out: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    extra: dict, keep: int, rank: int) -> str:
    """Save collectively (every rank calls it) into `checkpoint_dir(out, step)`, then rank 0
    keeps only the `keep` newest checkpoints (`rotate`).

    `flashfsdp.checkpoint.save` writes atomically, so an interrupted save leaves no partial
    checkpoint behind.

    Args:
        out: the run directory.
        model: the sharded model.
        optimizer: its optimizer.
        step: optimizer steps done.
        extra: JSON-serialisable run state stored with the checkpoint.
        keep: newest checkpoints kept (≤ 0: all).
        rank: this rank (0 rotates).

    Returns:
        The checkpoint's path.
    """
    path = checkpoint_dir(out, step)
    checkpoint.save(path, model, optimizer, step=step, extra=extra)
    if rank == 0:
        rotate(out, keep)
    return path


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load a checkpoint collectively, at any world size, into the sharded `model` (its
    parameters materialised, initialised or not) and `optimizer`.

    Returns:
        {"step": int, "extra": dict}.
    """
    return checkpoint.load(path, model, optimizer)


def record_stop(out: str, step: int, run_id: str, signal_name: str) -> str:
    """Record in `<out>/stopped.json` (durably, replacing an earlier record) that the ranks of the
    job `run_id` stopped on `signal_name` with the checkpoint of their last step, `step`, complete.
    Call it on one rank, after the checkpoint's collective save returned.

    Args:
        out: the run directory.
        step: optimizer steps done; `checkpoint_dir(out, step)` is complete.
        run_id: the job's torch elastic run id (TORCHELASTIC_RUN_ID), "none" if torchrun got no
            --rdzv-id.
        signal_name: the signal that stopped the run, e.g. "SIGTERM".

    Returns:
        The record's path.
    """
    record = {"run_id": run_id, "step": step, "checkpoint": checkpoint_dir(out, step),
              "signal": signal_name}
    path = os.path.join(out, STOP_RECORD)
    write_file(path, json.dumps(record, indent=1).encode())
    return path


def clear_stop_record(out: str) -> None:
    """Remove `<out>/stopped.json` (a resumed run goes on: the record of its last stop is spent)."""
    try:
        os.remove(os.path.join(out, STOP_RECORD))
    except FileNotFoundError:
        pass


def final_checkpoint(out: str, run_id: str) -> tuple[int, str] | None:
    """(step, path) of the final checkpoint the ranks of the job `run_id` recorded when they
    stopped (`record_stop`), if that checkpoint is the newest complete one in `out`; else None
    (no record, a record of another job, or the checkpoint missing, incomplete or superseded)."""
    try:
        with open(os.path.join(out, STOP_RECORD), encoding="utf-8") as fh:
            record = json.load(fh)
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("run_id") != run_id:
        return None
    path, step = record.get("checkpoint"), record.get("step")
    if not isinstance(step, int) or path != checkpoint_dir(out, step) or latest_checkpoint(out) != path:
        return None
    return step, path
