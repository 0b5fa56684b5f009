"""float16 with dynamic loss scaling vs bfloat16: the training job's validation loss, same seed.

Runs ``flashfsdp-train`` (the tiny preset, 2 ranks by default) once per compute dtype, from the
same seed, data order and learning-rate schedule, and compares the final validation loss: the
target is float16 (``--param-dtype fp16``, ``flashfsdp.ShardedGradScaler`` unscaling in the
reduction's pass) within 2% of bfloat16. Also reported: the optimizer steps float16 skipped for
an overflowing gradient, and each run's throughput (on a CPU without native float16 matrix
products the float16 run is much slower: the figures compare accuracy, not speed).

    python -m benchmarks.fp16 [--steps 200] [--nproc 2] [--dtypes bf16 fp16] [--out DIR | --record]

Writes ``fp16.csv`` and ``fp16.md`` to ``bench-results/<device>/`` (``--record``:
``benchmarks/results/<device>/``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.environment import environment
from benchmarks.outputs import add_output_arguments, output_dir
from benchmarks.tables import format_table, write_csv, write_markdown

COLUMNS = ["param_dtype", "steps", "val_loss", "vs_bf16", "overflow_steps", "tokens_per_s", "wall_s"]
TARGET = 0.02  # float16's final validation loss within 2% of bfloat16's


def run_job(dtype: str, steps: int, nproc: int, out: Path) -> dict:
    """One ``flashfsdp-train`` run; returns its ``summary.json``."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # CPU: the reference kernels
    args = [sys.executable, "-m", "flashfsdp.train", "--preset", "tiny", "--steps", str(steps),
            "--nproc", str(nproc), "--param-dtype", dtype, "--out", str(out), "--sample-tokens", "0",
            "--save-every", str(steps), "--eval-every", str(max(1, steps // 4))]
    done = subprocess.run(args, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"flashfsdp-train --param-dtype {dtype} failed:\n{done.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the jobs, print the table, write the results; returns the rows."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.fp16", description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp16"], choices=["bf16", "fp16", "fp32"])
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    env = environment(torch.device("cpu"))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes:
            summary = run_job(dtype, args.steps, args.nproc, Path(tmp) / dtype)
            rows.append({"param_dtype": dtype, "steps": summary["step"], "val_loss": summary["val_loss"],
                         "overflow_steps": summary.get("overflow_steps"),
                         "tokens_per_s": summary["tokens_per_s"], "wall_s": summary["wall_s"], **env.stamp()})
    base = next((r["val_loss"] for r in rows if r["param_dtype"] == "bf16"), None)
    for row in rows:
        row["vs_bf16"] = None if base is None else row["val_loss"] / base - 1.0
    print(format_table(rows, COLUMNS))
    out = output_dir(env.slug, out=args.out, record=args.record)
    write_csv(rows, out / "fp16.csv")
    notes = [f"tiny preset, {args.nproc} ranks, {args.steps} steps, the same seed and data order per dtype; "
             f"vs_bf16 = val_loss / bf16's - 1 (target: |vs_bf16| <= {TARGET:.0%} for fp16)",
             "fp16: flashfsdp.ShardedGradScaler (initial scale 2**16), gradients reduced in fp32"]
    write_markdown(rows, COLUMNS, out / "fp16.md", title="float16 with loss scaling vs bfloat16", env=env, notes=notes)
    return rows


if __name__ == "__main__":
    main()
