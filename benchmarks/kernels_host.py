"""Host-side cost of flatten / unflatten per call: the op's validation and segment table against a
launch plan's check, without launching (so it runs on any machine, CPU included).

Run ``python -m benchmarks.kernels --host-only`` (``--help`` for the options). For each case of the
kernel benchmark (1000 small tensors; one Llama-style block at hidden size h) and each op, on
tensors of the chosen device:

- ``op: validation + table`` — what every call of ``flatten`` / ``unflatten`` does on the host
  before its launch: the shared validation (``validate_flatten`` / ``validate_unflatten``) and
  the launcher's segment table (``flatten_table`` / ``unflatten_table``; on CUDA that includes the
  device-table cache's lookup);
- ``plan: check`` — what a ``FlattenPlan`` / ``UnflattenPlan`` run does on the host before the same
  launch once its table is kept: ``is_current`` (the flat buffer's O(1) checks, one pass over the
  tensors' addresses; ``check_scale`` too for flatten).

Both leave out what they share: the backend choice and the kernel launch itself. Each figure is the
median over ``--repeats`` of the mean of ``--calls`` calls. Results go to ``kernels_host.{csv,md}``
in ``bench-results/<device>/`` (``--record``: ``benchmarks/results/<device>/``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

import flashfsdp.kernels as kernels
from benchmarks.environment import Environment, environment_columns
from benchmarks.tables import write_csv, write_markdown
from benchmarks.timing import per_call_us
from flashfsdp.kernels.flatten import flatten_table
from flashfsdp.kernels.unflatten import unflatten_table
from flashfsdp.kernels.validation import check_scale, validate_flatten, validate_unflatten

COLUMNS = ["op", "case", "tensors", "impl", "us_per_call", "ns_per_tensor", "speedup"]


def host_calls(op: str, tensors: list[torch.Tensor], offsets: list[int],
               flat: torch.Tensor) -> dict[str, Callable[[], object]]:
    """The two host-side preparations of ``op`` between ``tensors`` at ``offsets`` and ``flat``."""
    if op == "flatten":
        plan = kernels.FlattenPlan(tensors, offsets)

        def prepare():
            checked, items, _ = validate_flatten(tensors, offsets, flat, 1.0, None)
            return flatten_table(checked, items, flat)

        def check():
            return plan.is_current(flat) and check_scale("flatten", 1.0)
    else:
        plan = kernels.UnflattenPlan(offsets, tensors)

        def prepare():
            checked, items = validate_unflatten(flat, offsets, tensors)
            return unflatten_table(flat, checked, items)

        def check():
            return plan.is_current(flat)
    if not plan.prepare(flat) or not check():
        raise RuntimeError(f"kernels_host: the {op} plan kept no table")
    return {"op: validation + table": prepare, "plan: check": check}


def host_rows(op: str, case: str, tensors: list[torch.Tensor], offsets: list[int], flat: torch.Tensor,
         env: Environment, *, calls: int, repeats: int) -> list[dict]:
    """Time both preparations of ``op`` into rows (see the module docstring)."""
    times = {impl: per_call_us(fn, calls=calls, rounds=repeats)
             for impl, fn in host_calls(op, tensors, offsets, flat).items()}
    slowest = max(times.values())
    return [{"op": op, "case": case, "tensors": len(tensors), "impl": impl, "us_per_call": us,
             "ns_per_tensor": us * 1e3 / len(tensors), "speedup": slowest / us, **env.stamp()}
            for impl, us in times.items()]


def save(rows: list[dict], env: Environment, directory: Path, calls: int, repeats: int) -> None:
    """Write kernels_host.csv and kernels_host.md into ``directory``."""
    write_csv(rows, directory / "kernels_host.csv")
    notes = [
        "Host time per call before the launch, fp32 tensors into a bf16 buffer: the op's validation + segment "
        "table vs a kept launch plan's check (is_current); neither includes the backend choice or the launch.",
        f"us_per_call: median of {repeats} means of {calls} calls; ns_per_tensor: us_per_call / tensors; speedup: "
        "the slower row's time over this row's.",
    ]
    write_markdown(rows, COLUMNS + environment_columns(), directory / "kernels_host.md",
                   title="flashfsdp kernels: host time per call", env=env, notes=notes)
    print(f"wrote {directory}/kernels_host.csv, kernels_host.md")

