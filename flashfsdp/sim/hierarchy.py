"""HSDP's two-level network for the simulator: a shard group on a fast link, replicas on a slow one.

With a 2-D mesh (replicate, shard) of R × S ranks (``fully_shard(module, mesh=...)``, see [Note:
HSDP] in ``bindings/fully_shard.py``) a unit is sharded over S ranks, typically the GPUs of one
node: its all-gathers and reduce-scatters run over the intra-node link (NVLink) among S ranks, and
each reduce-scattered shard (1/S of the unit's gradients) is then all-reduced across the R
replicas over the inter-node link (InfiniBand), one rank per node and shard. A
:class:`Hierarchy` passed as ``link`` to :func:`~flashfsdp.sim.simulate.simulate` replays that:
the step's all-gathers and reduce-scatters cost the ring model of :mod:`flashfsdp.sim.link` at
W = S on ``shard_link``, and each reduce-scatter is followed by a ring all-reduce of the shard on
``replicate_link`` at W = R (:func:`~flashfsdp.sim.link.ring_all_reduce_s`), queued behind it on
the reduce-scatter stream as the runtime does (``runtime/reduce.py``, [Note: HSDP all-reduce]).
"""

from __future__ import annotations

from dataclasses import dataclass

from .link import Link, check_world_size, get_link


@dataclass(frozen=True)
class Hierarchy:
    """The links of an HSDP mesh of ``shard_size`` ranks per shard group.

    Attributes:
        shard_link: the link inside a shard group (a :class:`Link` or a name of ``LINKS``), e.g.
            NVLink between the GPUs of a node.
        replicate_link: the link between replicas (a :class:`Link` or a name), e.g. InfiniBand.
        shard_size: S, ranks per shard group (>= 1); the world size must be a multiple of it.

    Raises:
        ValueError: a shard size that is not an integer >= 1, or an unknown link name.
    """

    shard_link: Link
    replicate_link: Link
    shard_size: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "shard_link", get_link(self.shard_link))
        object.__setattr__(self, "replicate_link", get_link(self.replicate_link))
        if isinstance(self.shard_size, bool) or not isinstance(self.shard_size, int) or self.shard_size < 1:
            raise ValueError(f"Hierarchy: shard_size must be an integer >= 1, got {self.shard_size!r}")

    @property
    def name(self) -> str:
        """``"<shard link> x S / <replicate link>"``, for tables."""
        return f"{self.shard_link.name} x{self.shard_size} / {self.replicate_link.name}"

    def replicas(self, world_size: int) -> int:
        """R = W / S, the number of replicas at ``world_size`` ranks.

        Raises:
            ValueError: ``world_size`` is not a multiple of ``shard_size``.
        """
        check_world_size(world_size)
        if world_size % self.shard_size:
            raise ValueError(f"world_size {world_size} is not a multiple of the Hierarchy's shard_size "
                             f"{self.shard_size}; HSDP needs R x S ranks")
        return world_size // self.shard_size
