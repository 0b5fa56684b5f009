"""``python -m flashfsdp.estimate --preset 8b --world-size 64 --pp 4 --microbatches 8``: the
pipeline-parallel estimate of the command line (``pipeline.py``; ``pipeline_report.py`` prints it).
Bad sizes are one line on stderr naming the flags, exit code 2."""

from __future__ import annotations

import sys

from flashfsdp import MixedPrecisionPolicy  # the public name (the CLI is an application of the library)

from .pipeline import estimate_pipeline
from .pipeline_report import pipeline_table


def _check_flags(args) -> None:
    """The combinations the pipeline estimate needs (ValueError naming the flags)."""
    if args.pp is None or args.microbatches is None:
        raise ValueError("--pp N and --microbatches M go together (pipeline parallelism)")
    if args.hf_config:
        raise ValueError("--pp needs --preset (a flashfsdp Llama, whose blocks split into stages), not --hf-config")
    if args.hsdp is not None or args.sharding == "grad_op":
        raise ValueError("--pp: each stage is fully sharded over its dp ranks; drop --hsdp / --sharding grad_op")


def print_pipeline(args, prog: str, dtypes: dict) -> int:
    """Compute and print the pipeline estimate of ``args``; 0, or 2 with a one-line message."""
    try:
        _check_flags(args)
        master, param = dtypes[args.master_dtype or "fp32"], dtypes[args.param_dtype or args.master_dtype or "fp32"]
        policy = MixedPrecisionPolicy(param_dtype=param,
                                      reduce_dtype=dtypes[args.reduce_dtype] if args.reduce_dtype else None)
        est = estimate_pipeline(args.preset, args.world_size, pp=args.pp, microbatches=args.microbatches,
                                schedule=args.schedule, virtual_stages=args.virtual_stages, tp=args.tp,
                                microbatch_size=args.microbatch_size, seq_len=args.seq_len, master_dtype=master,
                                mp_policy=policy, optimizer=args.optimizer,
                                reshard_after_forward=args.reshard_after_forward, max_inflight=args.max_inflight,
                                bucket_bytes=args.bucket_bytes)
    except ValueError as err:
        print(f"{prog}: error: {err}", file=sys.stderr)
        return 2
    print(f"Llama {args.preset}: W = {est.world_size} = (pp, dp, tp) ({est.pp}, {est.dp}, {est.tp}); {est.schedule}, "
          f"{est.microbatches} micro-batches of {est.microbatch_size} x {est.seq_len} tokens; dtypes: "
          f"{str(master).replace('torch.', '')} master weights, gradients and {args.optimizer} state, param_dtype "
          f"and activations {str(param).replace('torch.', '')}; activations without checkpointing\n")
    print(pipeline_table(est))
    return 0
