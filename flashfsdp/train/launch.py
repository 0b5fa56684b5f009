"""The processes of `flashfsdp-train`: starting workers through torch's elastic launcher (what
torchrun runs) and reporting how they ended, and, in each worker, its device and joining the
process group (one node or many).

Under torchrun (the environment has TORCHELASTIC_RUN_ID) the process is already a worker.
Started plainly, it launches `--nproc` local copies of itself, `python -m flashfsdp.train ARGS`,
with `torch.distributed.launcher.api.elastic_launch`: a single-node c10d rendezvous (as
`torchrun --standalone`) whose stores listen on 127.0.0.1 only (`flashfsdp.train.rendezvous`),
with gloo's sockets on the loopback interface (GLOO_SOCKET_IFNAME), no restarts.

[Note: timeouts] Every collective of a worker waits at most `--timeout` seconds for the other
ranks (the process group's timeout): a rank that hangs or is stopped makes the others raise, the
agent sees them fail and ends the job (the hung rank gets SIGTERM, then SIGKILL after the
agent's shutdown timeout). A rank that dies closes its connections, so the others fail at their
next collective without waiting for the timeout.

[Note: interrupts] Started by torch's elastic agent (ours or a user's torchrun), workers run in
their own session: a Ctrl-C reaches only the agent, which forwards SIGINT to each worker once
and kills them after its shutdown timeout; SIGTERM takes the same path. A KeyboardInterrupt
raised at an arbitrary point would leave the ranks at different collectives, so each worker's
handler (`flashfsdp.train.stopping.StopFlag`) only records the signal; the ranks agree on it at
the end of each step and save the final checkpoint collectively (see [Note: stop signals] in
`flashfsdp.train.stopping`).

[Note: multi-node] Under a user's torchrun every node runs its own agent; they meet in torch's
c10d rendezvous (`--rdzv-backend c10d --rdzv-endpoint HOST:PORT`) and nothing of this module's
loopback launcher applies. A worker takes its GPU from LOCAL_RANK (its index on its node), its
rank from RANK, and the run directory of rank 0 (`agree_run_dir`): --out must name a directory
every node shares, as torch.distributed.checkpoint writes each rank's shards where that rank
runs and rank 0 writes the rest.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import tempfile
import uuid
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from flashfsdp.train.config import DEFAULT_TIMEOUT_S, PROG, parse_options
from flashfsdp.train.stopping import report_stop, stop_signal_of
from flashfsdp_cli.train_sections import BY_KEY

if TYPE_CHECKING:
    from flashfsdp.train.config import TrainConfig

# Seconds the agent waits for workers to save their final checkpoint after forwarding a SIGINT
# or SIGTERM before it kills them (torch's default is 30).
SHUTDOWN_TIMEOUT_S = 300

# Set in the environment of the workers `launch` starts: their parent already validated.
_LAUNCHED_ENV = "FLASHFSDP_TRAIN_LAUNCHED"
# The pid of the launcher (the elastic agent's process: the workers' parent), for the workers.
_LAUNCHER_PID_ENV = "FLASHFSDP_TRAIN_LAUNCHER_PID"


def under_torchrun() -> bool:
    """True in a worker started by torchrun / torch elastic (ours or the user's)."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def run_id() -> str:
    """The torch elastic run id of this worker's job (TORCHELASTIC_RUN_ID): the launcher's fresh
    uuid, or torchrun's --rdzv-id ("none" unless given); "none" outside torch elastic."""
    return os.environ.get("TORCHELASTIC_RUN_ID", "none")


def launched_by_us() -> bool:
    """True in a worker started by `launch` (rather than by a user's torchrun)."""
    return os.environ.get(_LAUNCHED_ENV) == "1"


def worker_parent() -> int:
    """The pid of the process that started this worker and must outlive it: `flashfsdp-train`'s
    launcher (recorded in the workers' environment), else its parent now (a user's torchrun)."""
    recorded = os.environ.get(_LAUNCHER_PID_ENV, "") if launched_by_us() else ""
    return int(recorded) if recorded.isdigit() else os.getppid()


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
        worker_argv: the command line of each worker (after the program name), with --out (the
            run directory, where the workers' final checkpoint is looked for after a stop).
        device_type: "cpu" or "cuda".

    The agent's log directory is a temporary one, removed when the workers end (torch's default
    would leave a `torchelastic_*` folder in the temporary directory after every run).

    Returns:
        0 when every worker succeeded; 128 + the signal number after SIGINT (130) or SIGTERM
        (143), with a line on stderr saying whether the workers saved a final checkpoint (see
        [Note: stop signals] in `flashfsdp.train.stopping`); otherwise the first failed worker's
        exit code (its own error message is already on stderr).
    """
    out = os.path.abspath(parse_options(worker_argv)[1]["run.out"])
    _worker_environment(nproc, device_type)
    with tempfile.TemporaryDirectory(prefix="flashfsdp-train-") as logs:  # the agent's, removed after
        return _run_agent(_launch_config(nproc, logs), worker_argv, out)


def _run_agent(config, worker_argv: list[str], out: str) -> int:
    """`launch`'s elastic agent run with `config`: the exit code (see `launch`)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    try:
        elastic_launch(config, sys.executable)("-u", "-m", "flashfsdp.train", *worker_argv)
    except ChildFailedError as err:
        return _report_failure(err, out, config.run_id)
    except SignalException as err:
        return report_stop(PROG, out, config.run_id, err.sigval)
    except KeyboardInterrupt:  # before the agent's handlers were installed: no worker started
        return report_stop(PROG, out, config.run_id, signal.SIGINT)
    return 0


def loopback_interface() -> str | None:
    """The name of this host's loopback network interface ("lo" on Linux, "lo0" on macOS), or None."""
    names = {name for _, name in socket.if_nameindex()} if hasattr(socket, "if_nameindex") else set()
    return next((name for name in ("lo", "lo0") if name in names), None)


def _worker_environment(nproc: int, device_type: str) -> None:
    """Set the environment the workers inherit: OMP_NUM_THREADS on CPU, `_LAUNCHED_ENV` and
    `_LAUNCHER_PID_ENV`,
    PYTHONPATH leading with the checkout that holds this `flashfsdp`, and GLOO_SOCKET_IFNAME the
    loopback interface unless set (one node: gloo's sockets stay on loopback, whatever this host's
    name resolves to)."""
    if device_type == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // nproc))
    loopback = loopback_interface()
    if loopback is not None and not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = loopback
    os.environ[_LAUNCHED_ENV] = "1"
    os.environ[_LAUNCHER_PID_ENV] = str(os.getpid())
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # .../flashfsdp
    root = os.path.dirname(package)
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (root, os.environ.get("PYTHONPATH")) if p)


