"""Bytes one training step communicates, per rank, and DDP's all-reduce for comparison.

Two figures per collective: the **buffer** bytes (the all-gather's output, the reduce-scatter's
input, the all-reduced shard) and the bytes each rank **sends** under the ring algorithms: n-1 of
n chunks for an all-gather or reduce-scatter over n ranks, 2(n-1)/n of the buffer for an all-reduce
(Patarasuk & Yuan 2009; NCCL's ring, whose "bus bandwidth" uses the same factors).

ZeRO-3 / FSDP moves 3Ψ per step where DDP moves 2Ψ (Ψ: the gradient bytes): an all-gather in
forward, one in backward, one reduce-scatter, against DDP's all-reduce (= reduce-scatter +
all-gather), hence the 1.5× of Rajbhandari et al. 2020 (ZeRO, §7.2, "Communication Analysis of
ZeRO-DP"), which Zhao et al. 2023 (PyTorch FSDP) and the FSDP notes repeat. Keeping parameters from forward to backward (``reshard_after_forward=False``,
ZeRO-2 style) brings it to 2Ψ; the default keeps the root and the last block, slightly under 3Ψ; in
hybrid sharding the collectives run within the shard group of S ranks and the reduced 1/S shard
is all-reduced across the W/S replicas.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .units import UnitSpec


def ring_sent(nbytes: float, ranks: int, kind: str) -> float:
    """Bytes one rank sends in a ring collective over ``ranks`` ranks on a buffer of ``nbytes``.

    Args:
        kind: "all_gather" / "reduce_scatter" (``nbytes``: the full buffer), or "all_reduce".

    Raises:
        ValueError: an unknown kind.
    """
    if kind not in ("all_gather", "reduce_scatter", "all_reduce"):
        raise ValueError(f"ring_sent: unknown collective {kind!r}")
    if ranks <= 1:
        return 0.0
    factor = 2 if kind == "all_reduce" else 1
    return factor * (ranks - 1) / ranks * nbytes


@dataclass(frozen=True)
class CommVolume:
    """One step's communication on one rank (bytes).

    Attributes:
        all_gather_forward, all_gather_backward: all-gathered buffer bytes in each pass.
        all_gathers: all-gather collectives in the step (a unit alone: one per flat group; a
            bucket of units, ``runtime/step.py``'s [Note: buckets]: one per ``param_dtype``).
        reduce_scatter: reduce-scatter input bytes (all units).
        all_reduce: bytes all-reduced across replicas (hybrid sharding; 0 otherwise).
        sent: bytes this rank sends in all of them (ring model).
        ddp_all_reduce: the gradient bytes DDP all-reduces (no padding).
        ddp_sent: bytes a DDP rank sends for them (ring model, over all W ranks).
        units_gathered: unit all-gathers in the step (a unit gathered in a bucket counts once;
            ``all_gathers`` without buckets when every unit has one flat group).
        reduce_scatters: reduce-scatter collectives in the step (a unit alone: one per trainable
            group; a bucket: one).
        all_reduces: all-reduces across replicas in the step (hybrid sharding: one per trainable
            group, in a bucket too, as the runtime issues them; 0 otherwise).
    """

    all_gather_forward: int
    all_gather_backward: int
    all_gathers: int
    reduce_scatter: int
    all_reduce: int
    sent: float
    ddp_all_reduce: int
    ddp_sent: float
    units_gathered: int = 0
    reduce_scatters: int = 0
    all_reduces: int = 0

    @property
    def collectives(self) -> int:
        """The step's collectives on one rank: all-gathers, reduce-scatters and all-reduces."""
        return self.all_gathers + self.reduce_scatters + self.all_reduces

    @property
    def ratio_to_ddp(self) -> float:
        """Bytes sent per rank relative to DDP's (1.5 for plain ZeRO-3 with equal dtypes)."""
        return self.sent / self.ddp_sent if self.ddp_sent else float("nan")


def step_volume(units: list[UnitSpec], all_gathers: list[tuple[str, str, int]], world_size: int,
                shard_group: int, all_gather_dtype: torch.dtype | None = None,
                collectives: tuple[int, int] | None = None) -> CommVolume:
    """The step's communication from the walked all-gathers and every unit's one reduction.

    Args:
        units: the units laid out over ``shard_group`` ranks.
        all_gathers: (unit name, "forward"/"backward", group size) of each unit's all-gather in
            the step.
        world_size: W, all ranks; ``shard_group``: S, the ranks that shard one replica (W for
            full sharding).
        all_gather_dtype: None, or ``torch.int8``: the all-gathers over the shard group carry
            packed int8 (ZeRO++ qwZ); those from a post-forward sharding of fewer ranks gather
            ``param_dtype`` values, as the runtime does.
        collectives: (all-gather, reduce-scatter) collectives of the step as the walk counted
            them (``StepHoldings``: buckets share them); None: every unit alone (one per flat
            group all-gathered, one per trainable group reduced).
    """
    by_name = {u.name: u for u in units}
    gathered = {"forward": 0, "backward": 0}
    sent = 0.0
    for name, phase, ranks in all_gathers:
        unit = by_name[name]
        nbytes = unit.all_gather_bytes(all_gather_dtype if ranks == shard_group else None)
        gathered[phase] += nbytes
        sent += ring_sent(nbytes, ranks, "all_gather")
    reduce_scatter = sum(u.reduce_scatter_bytes() for u in units)
    sent += ring_sent(reduce_scatter, shard_group, "reduce_scatter")
    replicas = world_size // shard_group
    all_reduce = sum(u.reduced_shard_bytes() for u in units) if replicas > 1 else 0
    sent += ring_sent(all_reduce, replicas, "all_reduce")
    ddp = sum(sum(g.layout.numels) * g.reduce_bytes for u in units for g in u.groups if g.trainable)
    reduced_groups = sum(1 for u in units for g in u.groups if g.trainable)
    if collectives is None:
        collectives = (sum(len(by_name[name].groups) for name, _, _ in all_gathers), reduced_groups)
    return CommVolume(gathered["forward"], gathered["backward"], collectives[0], reduce_scatter, all_reduce,
                      sent, ddp, ring_sent(ddp, world_size, "all_reduce"), units_gathered=len(all_gathers),
                      reduce_scatters=collectives[1], all_reduces=reduced_groups if replicas > 1 else 0)
