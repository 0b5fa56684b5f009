"""Bytes that cross the "node" dimension per training step, counted from the collectives a real
step issued: bf16 FSDP against ZeRO++'s pieces (qwZ int8 all-gathers, hpZ's intra-node secondary
shard, qgZ's quantized hierarchical gradient reduction), on W = 4 ranks playing 2 nodes of 2.

    python -m benchmarks.qgz [--steps 3] [--record | --out DIR]

Every rank trains the same small Llama (each block and the root a unit, AdamW, bf16 compute) for
``--steps`` warm-up steps, then one measured step whose flight-recorder entries are read back.
Ranks ``r`` and ``r'`` share a node when ``r // 2 == r' // 2``. What crosses nodes is counted per
entry from its kind, its group (global ranks) and the bytes this rank sends (its input), each
collective taken as the direct exchange it is on gloo here (the reduce-scatter an all-to-all and
a local sum; the all-to-all hops of qgZ as they are):

- all-gather: this rank's input goes to every other rank of the group: ``nbytes`` per rank of the
  group on another node;
- reduce-scatter and all-to-all: 1/|group| of the input goes to each rank of the group:
  ``nbytes / |group|`` per rank on another node;
- all-reduce (none in these configurations) and control messages: not counted (listed apart).

The table gives, per configuration, the most any rank sent across nodes in the measured step,
the ratio to bf16 FSDP's, the bytes sent within nodes, and the losses of the steps (the same
seed and data for every configuration). Source of the pieces: Wang et al. 2023, "ZeRO++:
Extremely Efficient Collective Communication for Giant Model Training" (arXiv 2306.10209).
"""

from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.environment import environment
from benchmarks.outputs import add_output_arguments, output_dir
from benchmarks.tables import format_table, write_csv, write_markdown

WORLD_SIZE, LOCAL_SIZE = 4, 2
CONFIGS = ("bf16", "qwZ", "qwZ+hpZ", "qwZ+hpZ+qgZ(int8)", "qwZ+hpZ+qgZ(int4)")
COLUMNS = ("config", "cross_node_MB", "vs_bf16", "intra_node_MB", "uncounted", "losses")


def crossing_bytes(entries: list, rank: int, local_size: int) -> tuple[float, float, list[str]]:
    """``(bytes sent to ranks of other nodes, bytes sent within the node, kinds not counted)`` of
    this rank's ``entries`` (flight-recorder entries), by the rules of the module docstring.

    Raises:
        ValueError: ``local_size`` below 1.
    """
    if local_size < 1:
        raise ValueError(f"crossing_bytes: local_size must be >= 1, got {local_size}")
    node = rank // local_size
    cross = intra = 0.0
    skipped = []
    for e in entries:
        others = [r for r in e.group if r != rank]
        far = sum(1 for r in others if r // local_size != node)
        if e.kind == "all_gather":
            per_peer = float(e.nbytes)
        elif e.kind in ("reduce_scatter", "all_to_all") or e.kind.startswith("all_to_all"):
            per_peer = e.nbytes / max(1, len(e.group))
        else:
            skipped.append(e.kind)
            continue
        cross += per_peer * far
        intra += per_peer * (len(others) - far)
    return cross, intra, skipped


def _policy(config: str):
    import flashfsdp  # noqa: PLC0415

    kwargs = dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    if config.startswith("qwZ"):
        kwargs["all_gather_dtype"] = torch.int8
    if "qgZ" in config:
        bits = 4 if "int4" in config else 8
        kwargs["reduce_quantization"] = flashfsdp.QuantizedReduce(bits=bits, local_size=LOCAL_SIZE)
    return flashfsdp.MixedPrecisionPolicy(**kwargs)


def _measure(rank: int, world_size: int, config: str, steps: int) -> dict:
    """One rank's run of ``config``: warm-up steps, then one measured step's crossing bytes."""
    import flashfsdp  # noqa: PLC0415
    from flashfsdp.models.llama import Llama, LlamaConfig  # noqa: PLC0415
    from flashfsdp.runtime import flight  # noqa: PLC0415

    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim=256, n_layers=4, n_heads=4, max_seq_len=64, vocab_size=512))
    model.init_weights(0)
    reshard = LOCAL_SIZE if "hpZ" in config else True
    for block in model.layers:
        flashfsdp.fully_shard(block, mp_policy=_policy(config), reshard_after_forward=reshard)
    flashfsdp.fully_shard(model, mp_policy=_policy(config))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1000 + rank)
    losses, last = [], 0
    for step in range(steps + 1):
        if step == steps:
            last = max((e.seq for e in flight.entries()), default=0)
        tokens = torch.randint(0, 512, (4, 65), generator=gen)
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, 512), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(round(loss.item(), 4))
    measured = [e for e in flight.entries() if e.seq > last]
    cross, intra, skipped = crossing_bytes(measured, rank, LOCAL_SIZE)
    return {"cross": cross, "intra": intra, "skipped": sorted(set(skipped)), "losses": losses,
            "kinds": sorted({e.kind for e in measured})}


def run(config: str, steps: int) -> list[dict]:
    """Every rank's :func:`_measure` of ``config`` (W = 4 fresh processes on gloo)."""
    from flashfsdp_dev.ranks import spawn_ranks  # noqa: PLC0415

    return spawn_ranks(_measure, WORLD_SIZE, (config, steps), backend="gloo", threads=1, timeout=600)


def main(argv=None) -> list[dict]:
    """Run every configuration, print the table, write ``qgz.csv`` / ``qgz.md``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.qgz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="warm-up steps before the measured one (default 3)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    env = environment(torch.device("cpu"))
    rows = []
    for config in CONFIGS:
        ranks = run(config, args.steps)
        rows.append({"config": config, "cross_node_MB": max(r["cross"] for r in ranks) / 1e6,
                     "intra_node_MB": max(r["intra"] for r in ranks) / 1e6,
                     "uncounted": " ".join(sorted({k for r in ranks for k in r["skipped"]})) or "-",
                     "losses": " ".join(map(str, ranks[0]["losses"])), **env.stamp()})
    base = rows[0]["cross_node_MB"]
    for row in rows:
        row["vs_bf16"] = row["cross_node_MB"] / base
    print(format_table(rows, COLUMNS))
    folder = output_dir(env.slug, out=args.out, record=args.record)
    write_csv(rows, folder / "qgz.csv")
    write_markdown(rows, COLUMNS, folder / "qgz.md", title="Bytes across nodes per step: bf16 FSDP vs ZeRO++ (2 nodes x 2)",
                   env=env, notes=[line.strip() for line in __doc__.split("\n\n")[1:3]] + [
                       "cross_node_MB / intra_node_MB: the most any rank sent in the measured step (10^6 bytes); "
                       "uncounted: collective kinds left out (control messages); losses: rank 0's, warm-up steps "
                       "then the measured one."])
    return rows


if __name__ == "__main__":
    main()
    sys.exit(0)