def _launch_config(nproc: int, log_dir: str):
    """torch elastic's `LaunchConfig` of one node of `nproc` workers over the loopback
    rendezvous (`flashfsdp.train.rendezvous`), a fresh run id, no restarts, the agent's logs in
    `log_dir`."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    from flashfsdp.train.rendezvous import LOOPBACK, LOOPBACK_BACKEND

    return LaunchConfig(
        min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
        rdzv_backend=LOOPBACK_BACKEND, rdzv_endpoint=f"{LOOPBACK}:0", local_addr=LOOPBACK,
        max_restarts=0, monitor_interval=0.1, shutdown_timeout=SHUTDOWN_TIMEOUT_S,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )


def _report_failure(err, out: str, run_id: str) -> int:
    """The exit code of a launch that ended in `ChildFailedError` `err`, after a line on stderr.

    Workers that exited with a stop code (128 + SIGINT / SIGTERM) were stopped by a signal sent
    to them rather than to the launcher: reported as a stop (`report_stop`)."""
    stops = [stop_signal_of(f.exitcode) for f in err.failures.values()]
    stopped = next((sig for sig in stops if sig is not None), None)
    if stopped is not None:
        return report_stop(PROG, out, run_id, stopped)
    rank, failure = err.get_first_failure()
    killed = signal.Signals(-failure.exitcode).name if -failure.exitcode in signal.valid_signals() else None
    print(f"{PROG}: error: worker rank {rank} " + (f"was killed by {killed}; the other workers' messages are above"
          if killed else f"exited with code {failure.exitcode}; its message is above"), file=sys.stderr)
    return failure.exitcode if failure.exitcode > 0 else 1


def init_distributed(device_type: str, timeout_s: float = DEFAULT_TIMEOUT_S
                     ) -> tuple[int, int, torch.device]:
    """Join the process group torchrun / elastic set up in the environment (gloo on CPU, NCCL
    on CUDA, one GPU per local rank: `local_device`).

    Args:
        device_type: "cpu" or "cuda".
        timeout_s: seconds a collective waits for the other ranks before it raises (--timeout;
            see [Note: timeouts]).

    Returns:
        (rank, world_size, this rank's device).

    Raises:
        RuntimeError: see `local_device`.
    """
    device = local_device(device_type)
    timeout = datetime.timedelta(seconds=timeout_s)
    if device_type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
        if "OMP_NUM_THREADS" not in os.environ:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
    return dist.get_rank(), dist.get_world_size(), device


def local_device(device_type: str) -> torch.device:
    """This worker's device: the CPU, or the GPU numbered LOCAL_RANK, the worker's index on its
    own node (RANK, its index in the whole job, would overrun a node's GPUs from the second node
    on; see [Note: multi-node]).

    Raises:
        RuntimeError: on CUDA, LOCAL_RANK is not below this node's number of GPUs (the message
            gives both, and the torchrun option to change).
    """
    if device_type != "cuda":
        return torch.device("cpu")
    local_rank, gpus = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
    if local_rank >= gpus:
        raise RuntimeError(
            f"{PROG}: worker LOCAL_RANK={local_rank} needs GPU {local_rank}, but this node has "
            f"{gpus} CUDA device(s); start torchrun with --nproc-per-node {gpus} or fewer on "
            "this node (one worker per GPU), or train with --device cpu")
    return torch.device("cuda", local_rank)


# The config sections every rank must share: what each rank computes (a path to local files,
# --init-from, may differ between nodes).
AGREED_SECTIONS = ("model", "training", "optimizer", "sharding")
_LOCAL_KEYS = ("model.init_from",)


def _agreed_values(config: TrainConfig) -> dict:
    """This rank's option values of :data:`AGREED_SECTIONS` by dotted key."""
    return {key: value for key, value in config.values().items()
            if key.split(".", 1)[0] in AGREED_SECTIONS and key not in _LOCAL_KEYS}


