"""The processes of `flashfsdp-train`: starting workers through torch's elastic launcher (what
torchrun runs), and, in each worker, joining the process group and catching Ctrl-C.

Under torchrun (the environment has TORCHELASTIC_RUN_ID) the process is already a worker.
Started plainly, it launches `--nproc` local copies of itself, `python -m flashfsdp.train ARGS`,
with `torch.distributed.launcher.api.elastic_launch`: a single-node c10d rendezvous (as
`torchrun --standalone`) whose stores listen on 127.0.0.1 only (`flashfsdp.train.rendezvous`),
no restarts.

[Note: timeouts] Every collective of a worker waits at most `--timeout` seconds for the other
ranks (the process group's timeout): a rank that hangs or is stopped makes the others raise, the
agent sees them fail and ends the job (the hung rank gets SIGTERM, then SIGKILL after the
agent's shutdown timeout). A rank that dies closes its connections, so the others fail at their
next collective without waiting for the timeout.

[Note: interrupts] Started by torch's elastic agent (ours or a user's torchrun), workers run in
their own session: a Ctrl-C reaches only the agent, which forwards SIGINT to each worker once
and kills them after its shutdown timeout. A KeyboardInterrupt raised at an arbitrary point
would leave the ranks at different collectives, so each worker's SIGINT handler (`StopFlag`)
only sets a flag; at the end of each step the ranks all-reduce their flags together with the
loss (`flashfsdp.train.trainer`), so all of them stop after the same step and save the final
checkpoint collectively.
"""

from __future__ import annotations

import datetime
import os
import signal
import sys
import uuid

import torch
import torch.distributed as dist

from flashfsdp.train.config import DEFAULT_TIMEOUT_S

# Seconds the agent waits for workers to save their final checkpoint after forwarding a SIGINT
# before it kills them (torch's default is 30).
SHUTDOWN_TIMEOUT_S = 300

# Set in the environment of the workers `launch` starts: their parent already validated.
_LAUNCHED_ENV = "FLASHFSDP_TRAIN_LAUNCHED"


def under_torchrun() -> bool:
    """True in a worker started by torchrun / torch elastic (ours or the user's)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def launched_by_us() -> bool:
    """True in a worker started by `launch` (rather than by a user's torchrun)."""
    return os.environ.get(_LAUNCHED_ENV) == "1"


def worker_world() -> tuple[int, int]:
    """(world size, ranks on this host) of the job torchrun / torch elastic started."""
    world_size = int(os.environ["WORLD_SIZE"])
    return world_size, int(os.environ.get("LOCAL_WORLD_SIZE", world_size))


def launch(nproc: int, worker_argv: list[str], device_type: str) -> int:
    """Run `nproc` local workers of `python -m flashfsdp.train worker_argv` and wait for them.

    CPU workers get OMP_NUM_THREADS = usable cores / nproc (unless already set), and PYTHONPATH
    leads with the directory that holds the `flashfsdp` package, so an uninstalled checkout
    works too.

    Args:
        nproc: local workers (≥ 1).
        worker_argv: the command line of each worker (after the program name).
        device_type: "cpu" or "cuda".

    Returns:
        0 when every worker succeeded; 130 after a Ctrl-C (the workers save a final checkpoint
        first, see [Note: interrupts]); otherwise the first failed worker's exit code (its own
        error message is already on stderr).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from flashfsdp.train.rendezvous import LOOPBACK, LOOPBACK_BACKEND

    if device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // nproc))
    os.environ[_LAUNCHED_ENV] = "1"
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../flashfsdp
    root = os.path.dirname(package)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend=LOOPBACK_BACKEND, rdzv_endpoint=f"{LOOPBACK}:0", local_addr=LOOPBACK,
        max_restarts=0, monitor_interval=0.1, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
    )
    try:
        elastic_launch(config, sys.executable)("-u", "-m", "flashfsdp.train", *worker_argv)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        print(f"flashfsdp-train: error: worker rank {rank} exited with code {failure.exitcode}; "
              "its message is above", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 1
    except (SignalException, KeyboardInterrupt):
        print("flashfsdp-train: interrupted; the workers saved a final checkpoint (resume with "
              "--resume)", file=sys.stderr)
        return 130
    return 0


def init_distributed(device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S
                     ) -> tuple[int, int, torch.device]:
    """Join the process group torchrun / elastic set up in the environment (gloo on CPU, NCCL
    on CUDA, one GPU per local rank).

    Args:
        device_type: "cpu" or "cuda".
        timeout_s: seconds a collective waits for the other ranks before it raises (--timeout;
            see [Note: timeouts]).

    Returns:
        (rank, world_size, this rank's device).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
        if "OMP_NUM_THREADS" not in os.environ:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
    return dist.get_rank(), dist.get_world_size(), device


class StopFlag:
    """Set by SIGINT (see [Note: interrupts]) while installed; read at step boundaries.

    Installs its handler on construction; `restore` puts the previous handler back.
    """

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def restore(self) -> None:
        """Reinstall the SIGINT handler that was in place before this flag."""
        signal.signal(signal.SIGINT, self._previous)
