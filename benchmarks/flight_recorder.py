"""What the flight recorder costs, against the host-bound training step, and profile()'s memory per span.

    python -m benchmarks.flight_recorder [--steps 20] [--rounds 5] [--record | --out DIR]

The recorder is always on, so its cost must vanish next to the step where the runtime's host work
matters most: ``benchmarks.step --host-bound`` (48 tiny blocks + the root, W = 1). Rows:

- ``record_us`` / ``hook_us``: the host time of one collective's bookkeeping (record, name the
  unit, waiting, completed) and of one unit hook's (enter and exit), each the median of rounds
  of 100 000 calls.
- ``step_ms``: the host-bound step (flashfsdp, W = 1), median of ``--steps`` steps after warm-up.
- ``bound_pct``: the recorder's share of that step, from the counts a W = 2 step of the same model
  makes (its recorded collectives, read from the ring, and four hooks per unit): at W = 1 the
  communicators are local and record nothing, so this prices the multi-rank step's bookkeeping
  against the host-bound step.
- ``w2_on_ms`` / ``w2_off_ms``: the same model at W = 2 (gloo), steps with the ring on and off
  (``flight.configure``), interleaved over ``--rounds`` rounds, median of the rounds' medians:
  a direct A/B, noisy on a shared 2-core machine (the hooks' context updates run in both).
- ``profile_bytes_per_span``: the Python memory (tracemalloc) a plain ``flashfsdp.profile()``
  holds per recorded span after ``--steps`` W = 1 steps, and ``aggregate_bytes_per_step``: what
  ``profile(aggregate=True)`` holds per step over the same steps (constant: ~0).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tracemalloc

import torch
import torch.nn as nn

from benchmarks.environment import environment
from benchmarks.outputs import add_output_arguments, output_dir
from benchmarks.step import HOST_BOUND
from benchmarks.tables import format_table, write_csv, write_markdown
from benchmarks.timing import per_call_us
from flashfsdp_dev.ranks import run_ranks

COLUMNS = ("record_us", "hook_us", "collectives_per_step", "hooks_per_step", "step_ms", "bound_us", "bound_pct",
           "w2_on_ms", "w2_off_ms", "profile_bytes_per_span", "aggregate_bytes_per_step")
CALLS = 100_000
PROFILE_WARMUP = 15  # profiled steps before the memory is measured (the allocator's pools settle)
NOTES = [
    "record_us: one collective's bookkeeping (record, name the unit, waiting, completed); hook_us: one unit "
    "hook's (enter, exit); each the median of 5 rounds of 100 000 calls.",
    "step_ms: the host-bound step (benchmarks.step --host-bound's model: 48 blocks of dim 32 + the root, W = 1, "
    "AdamW), median of the steps after 3 warm-up steps.",
    "bound_us / bound_pct: collectives_per_step x record_us + hooks_per_step x hook_us, against step_ms; the "
    "collectives are those one W = 2 step of the same model records (at W = 1 nothing is recorded).",
    "w2_on_ms / w2_off_ms: the same model at W = 2 (gloo), the ring on and off, interleaved rounds (median of the "
    "rounds' medians, slowest rank): a direct A/B within the noise of a shared 2-core machine.",
    "profile_bytes_per_span: tracemalloc growth of a plain flashfsdp.profile() per recorded span over the steps "
    "(W = 1), after 15 profiled steps; aggregate_bytes_per_step: the growth per step of profile(aggregate=True), "
    "likewise: the runtime's own short-lived objects (tracemalloc's net count moves by a few hundred bytes a step "
    "either way), the aggregating profile itself holding one step's spans.",
]


def bookkeeping_us() -> tuple[float, float]:
    """(µs per collective's bookkeeping, µs per hook's), see the module docstring."""
    from flashfsdp.runtime import flight  # noqa: PLC0415

    class Owner:
        parent = object()  # not a root: no step counted

    owner, group = Owner(), (0, 1)

    def collective():
        entry = flight.record("all_gather", group, 4096)
        entry.unit = "layers.0"
        flight.waiting(entry)
        flight.completed(entry)

    def hook():
        flight.exit_hook(flight.enter_hook("pre_forward", owner, "layers.0"))

    flight.configure()
    try:
        return per_call_us(collective, calls=CALLS), per_call_us(hook, calls=CALLS)
    finally:
        flight.configure()


def _host_bound_model():
    import flashfsdp  # noqa: PLC0415
    from flashfsdp.models.llama import Llama, LlamaConfig  # noqa: PLC0415

    config = LlamaConfig(dim=HOST_BOUND["dim"], n_layers=HOST_BOUND["layers"], n_heads=HOST_BOUND["heads"],
                         max_seq_len=HOST_BOUND["seq"])
    model = Llama(config)
    model.init_weights(0)
    for block in model.layers:
        flashfsdp.fully_shard(block)
    return flashfsdp.fully_shard(model)


def _stepper(model: nn.Module, rank: int):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1000 + rank)

    def step() -> float:
        tokens = torch.randint(0, 256, (HOST_BOUND["batch"], HOST_BOUND["seq"] + 1), generator=gen)
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) * 1e3

    return step


def _w2_rank(rank: int, world_size: int, steps: int, rounds: int) -> dict:
    """One rank at W = 2: the collectives one step records, then on/off rounds of steps."""
    from flashfsdp.kernels.dispatch import use_backend  # noqa: PLC0415
    from flashfsdp.runtime import flight  # noqa: PLC0415

    torch.set_num_threads(1)
    with use_backend("reference"):
        step = _stepper(_host_bound_model(), rank)
        for _ in range(3):
            step()
        flight.configure()
        step()
        recorded = len([e for e in flight.entries() if e.kind != "control"])
        medians = {"on": [], "off": []}
        for _ in range(rounds):
            for mode in ("on", "off"):
                flight.configure(flight.DEFAULT_ENTRIES if mode == "on" else 0)
                medians[mode].append(statistics.median(step() for _ in range(steps)))
        flight.configure()
    return {"collectives": recorded, "on": statistics.median(medians["on"]), "off": statistics.median(medians["off"])}


def _w1_rank(rank: int, world_size: int, steps: int) -> dict:
    """At W = 1: the host-bound step time, then profile()'s memory per span and per step."""
    import flashfsdp  # noqa: PLC0415
    from flashfsdp.kernels.dispatch import use_backend  # noqa: PLC0415

    torch.set_num_threads(1)
    with use_backend("reference"):
        model = _host_bound_model()
        step = _stepper(model, rank)
        for _ in range(3):
            step()
        step_ms = statistics.median(step() for _ in range(steps))
        out = {"step_ms": step_ms, "units": sum(1 for m in model.modules() if m.__dict__.get("_flashfsdp_state"))}
        for aggregate in (False, True):
            step()
            tracemalloc.start()
            with flashfsdp.profile("cpu", aggregate=aggregate) as prof:
                for _ in range(PROFILE_WARMUP):  # once-only allocations are not the profile's growth
                    step()
                base = tracemalloc.get_traced_memory()[0]
                first = len(prof.spans) if not aggregate else 0
                for _ in range(steps):
                    step()
                grown = tracemalloc.get_traced_memory()[0] - base
                spans = len(prof.spans) - first
            tracemalloc.stop()
            if aggregate:
                out["aggregate_bytes_per_step"] = grown / steps
            else:
                out["profile_bytes_per_span"] = grown / max(1, spans)
    return out


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table, write flight_recorder.csv / .md."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.flight_recorder", description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per measurement (default 20)")
    parser.add_argument("--rounds", type=int, default=5, help="on/off rounds at W = 2 (default 5)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1")
    env = environment(torch.device("cpu"))
    record_us, hook_us = bookkeeping_us()
    w1 = run_ranks(_w1_rank, 1, args.steps)[0]
    w2 = max(run_ranks(_w2_rank, 2, args.steps, args.rounds), key=lambda r: r["on"])
    hooks = 4 * w1["units"]
    bound_us = w2["collectives"] * record_us + hooks * hook_us
    row = {"record_us": record_us, "hook_us": hook_us, "collectives_per_step": w2["collectives"],
           "hooks_per_step": hooks, "step_ms": w1["step_ms"], "bound_us": bound_us,
           "bound_pct": 100 * bound_us / 1e3 / w1["step_ms"], "w2_on_ms": w2["on"], "w2_off_ms": w2["off"],
           "profile_bytes_per_span": w1["profile_bytes_per_span"],
           "aggregate_bytes_per_step": w1["aggregate_bytes_per_step"], **env.stamp()}
    print(format_table([row], COLUMNS))
    folder = output_dir(env.slug, out=args.out, record=args.record)
    write_csv([row], folder / "flight_recorder.csv")
    write_markdown([row], COLUMNS, folder / "flight_recorder.md", title="Flight recorder cost", env=env,
                   notes=NOTES + [f"--steps {args.steps}, --rounds {args.rounds}."])
    return 0


if __name__ == "__main__":
    sys.exit(main())
