"""Starting `flashfsdp-train`'s workers through torch's own elastic launcher (what torchrun runs).

Under torchrun (the environment has TORCHELASTIC_RUN_ID) the process is already a worker.
Started plainly, it launches `--nproc` local copies of itself, `python -m flashfsdp.train ARGS`,
with `torch.distributed.launcher.api.elastic_launch`: a single-node c10d rendezvous on a free
127.0.0.1 port (as `torchrun --standalone`), no restarts.
"""

from __future__ import annotations

import os
import sys
import uuid

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


def launch(nproc: int, worker_argv: list[str], device_type: str) -> int:
    """Run `nproc` local workers of `python -m flashfsdp.train worker_argv` and wait for them.

    CPU workers get OMP_NUM_THREADS = usable cores / nproc (unless already set), and PYTHONPATH
    leads with this package's parent directory, so an uninstalled checkout works too.

    Returns:
        0 when every worker succeeded; 130 after a Ctrl-C (the workers save a final checkpoint
        first, see train_loop's [Note: interrupts]); otherwise the first failed worker's exit
        code (its own error message is already on stderr).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // nproc))
    os.environ[_LAUNCHED_ENV] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)
    config = LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", local_addr="127.0.0.1",
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