def agree_run_dir(config: TrainConfig, resume_from: str | None
                  ) -> tuple[TrainConfig, str | None]:
    """Rank 0's run directory and checkpoint to resume from, for every rank (collective).

    Each worker resolves --out on its own, and under torchrun without --out the default
    `runs/<preset>-<time>` is made per process (from its own clock and working directory): every
    rank takes rank 0's (see [Note: multi-node]).

    Args:
        config: this rank's config.
        resume_from: the checkpoint this rank's checks found in its `config.run.out`, or None.

    Returns:
        (`config` with rank 0's `out`, rank 0's `resume_from`).

    The same collective checks that every rank was given the same options for what it computes
    (:data:`AGREED_SECTIONS`, e.g. `--tp`, `--lr`, `--seq-len`): ranks started with different ones
    would build different meshes or models and hang in their first collective.

    Raises:
        RuntimeError: on every rank, when the ranks' options differ (the message names each
            option and its value on every rank), or when resuming and the ranks found different
            checkpoints (--out names different directories on different nodes, or one that not
            every node shares); the message lists what each rank found.
    """
    from flashfsdp.runtime.agreement import all_gather_values  # noqa: PLC0415

    everyone = all_gather_values((config.run.out, resume_from, _agreed_values(config)))
    differing = sorted(key for key in everyone[0][2] if len({repr(e[2].get(key)) for e in everyone}) > 1)
    if differing:
        found = "; ".join(f"{BY_KEY[key].flag} ({key}): "
                          + ", ".join(f"rank {r}: {e[2].get(key)!r}" for r, e in enumerate(everyone))
                          for key in differing)
        raise RuntimeError(f"{PROG}: the ranks were started with different options ({found}); start every "
                           "worker with the same command line and --config file")
    out, first = everyone[0][:2]
    if any(e[1] != first for e in everyone):
        found = "; ".join(f"rank {r}: {e[1]} in {e[0]}" for r, e in enumerate(everyone))
        raise RuntimeError(
            f"{PROG}: --resume: the ranks found different checkpoints to continue from ({found}); "
            "give every node the same --out, on a file system they all share")
    if out == config.run.out:
        return config, resume_from
    return config.with_out(out), first
