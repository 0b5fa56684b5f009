"""``python -m flashfsdp.sim --preset 70b --world-size 64 --tp 8``: the overlap simulator's
prediction of one training step of a Llama preset on a (W / tp, tp) layout, per rank, with every
assumption it rests on (links, FLOP rate, dtypes, tokens) printed first.

Several ``--tp`` values give one row each, every TP group (a rank at tp = 1) computing ``--tokens``
tokens per step. GPU semantics (CUDA streams, no host contention); activations' memory is not
modelled.
"""

from __future__ import annotations

import argparse
import sys

import torch

from flashfsdp.models import PRESETS

from flashfsdp.estimate.pipeline import SCHEDULES

from .link import LINKS
from .pipeline import simulate_pipeline
from .simulate import simulate
from .tensor_parallel import llama_tp_model

PROG = "python -m flashfsdp.sim"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COLUMNS = ("tp", "dp", "step ms", "compute ms", "TP comm ms", "FSDP exposed ms", "efficiency",
           "FSDP GB/step", "TP GB/step", "peak GiB")


def build_parser() -> argparse.ArgumentParser:
    """The command line (see ``--help``)."""
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0].replace("``", ""))
    p.add_argument("--preset", required=True, choices=list(PRESETS), help="the Llama's shape")
    p.add_argument("--world-size", type=int, required=True, help="ranks in all (W = dp x tp)")
    p.add_argument("--tp", type=int, nargs="+", default=[1], metavar="N", help="TP degrees, one row each")
    p.add_argument("--tokens", type=int, default=8192, help="tokens of one TP group's step (default 8192)")
    p.add_argument("--flops", type=float, default=400e12, help="assumed achieved FLOP/s per GPU (default 400e12)")
    p.add_argument("--link", choices=list(LINKS), default="ib400", help="the data-parallel ranks' link")
    p.add_argument("--tp-link", choices=list(LINKS), default="nvlink", help="the TP ranks' link (within a node)")
    p.add_argument("--param-dtype", choices=list(DTYPES), default="bf16", help="parameters and activations")
    p.add_argument("--reduce-dtype", choices=list(DTYPES), default="fp32", help="the reduce-scatter's dtype")
    pipe = p.add_argument_group("pipeline parallelism: W = pp x dp x tp (one --tp value)")
    pipe.add_argument("--pp", type=int, metavar="N", help="pipeline ranks (with --microbatches)")
    pipe.add_argument("--microbatches", type=int, metavar="M", help="micro-batches per step")
    pipe.add_argument("--schedule", choices=SCHEDULES, default="1f1b")
    pipe.add_argument("--virtual-stages", type=int, metavar="V", help="stages per rank (interleaved1f1b; default 2)")
    pipe.add_argument("--microbatch-size", type=int, default=1, metavar="B", help="sequences per micro-batch")
    pipe.add_argument("--seq-len", type=int, metavar="S", help="tokens per sequence (default: the preset's)")
    pipe.add_argument("--pp-link", choices=list(LINKS), default="ib400", help="the pipeline's point-to-point link")
    return p


def _pipeline(args) -> str:
    """The pipeline prediction of ``args`` as text (ValueError naming the flags on bad sizes)."""
    if args.pp is None or args.microbatches is None or len(args.tp) != 1:
        raise ValueError("--pp N and --microbatches M go together, with one --tp value")
    p = simulate_pipeline(args.preset, args.world_size, pp=args.pp, microbatches=args.microbatches,
                          schedule=args.schedule, virtual_stages=args.virtual_stages, tp=args.tp[0],
                          microbatch_size=args.microbatch_size, seq_len=args.seq_len, flops_per_s=args.flops,
                          link=args.link, pp_link=args.pp_link, tp_link=args.tp_link,
                          param_dtype=DTYPES[args.param_dtype], reduce_dtype=DTYPES[args.reduce_dtype])
    worst = max(range(args.pp), key=lambda r: p.peak_bytes[r])
    return (f"Llama {args.preset}, W = {args.world_size}, pp = {args.pp}, {args.schedule}, M = {args.microbatches}, "
            f"{args.flops:.3g} FLOP/s per GPU (assumed), links (assumed) dp {args.link}, pp {args.pp_link}\n"
            f"step {p.step_s * 1e3:,.1f} ms = slowest stage's FSDP step {p.stage_s * 1e3:,.1f} ms / (1 - bubble "
            f"{p.bubble_fraction:.3f}) + fill/drain point-to-point {p.p2p_s * 1e3:,.2f} ms; bubble "
            f"{p.bubble_s * 1e3:,.1f} ms; {p.p2p_bytes_per_step / 1e9:,.2f} GB point-to-point per step and pipeline; "
            f"peak {p.peak_bytes[worst] / 2**30:,.1f} GiB on pp rank {worst} (activations without checkpointing)")


def _row(args, tp: int) -> dict:
    """One prediction as a table row."""
    model = llama_tp_model(args.preset, args.world_size, tp, tokens=args.tokens, flops_per_s=args.flops,
                           param_dtype=DTYPES[args.param_dtype], reduce_dtype=DTYPES[args.reduce_dtype])
    p = simulate(model, args.world_size, args.link, tp_link=args.tp_link)
    fsdp = sum(v for k, v in p.collective_bytes.items() if not k.startswith("tp_"))
    values = (tp, args.world_size // tp, p.step_s * 1e3, p.compute_s * 1e3, p.tp_comm_s * 1e3, p.exposed_s * 1e3,
              p.efficiency, fsdp / 1e9, (p.collective_bytes["tp_all_gather"] + p.collective_bytes["tp_reduce_scatter"]
                                         + p.collective_bytes["tp_all_reduce"]) / 1e9, p.peak_bytes / 2**30)
    return dict(zip(COLUMNS, values))


def _table(rows: list[dict]) -> str:
    cells = [[f"{v:.3f}" if k == "efficiency" else f"{v:,.1f}" if isinstance(v, float) else str(v)
              for k, v in r.items()] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(COLUMNS)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(COLUMNS, widths)), "  ".join("-" * w for w in widths)]
    return "\n".join(lines + ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells])


def main(argv: list[str] | None = None) -> int:
    """Print the assumptions and the predictions; exit status 2 with a one-line message on bad input."""
    args = build_parser().parse_args(argv)
    if args.pp is not None or args.microbatches is not None:
        try:
            print(_pipeline(args))
        except ValueError as err:
            print(f"{PROG}: error: {err}", file=sys.stderr)
            return 2
        return 0
    try:
        rows = [_row(args, tp) for tp in args.tp]
    except ValueError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    print(f"Llama {args.preset}, W = {args.world_size}, {args.tokens} tokens per TP group and step, "
          f"{args.flops:.3g} FLOP/s achieved per GPU (assumed), param_dtype {args.param_dtype}, "
          f"reduce_dtype {args.reduce_dtype}, fp32 master weights and AdamW state")
    print(f"links (assumed): data-parallel {LINKS[args.link].describe()}; TP {LINKS[args.tp_link].describe()}")
    print("ring collectives; TP collectives block the compute (sequence parallel: an all-gather before and a "
          "reduce-scatter after attention and the feed-forward), FSDP collectives overlap it; GPU streams, "
          "no activation memory\n")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
