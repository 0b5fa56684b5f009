"""Stopping `flashfsdp-train` on a signal: the workers' `StopFlag`, and the launcher's report of
what the workers left on disk.

[Note: stop signals]
SIGINT (Ctrl-C) and SIGTERM (what `timeout`, Slurm's scancel and time limit, and Kubernetes send)
stop a run the same way. torch's elastic agent (ours, or a user's torchrun on each node) catches
either one, forwards it to each of its workers (`PContext.close(death_sig=...)`), waits up to its
shutdown timeout for them, then kills them. A worker's `StopFlag` only records the signal: at the
end of each step the ranks all-reduce their flags with the loss (`flashfsdp.train.trainer`), so a
signal that reaches any one rank stops all of them after the same step. They save the checkpoint
of that step collectively (unless it is on disk already; a fresh run stopped before its first step
saves none), rank 0 records it in `<out>/stopped.json` with the job's run id
(`flashfsdp.train.checkpoints.record_stop`), and each worker exits with 128 + the signal number.

The launcher (`flashfsdp.train.launch.launch`) says that the workers saved a final checkpoint only
when that record names its own run id and the checkpoint it names is the newest complete one on
disk (`report_stop`); otherwise it names the newest checkpoint there is. It exits with
128 + the signal number either way: 130 after SIGINT, 143 after SIGTERM.

The final save must finish within the agent's shutdown timeout (300 s under `flashfsdp-train`;
torchrun's `--shutdown-timeout`, else TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else 30 s) and, under a
scheduler, before it sends SIGKILL (Slurm: KillWait after the signal, 30 s by default;
Kubernetes: terminationGracePeriodSeconds).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from flashfsdp.train.checkpoints import final_checkpoint, latest_checkpoint

# The signals that stop a run after a final checkpoint (see [Note: stop signals]).
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Seconds between a worker's looks at its parent (`watch_parent`).
PARENT_POLL_S = 0.5


def exit_code(signum: int) -> int:
    """The exit code of a run stopped by signal `signum`: 128 + signum, as a shell reports a
    process killed by it (130 for SIGINT, 143 for SIGTERM)."""
    return 128 + signum


def stop_signal_of(code: int) -> int | None:
    """The stop signal whose `exit_code` is `code` (a worker that stopped gracefully), or None."""
    return next((int(sig) for sig in STOP_SIGNALS if exit_code(sig) == code), None)


class StopFlag:
    """Records the first SIGINT or SIGTERM received while installed; read at step boundaries
    (see [Note: stop signals]).

    Installs its handlers on construction (in the main thread); `restore` puts the previous ones
    back.

    Attributes:
        signum: the first stop signal received, or 0.
    """

    def __init__(self):
        self.signum = 0
        self._previous = {sig: signal.signal(sig, self._handle) for sig in STOP_SIGNALS}

    @property
    def requested(self) -> bool:
        """True once a stop signal was received."""
        return self.signum != 0

    def _handle(self, signum, frame):
        if not self.signum:
            self.signum = signum

    def restore(self) -> None:
        """Reinstall the handlers that were in place before this flag."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)


def report_stop(prog: str, out: str, run_id: str, signum: int) -> int:
    """Print on stderr what a run stopped by `signum` left in `out`, and return its exit code.

    "the workers saved a final checkpoint at step N, PATH" only when the workers of job `run_id`
    recorded that checkpoint and it is the newest complete one on disk
    (`flashfsdp.train.checkpoints.final_checkpoint`); otherwise the newest checkpoint of `out`, or
    that there is none.

    Args:
        prog: the program name the message starts with.
        out: the run directory.
        run_id: the job's torch elastic run id.
        signum: the signal that stopped the run.

    Returns:
        `exit_code(signum)`.
    """
    name = signal.Signals(signum).name
    final = final_checkpoint(out, run_id)
    if final is not None:
        step, path = final
        print(f"{prog}: interrupted; the workers saved a final checkpoint at step {step}, {path} "
              f"({name}; resume with --resume)", file=sys.stderr)
        return exit_code(signum)
    newest = latest_checkpoint(out)
    left = f"the newest checkpoint is {newest}" if newest else f"{out} holds no checkpoint"
    print(f"{prog}: interrupted ({name}) without a final checkpoint (stopped before the first "
          f"step, or a worker ended before saving); {left}", file=sys.stderr)
    return exit_code(signum)


def watch_parent(parent: int, prog: str) -> threading.Thread | None:
    """Stop this worker when its launcher is gone ([Note: a launcher killed alone]).

    A daemon thread looks every `PARENT_POLL_S` seconds at this process's parent; once it is no
    longer `parent` (the launcher died and the worker was re-parented to init or a subreaper) it
    says so on stderr and sends SIGTERM to this process: a worker whose `StopFlag` is installed
    stops with the other ranks after the current step, saving its checkpoint, as on any SIGTERM;
    one still starting up ends at once. If `parent` is already gone, SIGTERM is sent now.

    [Note: a launcher killed alone]
    torch's elastic agent starts its workers in sessions of their own, so a launcher (or torchrun)
    killed with SIGKILL leaves them running, unwatched. Linux's parent-death signal
    (prctl(PR_SET_PDEATHSIG)) would reach them at once, but it fires when the *thread* that forked
    the worker ends, not its process, and it is lost if the parent died before the worker set it:
    a launcher that starts workers from a helper thread would stop a healthy run. Comparing
    os.getppid() with the parent's pid depends on neither, works wherever the worker runs (our
    launcher, a user's torchrun: the parent is the agent either way), and costs one system call
    per look.

    Args:
        parent: the pid of the launcher (or torchrun) that started this worker.
        prog: the program name the message starts with.

    Returns:
        The watching thread, or None when `parent` was already gone.
    """
    if os.getppid() != parent:
        _parent_gone(parent, prog)
        return None

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        _parent_gone(parent, prog)

    thread = threading.Thread(target=watch, name="flashfsdp-train-parent-watch", daemon=True)
    thread.start()
    return thread


def _parent_gone(parent: int, prog: str) -> None:
    print(f"{prog}: worker {os.getpid()}: its launcher (pid {parent}) is gone; stopping after the current "
          "step", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
