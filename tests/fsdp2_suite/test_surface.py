"""torch 2.13's FSDP2 surface beyond upstream's unit tests, compared with torch's FSDP2.

No single upstream file: what a caller of torch 2.13's ``fully_shard`` / ``FSDPModule`` can see
of the API itself — the signature's defaults, positional ``recurse``, the exceptions and warnings
of the setters, the handle ``unshard(async_op=True)`` returns, ``dp_mesh_dims`` (the SPMD-mesh
form: ``mesh`` the whole mesh, ``DataParallelMeshDims`` naming its data-parallel dims) and
``set_custom_all_gather`` / ``set_custom_reduce_scatter`` with torch's ``AllGather`` /
``ReduceScatter`` objects. Each case runs against both implementations on gloo; the runner
compares the values returned and the types logged.
"""

from __future__ import annotations

import copy
import inspect
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.common_fsdp import MLP

from tests.fsdp2_suite.common import FP32, rank_seed
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)


def _train(impl, model, ref, steps: int = 2, dim: int = 8, mesh_size: int | None = None) -> dict:
    """``steps`` Adam steps of ``model`` (sharded) beside ``ref`` (unsharded, gradients averaged
    over the ranks by hand); asserts parity each step; returns the losses and full parameters."""
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2)
    rank_seed(dist.get_rank())
    losses = []
    for _ in range(steps):
        x = torch.randn(4, dim)
        loss, ref_loss = model(x).sum(), ref(x).sum()
        loss.backward()
        ref_loss.backward()
        for p in ref.parameters():
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size() if mesh_size is None else mesh_size
        for o in (optim, ref_optim):
            o.step()
            o.zero_grad()
        torch.testing.assert_close(loss, ref_loss, **FP32)
        losses.append(loss.detach())
    params = impl.full_params(model)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(params[name], p.detach(), **FP32, msg=lambda m, name=name: f"{name}: {m}")
    impl.record_types("parameters", list(model.parameters()))
    return {"losses": losses, "params": params}


@cases.case(per_unit_collectives=True)
def api_surface(rank, world_size, impl):
    """``offload_policy`` defaults to ``OffloadPolicy()``; ``set_reshard_after_forward(2)`` raises
    ``ValueError``; ``recurse`` positional; ``set_reduce_scatter_divide_factor`` warns
    ``DeprecationWarning``; ``unshard(async_op=True)`` returns an instance of torch's
    ``UnshardHandle``; ``DataParallelMeshDims`` is exported."""
    from torch.distributed.fsdp import DataParallelMeshDims, OffloadPolicy, UnshardHandle  # noqa: PLC0415

    default = inspect.signature(impl.fully_shard).parameters["offload_policy"].default
    assert type(default).__name__ == "OffloadPolicy" and isinstance(default, (OffloadPolicy, impl.OffloadPolicy)), default
    assert impl.api.DataParallelMeshDims is DataParallelMeshDims
    torch.manual_seed(0)
    model = nn.Sequential(MLP(8), MLP(8))
    impl.fully_shard(model[0])
    impl.fully_shard(model)
    try:
        model.set_reshard_after_forward(2)
        raised = ""
    except ValueError as error:
        raised = str(error)
    assert raised == "reshard_after_forward should be a bool, got <class 'int'>", raised
    model.set_reshard_after_forward(False, False)  # recurse positional: the root only
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.set_reduce_scatter_divide_factor(float(world_size))
    assert [w.category for w in caught] == [DeprecationWarning], [(w.category, str(w.message)) for w in caught]
    handle = model[0].unshard(async_op=True)
    assert isinstance(handle, UnshardHandle), type(handle).__mro__
    handle.wait()
    model[0].reshard()
    with impl.count_collectives() as counted:
        model(torch.randn(2, 8)).sum().backward()
    # the root's forward kept its parameters (recurse=False left model[0] resharding): one
    # backward all-gather, model[0]'s
    return {"all_gathers": counted.all_gather, "reduce_scatters": counted.reduce_scatter}


