"""The entry point of `flashfsdp-train` and `python -m flashfsdp.train` once its command line
passed `flashfsdp_cli.train.precheck` (the console script checks it before importing torch).

Started plainly it builds the run's `TrainConfig`, takes the run directory's lock
(`flashfsdp.train.run_lock`), runs the checks, then launches its workers through torch's elastic
launcher (`flashfsdp.train.launch`) and holds the lock until they end; under torchrun it is a
worker and trains (`flashfsdp.train.trainer`). Bad input exits with code 2 and one line on stderr
naming the problem and the fix. Progress messages and notices go through the `flashfsdp` logger
(`flashfsdp.log`), shown from the ranks of --log-ranks.
"""

from __future__ import annotations

import os
import sys

from tqdm import tqdm

from flashfsdp import log
from flashfsdp.train.checks import check_nproc, check_writable, validate
from flashfsdp.train.config import PROG, TrainConfig, UsageError, parse_options
from flashfsdp.train.launch import launch, launched_by_us, under_torchrun, worker_parent, worker_world
from flashfsdp.train.run_lock import RunLock, register_worker
from flashfsdp.train.stopping import watch_parent


def _tqdm_line(line: str) -> None:
    """Write a log line above any progress bar (`tqdm.write`), on stderr."""
    tqdm.write(line, file=sys.stderr)


def configure_logging(argv: list[str]) -> None:
    """Show the `flashfsdp` logger's INFO records on stderr, from the ranks of argv's --log-ranks
    (rank 0 when not given there; a --config file's value applies once the config is resolved).

    Raises:
        SystemExit: argv does not parse (code 2, argparse's one line).
        UsageError: an invalid --log-ranks.
    """
    ranks = parse_options(argv)[1]["logging.log_ranks"] or "0"
    try:
        log.configure(ranks, prefix=PROG, write=_tqdm_line)
    except ValueError as err:
        raise UsageError(f"--log-ranks: {err}") from None


def main(argv: list[str] | None = None) -> int:
    """Run `flashfsdp-train` with `argv` (default: `sys.argv[1:]`); returns the exit code.

    Exit codes: 0 done; 2 bad input (one line on stderr; argparse errors exit through
    SystemExit(2)), or --out held by another run; 130 / 143 stopped by SIGINT / SIGTERM (a line on
    stderr says whether the workers saved a final checkpoint); otherwise the first failed
    worker's code.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["export"]:  # `flashfsdp-train export --out RUN --to DIR`: a Hugging Face folder
        from flashfsdp.train.export import main as export_main

        return export_main(argv[1:])
    worker = under_torchrun()
    lock = None
    if worker:  # a worker ends with its launcher ([Note: a launcher killed alone] in stopping.py)
        watch_parent(worker_parent(), PROG)
    try:
        configure_logging(argv)
        # Our own workers repeat the checks of their parent but not its warnings.
        config = TrainConfig.from_argv(argv, warn=not (worker and launched_by_us()))
        log.set_log_ranks(config.logging.log_ranks)
        if worker:
            if launched_by_us():  # the run directory is ours until we end, whatever our launcher does
                register_worker(config.run.out)
            world_size, local_world = worker_world()
        else:
            world_size = local_world = check_nproc(config.run.nproc, config.run.device)
            check_writable(config.run.out)
            lock = RunLock.acquire(config.run.out, command=f"{PROG} (launcher of {world_size} workers)")
        inputs = validate(config, world_size, local_world)
    except UsageError as err:
        if lock is not None:
            lock.release()
        if not worker or os.environ.get("RANK", "0") == "0":
            print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if lock is not None:
            lock.release()
        print(f"{PROG}: interrupted before training started", file=sys.stderr)
        return 130
    if worker:
        from flashfsdp.train.trainer import run_worker

        return run_worker(config, inputs.corpus, inputs.resume_from, hold_lock=not launched_by_us())
    with lock:
        return launch(world_size, argv + ["--out", config.run.out, "--device", config.run.device], config.run.device)
