"""Cases for the runner's own test: one passes, one fails on rank 1 while rank 0 waits in a
collective, one passes after it (it must run in fresh processes and pass)."""

import torch
import torch.distributed as dist

from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)


@cases.case()
def passes(rank, world_size, impl):
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    return {"sum": t, "impl": impl.name}


@cases.case()
def fails_on_rank_1(rank, world_size, impl):
    if rank == 1:
        raise ValueError("rank 1 fails here")
    t = torch.ones(1)
    dist.all_reduce(t)  # never matched: rank 1 is gone
    return {}


@cases.case()
def passes_after_failure(rank, world_size, impl):
    t = torch.full((1,), float(rank))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"max": t}
