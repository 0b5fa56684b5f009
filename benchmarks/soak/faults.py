"""The fault table: one rank killed or stopped at a chosen point of a W = 2 run, and what follows.

Every scenario trains the tiny model of ``benchmarks.soak.workload`` for ``STEPS`` steps, saving
a checkpoint with ``flashfsdp.checkpoint.save`` after step ``GOOD_STEP`` (the last good one) and
after step ``FAULT_STEP``; the fault strikes the victim rank during step ``FAULT_STEP`` (in the
forward of the last block, or in the backward of the first) or during that step's save. The
victim records the time and sends itself the signal: SIGKILL (a crash: its sockets close) or
SIGSTOP (a hang: its sockets stay open and silent, so only the collective timeout can tell).

The save points, in the order ``flashfsdp.checkpoint.save`` passes them (see its [Note: atomic
save]), are found from the outside, so they stay put whatever the function's internals become:
entering DCP's write (``torch.distributed.checkpoint.save``), this rank's shard files written
(``FileSystemWriter.write_data`` returned), DCP's write done on every rank (``.metadata`` written),
the marker written just before the directory is renamed into place (``os.rename`` / ``os.replace``
onto the checkpoint's path), and just after that rename.

Measured per scenario (``benchmarks.soak.supervisor``): how each rank ended; for every other rank
the time from the fault to its error and to its exit; whether every rank ended (no hang); and,
after the run, which checkpoint ``flashfsdp.checkpoint.latest`` picks and whether it loads (at
W = 1, then one more training step with a finite loss). Expected: the step-``GOOD_STEP``
checkpoint, or the step-``FAULT_STEP`` one when the crash came after its marker was written (a
complete copy that ``latest`` recovers, before the rename as after it).
"""

from __future__ import annotations

import json
import math
import os
import signal
import tempfile
import time
from dataclasses import dataclass

from benchmarks.soak import workload
from benchmarks.soak.supervisor import RankEnd, run_independent

STEPS, GOOD_STEP, FAULT_STEP = 6, 2, 4
WORLD_SIZE = 2
# Target: every surviving rank raises within the collective timeout plus this (seconds).
TARGET_SLACK_S = 5.0


@dataclass(frozen=True)
class Fault:
    """One scenario: ``victim`` sends itself ``signal`` ("SIGKILL" or "SIGSTOP") at ``point``:
    "forward", "backward", or "save:<point>" with <point> one of ``SAVE_POINTS``."""

    name: str
    victim: int
    signal: str
    point: str


SAVE_POINTS = ("dcp_enter", "shards_written", "dcp_done", "before_rename", "after_rename")
FAULTS = (
    Fault("kill in forward", 1, "SIGKILL", "forward"),
    Fault("kill in backward", 1, "SIGKILL", "backward"),
    Fault("kill in checkpoint save", 1, "SIGKILL", "save:shards_written"),
    Fault("stop (hang) in forward", 1, "SIGSTOP", "forward"),
    Fault("save crash: entering DCP write", 0, "SIGKILL", "save:dcp_enter"),
    Fault("save crash: own shards written", 0, "SIGKILL", "save:shards_written"),
    Fault("save crash: all shards written, no marker", 0, "SIGKILL", "save:dcp_done"),
    Fault("save crash: marker written, before rename", 0, "SIGKILL", "save:before_rename"),
    Fault("save crash: just after rename", 0, "SIGKILL", "save:after_rename"),
)


def checkpoint_path(ckpt_dir: str, step: int) -> str:
    """Where the checkpoint after ``step`` steps goes (the training job's naming)."""
    return os.path.join(ckpt_dir, f"step_{step}")


class _Injector:
    """The victim's trap: fires (records the time, then signals itself) at the fault's point
    while ``armed``."""

    def __init__(self, fault: Fault, record_file: str, target: str):
        self.fault, self.record_file, self.target, self.armed = fault, record_file, target, False

    def fire(self) -> None:
        if not self.armed:
            return
        with open(self.record_file, "w") as f:
            json.dump({"at": time.monotonic(), "point": self.fault.point}, f)
        os.kill(os.getpid(), getattr(signal, self.fault.signal))

    def install(self, model) -> None:
        point = self.fault.point
        if point == "forward":
            model.layers[-1].register_forward_pre_hook(lambda module, args: self.fire())
        elif point == "backward":
            model.layers[0].register_forward_hook(self._hook_output_grad)
        else:
            self._wrap_save(point.split(":", 1)[1])

    def _hook_output_grad(self, module, args, output) -> None:
        if output.requires_grad:
            output.register_hook(lambda grad: self.fire())

    def _wrap_save(self, point: str) -> None:
        import torch.distributed.checkpoint as dcp  # noqa: PLC0415

        if point in ("dcp_enter", "dcp_done"):
            dcp.save = self._around(dcp.save, before=point == "dcp_enter")
        elif point == "shards_written":
            dcp.FileSystemWriter.write_data = self._around(dcp.FileSystemWriter.write_data, before=False)
        else:
            for name in ("rename", "replace"):
                setattr(os, name, self._around(getattr(os, name), before=point == "before_rename",
                                               onto=self.target))

    def _around(self, fn, *, before: bool, onto: str | None = None):
        def wrapped(*args, **kwargs):
            hit = onto is None or os.fspath(args[1]) == onto
            if hit and before:
                self.fire()
            out = fn(*args, **kwargs)
            if hit and not before:
                self.fire()
            return out
        return wrapped


