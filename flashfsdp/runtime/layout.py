"""Layout of one flat group of a unit: FSDP2's dim-0 chunks, packed per rank (pure arithmetic).

Every parameter p_i of shape (d_i, *rest_i) (c_i = prod(rest_i) elements per row) is cut along
dim 0 as FSDP2 cuts it (``torch.chunk(p_i, W, dim=0)``, empty chunks past the end): chunk r holds
rows [r·k_i, min((r+1)·k_i, d_i)) with k_i = ceil(d_i / W), and every rank reserves k_i rows for
it (FSDP2's padded chunk, m_i = k_i·c_i elements). Rank r's **shard** is its chunks of p_0..p_{n-1}
back to back at offsets o_i aligned to ``align`` elements, S elements in all, the same S on every
rank: FSDP2's all-gather input. The all-gather output (the **gathered** buffer) is rank-major,
W·S elements, rank r's shard at r·S; the reduce-scatter input has the same layout.

The **unsharded** buffer holds the parameters end to end (p_i at u_i, aligned), each a contiguous
row-major tensor, so copy-out moves W·n segments: chunk r of p_i from r·S + o_i in the gathered
buffer to u_i + r·m_i. Where the gathered buffer already *is* that layout — one rank, or one
parameter whose chunk fills the shard (S = m_0) — there is no copy-out: the unsharded parameters
are views of the gathered buffer (:attr:`ShardLayout.zero_copy`).

[Note: Shard(k) parameters]
A parameter may be sharded along another dim k (FSDP2's ``shard_placement_fn`` returning
``Shard(k)``): its chunk r is ``torch.chunk(p_i, W, dim=k)[r]`` made contiguous, of shape
``shape`` with d_k replaced by its rows, and rank r reserves m_i = k_i · numel / d_k elements for
it (k_i = ceil(d_k / W)), the chunk first and the padding after it. In the unsharded parameter such
a chunk is not one run of elements (it is ``prod(shape[:k])`` runs), so it has no :class:`Segment`:
:attr:`ShardLayout.strided` lists these parameters, and ``dim_chunks.py`` moves them with torch ops.
For k = 0 (every parameter by default) all of the above is the dim-0 arithmetic.

The dim-0 chunking and padding are FSDP2's (``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``,
``_init_sharded_param``); the per-rank packing of the all-gather input is FSDP2's too
(``_fsdp_collectives.foreach_all_gather``); the alignment follows YaFSDP. No tensors here.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Sequence

ALIGN_BYTES = 16


def align_elements(itemsizes: Sequence[int], align_bytes: int = ALIGN_BYTES) -> int:
    """Number of elements that is a multiple of ``align_bytes`` bytes in every given item size.

    Args:
        itemsizes: element sizes in bytes of every dtype the flat buffers use (e.g. 4 for the fp32
            master shard, 2 for a bf16 ``param_dtype``).
        align_bytes: the byte alignment wanted (16 by default: one 128-bit vector access).

    Returns:
        ``align_bytes // min(itemsizes)`` (at least 1).

    Raises:
        ValueError: if ``itemsizes`` is empty or holds a size that does not divide ``align_bytes``.
    """
    if not itemsizes:
        raise ValueError("align_elements: itemsizes is empty")
    for size in itemsizes:
        if size <= 0 or align_bytes % size:
            raise ValueError(f"align_elements: item size {size} does not divide {align_bytes} bytes")
    return max(1, align_bytes // min(itemsizes))


@dataclass(frozen=True)
class Segment:
    """One contiguous run of elements that moves between two flat buffers (copy-out, packing).

    Attributes:
        param_index: the parameter it belongs to.
        rank: the rank whose chunk it is.
        gathered_offset: where it lies in the rank-major gathered (or reduce-scatter) buffer.
        param_offset: where it lies in the flattened parameter (and in the unsharded buffer,
            relative to the parameter's start).
        numel: its length in elements (> 0).
    """

    param_index: int
    rank: int
    gathered_offset: int
    param_offset: int
    numel: int


@dataclass(frozen=True)
class ShardLayout:
    """Where every parameter's chunks lie in the shard, the gathered and the unsharded buffers.

    Build it with :meth:`build`. Attributes:
        shapes: each parameter's full shape (at least 1-D).
        dims: each parameter's shard dim k (0 unless ``Shard(k)``; see [Note: Shard(k) parameters]).
        world_size: W, the ranks the group is sharded over.
        align: alignment of every offset and of S, in elements.
        offsets: o_i, each parameter's chunk offset in a rank's shard.
        shard_size: S, the elements of each rank's shard (a multiple of ``align``).
        unsharded_offsets: u_i, each parameter's offset in the unsharded buffer.
        unsharded_size: elements of the unsharded buffer (W·S when :attr:`zero_copy`).
        zero_copy: the gathered buffer is laid out as the unsharded one (no copy-out).
    """

    shapes: tuple[tuple[int, ...], ...]
    dims: tuple[int, ...]
    world_size: int
    align: int
    offsets: tuple[int, ...]
    shard_size: int
    unsharded_offsets: tuple[int, ...]
    unsharded_size: int
    zero_copy: bool

    @classmethod
    def build(cls, shapes: Sequence[Sequence[int]], world_size: int, align: int = 1,
              dims: Sequence[int] | None = None) -> "ShardLayout":
        """Lay out parameters of the given shapes for ``world_size`` ranks.

        Args:
            shapes: each parameter's shape; at least one dimension.
            world_size: W >= 1.
            align: element alignment of each offset and of S (>= 1).
            dims: each parameter's shard dim, 0 <= k < len(shape) (None: all 0, FSDP2's default).

        Raises:
            ValueError: W < 1, align < 1, a 0-dim shape, a negative size, or a dim out of range.
        """
        if world_size < 1:
            raise ValueError(f"ShardLayout: world_size must be >= 1, got {world_size}")
        if align < 1:
            raise ValueError(f"ShardLayout: align must be >= 1, got {align}")
        shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        dims = (0,) * len(shapes) if dims is None else tuple(int(k) for k in dims)
        if len(dims) != len(shapes):
            raise ValueError(f"ShardLayout: {len(dims)} dims for {len(shapes)} shapes")
        for i, (shape, k) in enumerate(zip(shapes, dims)):
            if not shape:
                raise ValueError(f"ShardLayout: shapes[{i}] is 0-dim; sharding needs at least one dimension")
            if any(d < 0 for d in shape):
                raise ValueError(f"ShardLayout: shapes[{i}] = {shape} has a negative size")
            if not 0 <= k < len(shape):
                raise ValueError(f"ShardLayout: dims[{i}] = {k} is out of range for shape {shape}")
        padded = [_chunk_rows(shape[k], world_size) * _other_numel(shape, k) for shape, k in zip(shapes, dims)]
        offsets, cursor = [], 0
        for m in padded:
            cursor = _round_up(cursor, align)
            offsets.append(cursor)
            cursor += m
        shard = _round_up(cursor, align)
        single = len(shapes) == 1 and padded[0] == shard and dims[0] == 0
        if world_size == 1 or single:
            return cls(shapes, dims, world_size, align, tuple(offsets), shard, tuple(offsets), world_size * shard, True)
        uoffsets, cursor = [], 0
        for shape in shapes:
            cursor = _round_up(cursor, align)
            uoffsets.append(cursor)
            cursor += _numel(shape)
        return cls(shapes, dims, world_size, align, tuple(offsets), shard, tuple(uoffsets), _round_up(cursor, align),
                   False)

    # ---------------------------------------------------------------- per parameter
    @property
    def numels(self) -> tuple[int, ...]:
        """Each parameter's full number of elements."""
        return tuple(_numel(s) for s in self.shapes)

    def row_numel(self, i: int) -> int:
        """c_i: elements per row (index along the shard dim) of parameter ``i``."""
        return _other_numel(self.shapes[i], self.dims[i])

    def chunk_rows(self, i: int) -> int:
        """k_i = ceil(d_i / W), d_i the size of the shard dim: the rows every rank reserves for
        parameter ``i`` (FSDP2's padded chunk)."""
        return _chunk_rows(self.shapes[i][self.dims[i]], self.world_size)

    def padded_numel(self, i: int) -> int:
        """m_i = k_i · c_i: the elements of parameter ``i``'s chunk in every rank's shard."""
        return self.chunk_rows(i) * self.row_numel(i)

    def local_rows(self, rank: int, i: int) -> int:
        """Rows of parameter ``i`` that ``rank`` holds (``torch.chunk``'s; 0 past the end)."""
        k, d = self.chunk_rows(i), self.shapes[i][self.dims[i]]
        return max(0, min(k, d - rank * k))

    def local_shape(self, rank: int, i: int) -> tuple[int, ...]:
        """The shape of ``rank``'s chunk of parameter ``i`` (FSDP2's ``to_local()`` shape)."""
        shape, k = self.shapes[i], self.dims[i]
        return shape[:k] + (self.local_rows(rank, i),) + shape[k + 1:]

    def local_numel(self, rank: int, i: int) -> int:
        """Elements of ``rank``'s chunk of parameter ``i``."""
        return self.local_rows(rank, i) * self.row_numel(i)

    def param_offset(self, rank: int, i: int) -> int:
        """Where ``rank``'s chunk of parameter ``i`` starts in the flattened parameter (a dim-0
        parameter: the chunk of a :attr:`strided` one is not one run there)."""
        return min(rank * self.padded_numel(i), _numel(self.shapes[i]))

    # ---------------------------------------------------------------- whole buffers
    @property
    def gathered_size(self) -> int:
        """W·S, the elements of the all-gather output and of the reduce-scatter input."""
        return self.world_size * self.shard_size

    @property
    def used(self) -> int:
        """Elements of the shard up to the end of the last parameter's chunk (S less the tail padding)."""
        if not self.shapes:
            return 0
        return self.offsets[-1] + self.padded_numel(len(self.shapes) - 1)

    @cached_property
    def segments(self) -> tuple[Segment, ...]:
        """Every non-empty (rank, parameter) chunk of the parameters not :attr:`strided`,
        rank-major: what copy-out moves from the gathered buffer into the unsharded parameters and
        what packing moves from the gradients into the reduce-scatter input."""
        out = []
        strided = set(self.strided)
        for r in range(self.world_size):
            for i in range(len(self.shapes)):
                n = 0 if i in strided else self.local_numel(r, i)
                if n:
                    out.append(Segment(i, r, r * self.shard_size + self.offsets[i], r * self.padded_numel(i), n))
        return tuple(out)

    @cached_property
    def strided(self) -> tuple[int, ...]:
        """The parameters sharded along a dim other than 0 over W > 1 ranks, whose chunks are not
        runs of the unsharded parameter (see [Note: Shard(k) parameters])."""
        if self.world_size == 1:
            return ()
        return tuple(i for i, k in enumerate(self.dims) if k != 0)

    def sub_layout(self, keep: Sequence[bool]) -> "ShardLayout":
        """The layout of only the parameters flagged in ``keep`` (same W, alignment and dims): the
        compacted reduce-scatter of a group whose other parameters are frozen."""
        return ShardLayout.build([s for s, k in zip(self.shapes, keep) if k], self.world_size, self.align,
                                 [d for d, k in zip(self.dims, keep) if k])


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _other_numel(shape: Sequence[int], dim: int) -> int:
    return _numel(shape[:dim]) * _numel(shape[dim + 1:])


def _chunk_rows(rows: int, world_size: int) -> int:
    return -(-rows // world_size)


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple
