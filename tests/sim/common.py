"""What the simulator tests share: a test link, a world size and a model of equal blocks."""

from __future__ import annotations

from flashfsdp import sim
from flashfsdp.runtime.schedule import PrefetchPolicy

MB = 2**20
LINK = sim.Link("test", alpha_s=1e-5, bandwidth=1e9)
W = 4
NO_PREFETCH = PrefetchPolicy(forward=False, backward=False)


def model(n_blocks=4, block_numel=MB, root_numel=MB // 2, fwd=0.01, bwd=0.02, **kwargs) -> sim.Model:
    """Blocks of ``block_numel`` bf16 params (fp32 reduction) and equal compute."""
    root = sim.Unit("<root>", root_numel, kwargs.pop("root_fwd", fwd), kwargs.pop("root_bwd", bwd), reduce_bytes=4)
    blocks = tuple(sim.Unit(f"layers.{i}", block_numel, fwd, bwd, reduce_bytes=4) for i in range(n_blocks))
    return sim.Model(root, blocks, **kwargs)


def ag_time(unit: sim.Unit, link=LINK, world_size=W) -> float:
    """The all-gather time of ``unit``."""
    return link.all_gather_s(unit.unsharded_bytes(world_size), world_size)


def rs_time(unit: sim.Unit, link=LINK, world_size=W) -> float:
    """The reduce-scatter time of ``unit``."""
    return link.reduce_scatter_s(unit.reduce_bytes_total(world_size), world_size)
