"""The reduce-scatter layout of a group whose parameters are not all trainable (pure arithmetic).

A group is laid out once, at ``fully_shard``; ``requires_grad_(False)`` later (freezing a
backbone, LoRA) must not change that layout — the optimizer holds the pieces — but a frozen
parameter has no gradient to reduce, and sending its zeros would cost what training the whole
group costs. So the reduce-scatter input of such a group is *compacted* per rank: rank r's
segment holds, end to end, only the trainable parts of the range [r·S, (r+1)·S) it owns, and
every segment is padded to the longest one (L elements, a multiple of the alignment). The
reduce-scatter then moves W·L elements instead of T = W·S, and rank r gets exactly the summed
gradients of its trainable ranges, which it places back at their offsets in its shard. With
every parameter trainable the group uses the dense layout (no plan).

FSDP2 gets the same effect from per-parameter sharding (a frozen parameter is simply not in the
reduce-scatter); FSDP1's flat parameters send the zeros.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .layout import FlatLayout


@dataclass(frozen=True)
class ReducePlan:
    """Compacted reduce-scatter layout of one group, for one pattern of trainable parameters.

    Attributes:
        segment: L, elements of each rank's segment (the reduce-scatter output size).
        entries: what to pack, per (parameter, rank) part: ``(param index, start inside the
            flattened parameter, length, offset in the W·L packed buffer)``.
        local: where this rank's segment goes: ``(offset in the segment, offset in the shard,
            length)`` per trainable part of the rank's range.
    """

    segment: int
    entries: tuple[tuple[int, int, int, int], ...]
    local: tuple[tuple[int, int, int], ...]
    world_size: int

    @property
    def packed_size(self) -> int:
        """W·L, the elements of the reduce-scatter input."""
        return self.segment * self.world_size

    @classmethod
    def build(cls, layout: FlatLayout, trainable: Sequence[bool], rank: int) -> "ReducePlan | None":
        """The plan for ``trainable`` (one flag per parameter), or None when every parameter is
        trainable (the dense T-element layout is used then)."""
        if all(trainable):
            return None
        W, S = layout.world_size, layout.shard_size
        parts: list[list[tuple[int, int, int]]] = []  # per rank: (param, start in param, length)
        for r in range(W):
            lo, hi = r * S, (r + 1) * S
            mine = []
            for i, (off, n) in enumerate(zip(layout.offsets, layout.numels)):
                start, end = max(off, lo), min(off + n, hi)
                if trainable[i] and end > start:
                    mine.append((i, start - off, end - start))
            parts.append(mine)
        longest = max((sum(n for _, _, n in mine) for mine in parts), default=0)
        segment = max(1, -(-longest // layout.align)) * layout.align  # never an empty collective
        entries, local = [], []
        for r, mine in enumerate(parts):
            cursor = 0
            for i, start, n in mine:
                entries.append((i, start, n, r * segment + cursor))
                if r == rank:
                    local.append((cursor, layout.offsets[i] + start - r * S, n))
                cursor += n
        return cls(segment, tuple(entries), tuple(local), W)
