"""flashfsdp.estimate beside DeepSpeed's ZeRO-3 formula, for Llama-3 8B and 70B.

    python -m benchmarks.estimate [--out DIR | --record]

Per rank: flashfsdp's model states (fp32 master and gradient shards, AdamW's two fp32 moments),
the unsharded parameters at their peak (the units the runtime's prefetch policy holds at once),
the step's transient peak and the total (activations excluded); DeepSpeed's
``estimate_zero3_model_states_mem_needs`` without offload (4 bytes per parameter of the largest
layer + 18 bytes per parameter / W; written out in ``flashfsdp/estimate/deepspeed.py``). Per step:
the bytes each rank sends and their ratio to DDP's all-reduce. Also the time the estimate takes
(shapes only, on the meta device). Writes ``estimate.{csv,md}`` to ``bench-results/cpu/``
(``--record``: ``benchmarks/results/cpu/``).
"""

from __future__ import annotations

import argparse
import time

import torch

from flashfsdp.bindings.mixed_precision import MixedPrecisionPolicy
from flashfsdp.estimate import estimate, model_params, zero3_model_states
from flashfsdp.models import PRESETS, Llama

from .environment import environment, environment_columns
from .outputs import add_output_arguments, output_dir
from .tables import format_table, write_csv, write_markdown

GIB = 2**30
WORLD_SIZES = (8, 64, 512)
POLICIES = {"bf16/fp32": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
            "fp32": MixedPrecisionPolicy()}
COLUMNS = ["model", "dtypes", "W", "params_B", "states_GiB", "unsharded_GiB", "units_at_peak", "step_peak_GiB",
           "total_GiB", "deepspeed_GiB", "total_vs_deepspeed", "sent_GiB", "sent_vs_ddp", "estimate_ms"]


def row(preset: str, dtypes: str, world_size: int, counts: tuple[int, int]) -> dict:
    """One model × dtypes × W row."""
    start = time.perf_counter()
    est = estimate(preset, world_size, mp_policy=POLICIES[dtypes])
    ms = (time.perf_counter() - start) * 1e3
    ds = zero3_model_states(*counts, num_nodes=world_size).gpu_bytes
    return {"model": f"Llama-{preset.upper()}", "dtypes": dtypes, "W": world_size, "params_B": est.num_params / 1e9,
            "states_GiB": est.model_state_bytes / GIB, "unsharded_GiB": est.params_peak_bytes / GIB,
            "units_at_peak": len(est.units_at_peak), "step_peak_GiB": est.transient_peak_bytes / GIB,
            "total_GiB": est.total_bytes / GIB, "deepspeed_GiB": ds / GIB, "total_vs_deepspeed": est.total_bytes / ds,
            "sent_GiB": est.comm.sent / GIB, "sent_vs_ddp": est.comm.ratio_to_ddp, "estimate_ms": ms}


def main(argv: list[str] | None = None) -> list[dict]:
    """Print the table and write it (see the module docstring); returns the rows."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.estimate", description=__doc__.splitlines()[0])
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    env = environment(torch.device("cpu"))
    rows = []
    for preset in ("8b", "70b"):
        with torch.device("meta"):
            counts = model_params(Llama(PRESETS[preset]))
        rows += [dict(row(preset, dtypes, w, counts), **env.stamp()) for dtypes in POLICIES for w in WORLD_SIZES]
    print(format_table(rows, COLUMNS))
    out = output_dir(env.slug, out=args.out, record=args.record)
    write_csv(rows, out / "estimate.csv")
    notes = [
        "Per rank, activations excluded. states: fp32 master + gradient shards + AdamW's two fp32 moments; "
        "unsharded: the parameters gathered at once at the peak (units_at_peak units: the root, which the "
        "default keeps for the backward, the unit computing and the one prefetched); step_peak: everything the "
        "step allocates on top of the states (unsharded parameters and gradients, reduce-scatter buffers); "
        "total = states + step_peak.",
        "deepspeed: estimate_zero3_model_states_mem_needs without offload, 4 bytes per parameter of the largest "
        "layer (the 128K x dim embedding) + 18 bytes per parameter / W: model states and one gathered layer only, "
        "no gradients of the unit in backward, no prefetch, no reduce buffers.",
        "sent: bytes each rank sends per step (ring all-gather forward and backward, reduce-scatter); sent_vs_ddp: "
        "against DDP's all-reduce of the same gradients (1.5 for ZeRO-3 with equal dtypes; bf16 gathers with fp32 "
        "reductions come to about 1).",
    ]
    write_markdown(rows, COLUMNS + environment_columns(), out / "estimate.md",
                   title="Memory and communication estimate vs DeepSpeed's ZeRO-3 formula", env=env, notes=notes)
    return rows


if __name__ == "__main__":
    main()
