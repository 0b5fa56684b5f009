"""Port of upstream ``test/distributed/_composable/fsdp/test_fully_shard_grad_acc.py``.

Upstream's file (from before it was folded into ``test_fully_shard_training.py``'s
``TestFullyShardGradientAccumulation``) has one test, ``test_requires_gradient_sync_``: gradient
accumulation over micro-batches with ``set_requires_gradient_sync(False)`` (no reduce-scatter)
mixed with micro-batches that do reduce. Here at W = 2 (upstream: min(4, GPUs)), where
``reshard_after_forward=2`` means resharding to the whole world, as True does.
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.common_fsdp import MLP

from tests.fsdp2_suite.common import FP32
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)


def _requires_gradient_sync(rank, world_size, impl, reshard_after_forward, offload_policy, recurse, iters=3):
    torch.manual_seed(42)
    local_batch_size, lin_dim, num_mlps, num_microbatches = 2, 32, 3, 3
    global_batch_size = local_batch_size * world_size
    num_mlps_to_disable_reduce_scatter = 2
    model = nn.Sequential(*[MLP(lin_dim) for _ in range(num_mlps)])
    ref_model = copy.deepcopy(model)
    for mlp in model:
        impl.fully_shard(mlp, reshard_after_forward=reshard_after_forward, offload_policy=offload_policy)
    impl.fully_shard(model, reshard_after_forward=reshard_after_forward, offload_policy=offload_policy)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)

    torch.manual_seed(1)  # the same on every rank: each rank takes its slice of the global batch
    losses, counts = [], []
    for iter_idx in range(iters):
        reduce_scatters = 0
        for microbatch_idx in range(num_microbatches):
            is_last = microbatch_idx == num_microbatches - 1
            if recurse:
                model.set_requires_gradient_sync(is_last)
            else:
                for mlp in model[:num_mlps_to_disable_reduce_scatter]:
                    mlp.set_requires_gradient_sync(is_last, recurse=False)
            global_inp = torch.rand((global_batch_size, lin_dim))
            local_inp = global_inp[rank * local_batch_size : (rank + 1) * local_batch_size].detach()
            ref_loss = ref_model(global_inp).sum()
            ref_loss.backward()
            with impl.count_collectives() as c:
                loss = model(local_inp).sum()
                loss.backward()
            reduce_scatters += c.reduce_scatter
            loss = loss.detach()
            dist.all_reduce(loss)  # partial -> the global batch's loss
            torch.testing.assert_close(loss, ref_loss.detach(), **FP32,
                                       msg=lambda m: f"iteration {iter_idx}, micro-batch {microbatch_idx}: loss: {m}")
            losses.append(loss)
        # one reduce-scatter per MLP on the last micro-batch, plus every micro-batch for those that
        # keep reducing (recurse=False disables it for 2 of the 3 MLPs only)
        expected = num_mlps
        if not recurse:
            expected += (num_mlps - num_mlps_to_disable_reduce_scatter) * (num_microbatches - 1)
        assert reduce_scatters == expected, f"iteration {iter_idx}: {reduce_scatters} reduce-scatters, expected {expected}"
        counts.append(reduce_scatters)
        for param in ref_model.parameters():  # the global batch's gradient summed over ranks' shares
            if param.grad is not None:
                param.grad.div_(world_size)
        impl.check_sharded_parity(ref_model, model)  # upstream: check_sharded_grad_parity
        for _optim in (optim, ref_optim):
            _optim.step()
            # set_to_none=False mixes accumulation with and without communication
            _optim.zero_grad(set_to_none=bool(iter_idx % 2))
    return {"losses": torch.stack(losses), "reduce_scatters": torch.tensor(counts), "params": impl.full_params(model)}


@cases.case(per_unit_collectives=True)
def requires_gradient_sync(rank, world_size, impl):
    """Upstream: test_fully_shard_grad_acc.py::TestFullyShardGradientAccumulation::test_requires_gradient_sync_
    — 3 micro-batches, ``set_requires_gradient_sync(is_last)`` on the root (recurse) or with
    ``recurse=False`` on 2 of the 3 MLPs; reshard_after_forward True/False/2; losses of the global
    batch and gradients equal the reference's (which sees the whole global batch), and exactly one
    reduce-scatter per reducing unit per micro-batch. This case: no offloading (``OffloadPolicy()``);
    3 iterations (upstream 5)."""
    out = {}
    for reshard_after_forward, recurse in itertools.product((True, False, 2), (True, False)):
        out[f"{reshard_after_forward}-{recurse}"] = _requires_gradient_sync(
            rank, world_size, impl, reshard_after_forward, impl.OffloadPolicy(), recurse)
    return out


@cases.case()
def requires_gradient_sync_cpu_offload(rank, world_size, impl):
    """Upstream: test_fully_shard_grad_acc.py::TestFullyShardGradientAccumulation::test_requires_gradient_sync_
    — the CPU-offload subtests (upstream's ``OffloadPolicy("cpu")``, today
    ``CPUOffloadPolicy(pin_memory=False)``): reshard_after_forward True/False/2 x recurse."""
    out = {}
    for reshard_after_forward, recurse in itertools.product((True, False, 2), (True, False)):
        out[f"{reshard_after_forward}-{recurse}"] = _requires_gradient_sync(
            rank, world_size, impl, reshard_after_forward, impl.CPUOffloadPolicy(pin_memory=False), recurse, iters=2)
    return out


test_case = cases.pytest_tests()