@cases.case(world_size=4, torch_reason="torch 2.13 runs dp_mesh_dims (its SPMD-mesh form); flashfsdp refuses it")
def dp_mesh_dims_refused(rank, world_size, impl):
    """``dp_mesh_dims`` (FSDP2's SPMD-mesh form: the parameters DTensors on the whole mesh) raises
    ``NotImplementedError`` naming the data-parallel submesh to pass instead, before anything is
    sharded; ``dp_mesh_dims=None`` is FSDP2's default and shards as usual."""
    from torch.distributed.fsdp import DataParallelMeshDims  # noqa: PLC0415
    from torch.distributed.tensor import Replicate, distribute_module  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = distribute_module(MLP(8), mesh)  # every parameter Replicate() on the whole mesh
    assert all(p.placements == (Replicate(), Replicate()) for p in model.parameters())
    dims = DataParallelMeshDims(shard="dp_shard", replicate="dp_replicate")
    try:
        impl.fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
        raise AssertionError("dp_mesh_dims was accepted")
    except NotImplementedError as error:
        assert "mesh[('dp_replicate', 'dp_shard')]" in str(error), error
    assert not isinstance(model, impl.FSDPModule)
    torch.manual_seed(0)
    plain = MLP(8)
    ref = copy.deepcopy(plain)
    impl.fully_shard(plain, mesh=mesh, dp_mesh_dims=None)
    return _train(impl, plain, ref, mesh_size=4)


def _counting_collectives(calls: dict):
    """torch FSDP2 ``AllGather`` / ``ReduceScatter`` objects that count their allocations and calls
    (in ``calls``) and run torch.distributed's collectives on gloo (a reduce-scatter as an
    all-reduce of the input, this rank's chunk taken: gloo has no reduce-scatter)."""
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # noqa: PLC0415

    class CountingAllGather(AllGather):
        def allocate(self, size, *, dtype, device):
            calls["ag_allocate"] += 1
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            calls["all_gather"] += 1
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # (2.13's name)
            return gather(output_tensor, input_tensor, group=group, async_op=async_op)

    class CountingReduceScatter(ReduceScatter):
        def allocate(self, size, *, dtype, device):
            calls["rs_allocate"] += 1
            return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            calls["reduce_scatter"] += 1
            summed = input_tensor.clone()
            dist.all_reduce(summed, op=op, group=group)
            n = output_tensor.numel()
            output_tensor.copy_(summed[dist.get_rank(group) * n:(dist.get_rank(group) + 1) * n])
            return None

    return CountingAllGather(), CountingReduceScatter()


@cases.case()  # (buckets on: the units with custom collectives run them alone)
def custom_all_gather_and_reduce_scatter(rank, world_size, impl):
    """``set_custom_all_gather`` / ``set_custom_reduce_scatter`` on the blocks of an MLP stack
    (not the root): every all-gather and reduce-scatter of those units goes through the user's
    objects (allocate, then the call), the root's through the default collectives; losses and
    parameters equal FSDP2's with the same objects; flashfsdp refuses a non-``AllGather``
    with a TypeError."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(8), MLP(8), nn.Linear(8, 8))
    ref = copy.deepcopy(model)
    for block in model[:2]:  # (explicit: flashfsdp's default keeps the last block for backward)
        impl.fully_shard(block, reshard_after_forward=True)
    impl.fully_shard(model)
    calls = dict.fromkeys(("ag_allocate", "all_gather", "rs_allocate", "reduce_scatter"), 0)
    for block in model[:2]:
        all_gather, reduce_scatter = _counting_collectives(calls)
        block.set_custom_all_gather(all_gather)
        block.set_custom_reduce_scatter(reduce_scatter)
    if impl.name == "flashfsdp":  # (FSDP2 takes any object and fails at its first all-gather)
        try:
            model[0].set_custom_all_gather(object())
        except TypeError as exc:
            assert "AllGather" in str(exc), exc
        else:
            raise AssertionError("set_custom_all_gather(object()) was accepted")
    out = _train(impl, model, ref, steps=3)
    # 3 steps: each block gathers in forward and again in backward (one allocation each), reduces
    # once (two allocations: the input and the output)
    assert calls == {"ag_allocate": 12, "all_gather": 12, "rs_allocate": 12, "reduce_scatter": 6}, calls
    out["calls"] = calls
    return out


test_case = cases.pytest_tests()
