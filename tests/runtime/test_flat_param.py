"""FlatParam's copy-out, driven directly: two ranks' shards laid into the gathered buffer by hand."""

from __future__ import annotations

import torch

from flashfsdp.kernels import dispatch
from flashfsdp.runtime.flat_param import FlatParam


def _groups(params, world_size=2):
    return [FlatParam(params, [f"p{i}" for i in range(len(params))], rank=rank, world_size=world_size,
                      param_dtype=torch.bfloat16, device=torch.device("cpu"), align=8)
            for rank in range(world_size)]


def _gather(groups):
    """Rank 0's group with its gathered buffer filled as the all-gather would fill it."""
    group = groups[0]
    group.alloc_unsharded()
    n = group.layout.gathered_size // len(groups)
    for rank, other in enumerate(groups):
        group.gathered[rank * n : (rank + 1) * n].copy_(other.sharded_flat)
    return group


def test_copy_out_keeps_its_table_while_the_unsharded_views_stay():
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(*shape, generator=g)) for shape in ((5, 3), (7,), (4, 2, 2))]
    groups = _groups(params)
    for _ in range(3):  # the gathered buffer is freed and re-materialised each time
        group = _gather(groups)
        group.copy_out()
        assert not group.gathered.untyped_storage().nbytes()
        for i, p in enumerate(params):
            assert torch.equal(group.unsharded_data(i), p.detach().to(torch.bfloat16))
    served = dispatch.select_backend(torch.device("cpu"))
    assert group._copy_out.builds == (1 if served == "triton" else 0)
    group.free_unsharded()  # the views' storage may come back elsewhere: checked, right values
    group = _gather(groups)
    group.copy_out()
    assert all(torch.equal(group.unsharded_data(i), p.detach().to(torch.bfloat16)) for i, p in enumerate(params))
