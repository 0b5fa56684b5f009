"""Collectives outside the units (all_gather_with_grad) go through the units' own communicator: on
CUDA the same NCCL communicator, so NCCL orders them with the prefetches (two communicators in
flight at once can deadlock)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

import flashfsdp
from flashfsdp.runtime import comm_factory
from tests.harness import run_distributed


def _shared(rank, world_size):
    first = comm_factory.communicator_in_use(dist.group.WORLD, torch.device("cpu"))  # before any unit: "auto"
    model = nn.Linear(3, 3)
    flashfsdp.fully_shard(model, communicator="process_group")
    unit_comm = model._flashfsdp_state.unit.comm
    in_use = comm_factory.communicator_in_use(dist.group.WORLD, torch.device("cpu"))
    x = torch.full((2, 3), float(rank + 1), requires_grad=True)
    gathered = flashfsdp.all_gather_with_grad(x)
    gathered.sum().backward()
    singles = [dist.new_group([r]) for r in range(world_size)]  # collective: every rank makes each
    alone = comm_factory.communicator_in_use(singles[rank], torch.device("cpu"))
    return (in_use is unit_comm, first is unit_comm, gathered.detach(), x.grad,
            type(alone).__name__)


def test_all_gather_with_grad_uses_the_units_communicator():
    for rank, (same, first_same, gathered, grad, alone) in enumerate(run_distributed(_shared, 2)):
        assert same and first_same  # one communicator over the group, whoever asked first
        assert torch.equal(gathered, torch.tensor([[1.0] * 3] * 2 + [[2.0] * 3] * 2))
        assert torch.equal(grad, torch.full((2, 3), 2.0))  # each row's gradient summed over 2 ranks
        assert alone == "LocalCommunicator"