def _fault_rank(rank: int, world_size: int, fault: Fault, ckpt_dir: str, record_file: str) -> dict:
    """One rank of a scenario (see the module docstring); returns the steps it finished."""
    from flashfsdp import checkpoint  # noqa: PLC0415
    from flashfsdp.kernels.dispatch import use_backend  # noqa: PLC0415

    with use_backend("reference"):
        job = workload.build(rank)
        trap = _Injector(fault, record_file, checkpoint_path(ckpt_dir, FAULT_STEP))
        if rank == fault.victim:
            trap.install(job.model)
        in_step = fault.point in ("forward", "backward")
        for step in range(1, STEPS + 1):
            trap.armed = in_step and step == FAULT_STEP
            workload.train_step(job)
            if step in (GOOD_STEP, FAULT_STEP):
                trap.armed = not in_step and step == FAULT_STEP
                checkpoint.save(checkpoint_path(ckpt_dir, step), job.model, job.optimizer, step=step)
            trap.armed = False
    return {"steps": STEPS}


def load_latest(ckpt_dir: str) -> dict:
    """Load the checkpoint ``flashfsdp.checkpoint.latest`` picks in ``ckpt_dir`` into a fresh
    model and optimizer at W = 1 (in this process, no process group), then train one step.

    Returns:
        {"loaded_step": its step or None (none found), "load_ok": bool, "load_error": str|None}.
    """
    from flashfsdp import checkpoint  # noqa: PLC0415
    from flashfsdp.kernels.dispatch import use_backend  # noqa: PLC0415

    path = checkpoint.latest(ckpt_dir)
    if path is None:
        return {"loaded_step": None, "load_ok": False, "load_error": "no complete checkpoint"}
    try:
        with use_backend("reference"):
            job = workload.build(0, seed=1)
            step = checkpoint.load(path, job.model, job.optimizer)["step"]
            loss = workload.train_step(job)
    except Exception as exc:  # noqa: BLE001 - any failure to load is the finding
        return {"loaded_step": None, "load_ok": False, "load_error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"loaded_step": step, "load_ok": math.isfinite(loss), "load_error": None}


def run_fault(fault: Fault, timeout_s: float) -> dict:
    """Run one scenario at W = 2 with the collective timeout ``timeout_s``; returns its row."""
    with tempfile.TemporaryDirectory() as tmp:
        ckpt_dir, record_file = os.path.join(tmp, "checkpoints"), os.path.join(tmp, "fault.json")
        ends = run_independent(_fault_rank, WORLD_SIZE, (fault, ckpt_dir, record_file),
                               timeout_s=timeout_s, limit_s=timeout_s + 60)
        fired = None
        if os.path.exists(record_file):
            with open(record_file) as f:
                fired = json.load(f)["at"]
        return _row(fault, timeout_s, ends, fired, load_latest(ckpt_dir))


def _row(fault: Fault, timeout_s: float, ends: list[RankEnd], fired: float | None, loaded: dict) -> dict:
    row = {"fault": fault.name, "victim": fault.victim, "signal": fault.signal, "point": fault.point,
           "timeout_s": timeout_s, "fault_reached": fired is not None}
    survivors_in_time = fired is not None
    for end in ends:
        since = (lambda t: t - fired if t is not None and fired is not None else math.nan)
        row[f"rank{end.rank}"] = end.how
        row[f"rank{end.rank}_error_s"] = since(end.error_at)
        row[f"rank{end.rank}_destroyed_s"] = since(end.destroyed_at)
        row[f"rank{end.rank}_end_s"] = since(end.ended_at)
        if end.rank != fault.victim:
            row["survivor_error"] = end.error
            survivors_in_time &= end.how == "error" and row[f"rank{end.rank}_error_s"] <= timeout_s + TARGET_SLACK_S
    row["all_ended"] = all(end.how != "hung" for end in ends)
    # the new checkpoint is complete once its marker is written: recovered from there on
    expected = FAULT_STEP if fault.point in ("save:before_rename", "save:after_rename") else GOOD_STEP
    row.update(loaded, expected_step=expected)
    row["meets_target"] = bool(survivors_in_time and row["all_ended"] and loaded["load_ok"]
                               and loaded["loaded_step"] == expected)
    return row
