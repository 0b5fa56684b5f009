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

from .link import LINKS
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
    return p


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
