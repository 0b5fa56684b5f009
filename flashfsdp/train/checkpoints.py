"""The checkpoints of a `flashfsdp-train` run directory: naming, finding, saving with rotation.

A run directory `<out>` holds `<out>/checkpoints/step_<N>`, the checkpoint after N optimizer
steps, written and read by `flashfsdp.checkpoint` (torch.distributed.checkpoint), so a run saved
at one number of ranks loads at any other.
"""

from __future__ import annotations

import os
import re
import shutil

import torch
from torch import nn

from flashfsdp import checkpoint

CHECKPOINTS = "checkpoints"
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
