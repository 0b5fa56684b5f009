"""`flashfsdp-train`: train a byte-level Llama-style language model, sharded with flashfsdp.

    flashfsdp-train --preset tiny --steps 300            # 2 CPU workers, Python stdlib corpus
    flashfsdp-train --preset 1b --data corpus/ --out runs/1b
    flashfsdp-train --out runs/1b --resume --nproc 4     # continue at another number of ranks
    torchrun --nproc-per-node 8 -m flashfsdp.train --preset 1b

Started plainly it checks the arguments, then launches its workers through torch's elastic
launcher (`flashfsdp.train_launch`); under torchrun it is a worker (`flashfsdp.train_loop`).
Bad input exits with code 2 and one line on stderr naming the problem and the fix.
"""

from __future__ import annotations

import os
import sys

from flashfsdp.data import Corpus
from flashfsdp.train_args import UsageError, build_parser, model_config, resolve
from flashfsdp.train_checks import (check_batch, check_data, check_fit, check_nproc, check_out,
                                    resolve_device)
from flashfsdp.train_launch import launch, launched_by_us, under_torchrun


def _validate(args, world_size: int, local_world: int, device_type: str) -> Corpus:
    """All the checks that need no process group (see `flashfsdp.train_checks`); returns the
    loaded corpus."""
    cfg = model_config(args)
    check_batch(args, world_size)
    check_fit(args, cfg, world_size, local_world, device_type)
    corpus = check_data(args, cfg.max_seq_len, world_size)
    check_out(args)
    return corpus


def main(argv: list[str] | None = None) -> int:
    """Entry point of `flashfsdp-train` and `python -m flashfsdp.train`; returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    worker = under_torchrun()
    try:
        device_type = resolve_device(args.device)
        # Our own workers repeat the checks of their parent but not its warnings.
        resolve(args, device_type, warn=not (worker and launched_by_us()))
        if worker:
            world = int(os.environ["WORLD_SIZE"])
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        else:
            world = local_world = check_nproc(args.nproc, device_type)
        corpus = _validate(args, world, local_world, device_type)
    except UsageError as err:
        if not worker or os.environ.get("RANK", "0") == "0":
            print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted before training started", file=sys.stderr)
        return 130
    if worker:
        from flashfsdp.train_loop import run_worker

        return run_worker(args, device_type, corpus)
    return launch(world, argv + ["--out", args.out, "--device", device_type], device_type)


if __name__ == "__main__":
    sys.exit(main())
