"""Port of upstream ``test/distributed/_composable/fsdp/test_fully_shard_state_dict.py``.

A fully_shard'ed model's ``state_dict()`` has the unsharded model's keys and holds sharded values
that share storage with the sharded parameters; ``load_state_dict`` of sharded values writes into the
sharded parameters in place; the state dict is sharded also after a forward that left the
parameters unsharded; the values stay the parameters' storage across optimizer steps; a full state
dict on rank 0 (CPU) equals the unsharded model's.

The values are DTensors (``Shard(0)``) for both implementations, read as upstream reads them
(``to_local()``, ``full_tensor()``, ``distribute_tensor``); every state dict a case takes (model,
and optimizer where the case has one) has its value types recorded (``Impl.record_types``: class,
placements, global and local shape, dtype), which the runner compares with torch's run.

Beyond upstream's file, the brief asks for the state-dict paths FSDP2 users rely on, each named
after the upstream test it extends: DCP (``torch.distributed.checkpoint``) save and load into another
sharding layout and into/from an unsharded model, buffers included
(``dp_state_dict_save_load_dcp_relayout``); the stock DSD
(``torch.distributed.checkpoint.state_dict``) sharded ``get_state_dict`` / ``set_state_dict`` of
model and optimizer through DCP (``dp_state_dict_save_load_dsd_sharded``); DSD's full-state-dict
setters (``dp_state_dict_save_load_dsd_full_set``) and getters
(``rank0_offload_full_state_dict_dsd``); ``state_dict()`` between forward and backward
(``dp_state_dict_save_load_mid_step``).
"""

from __future__ import annotations

import copy
import os
import shutil
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

from tests.fsdp2_suite.common import average_grads, rank_seed, shard_transformer, train_step
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)

UPSTREAM = "test/distributed/_composable/fsdp/test_fully_shard_state_dict.py"


# ============================================================================ helpers
def flat_items(tree, prefix: str = "") -> dict:
    """A (possibly nested) state dict as one flat mapping ``"a.b.c" -> leaf`` (optimizer state
    dicts nest ``state`` / parameter / key and hold lists in ``param_groups``)."""
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out.update(flat_items(value, f"{prefix}{key}."))
        return out
    if isinstance(tree, (list, tuple)):
        out = {}
        for i, value in enumerate(tree):
            out.update(flat_items(value, f"{prefix}{i}."))
        return out
    return {prefix[:-1]: tree}


def record_sd(impl, tag: str, state_dict) -> None:
    """Record the types of every value of ``state_dict`` (nested: flattened) under ``tag``."""
    impl.record_types(tag, flat_items(state_dict))


class shared_tmpdir:
    """A directory every rank sees (made by rank 0, removed after a barrier)."""

    def __enter__(self) -> str:
        path = [tempfile.mkdtemp(prefix="fsdp2_sd_") if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(path, src=0)
        self.path = path[0]
        return self.path

    def __exit__(self, *exc):
        if exc[0] is None:
            dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(self.path, ignore_errors=True)
        return False


def mlp_stack(mlp_dim: int, seed: int = 42, with_buffer: bool = False) -> nn.Module:
    """Upstream's model of ``_test_dp_state_dict_save_load`` (optionally with MLP buffers)."""
    torch.manual_seed(seed)
    return nn.Sequential(
        MLP(mlp_dim, with_buffer=with_buffer),
        nn.Sequential(MLP(mlp_dim), nn.Linear(mlp_dim, mlp_dim)),
        MLP(mlp_dim, with_buffer=with_buffer),
    )


def shard_children(impl, model: nn.Module, **kwargs) -> nn.Module:
    """Upstream's layout: fully_shard each child of the Sequential, then the root."""
    for module in model:
        impl.fully_shard(module, **kwargs)
    impl.fully_shard(model, **kwargs)
    return model


def assert_equal(got, expected, what: str, rtol=0.0, atol=0.0) -> None:
    torch.testing.assert_close(got, expected, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


# ============================================================================ TestFullyShardStateDictMultiProcess
def _test_state_dict_save_load(rank, impl, model: nn.Module) -> int:
    """Upstream's ``_test_state_dict_save_load``."""
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor), f"expects parameters to be sharded as DTensors but got {name} as {type(param)}"
    old_fill_value = 1
    new_fill_value = 42 + rank
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(old_fill_value)
    # Use that the parameters are currently sharded, meaning that their data pointers correspond to
    # the sharded parameter data
    param_name_to_data_ptr = {n: p.to_local().data_ptr() for n, p in model.named_parameters()}
    ref_sharded_sizes = [p.size() for p in model.parameters()]
    state_dict = model.state_dict()
    record_sd(impl, "state_dict", state_dict)
    for param, ref_sharded_size in zip(model.parameters(), ref_sharded_sizes):
        assert param.size() == ref_sharded_size
        assert isinstance(param, nn.Parameter)

    # Verify that keys match, values are DTensors, and values share the same storage as the existing
    # sharded parameter data
    assert set(state_dict.keys()) == set(param_name_to_data_ptr.keys()), (
        f"{sorted(state_dict)} vs {sorted(param_name_to_data_ptr)}")
    for name, tensor in state_dict.items():
        assert isinstance(tensor, DTensor), f"{name}: {type(tensor).__name__} is not a DTensor"
        if param_name_to_data_ptr[name] == 0:
            # Check that this is padding (added by DTensor)
            assert rank > 0, f"{name}: null data pointer on rank 0"
            assert torch.count_nonzero(tensor.to_local()).item() == 0
        else:
            assert tensor.to_local().data_ptr() == param_name_to_data_ptr[name], (
                f"{name}: the state-dict value does not share the sharded parameter's storage")

    # Verify that we can load a new state dict that contains DTensors with storages different from
    # the current model parameters
    new_state_dict = {}
    for name, dtensor in state_dict.items():
        # Construct new DTensors to exercise load state dict writeback
        new_state_dict[name] = dtensor.detach().clone().fill_(new_fill_value)
    record_sd(impl, "new state_dict", new_state_dict)
    for param in model.parameters():
        assert_equal(param.to_local(), torch.ones_like(param.to_local()) * old_fill_value, "before load")
    model.load_state_dict(new_state_dict)
    for name, param in model.named_parameters():
        assert_equal(param.to_local(), torch.ones_like(param.to_local()) * new_fill_value, f"{name} after load")
        local_param = param.to_local()
        # Only guarantee that the local tensor's data pointer does not change if the sharding was even
        # (i.e. no padding); otherwise, FSDP may re-pad the local tensor, changing its data pointer
        if local_param.size(0) * param.device_mesh.size() == param.size(0):
            assert local_param.data_ptr() == param_name_to_data_ptr[name], f"{name}: data pointer changed on load"
    return len(state_dict)


def _test_dp_state_dict_save_load(rank, impl, mlp_dim: int, mesh=None) -> list[int]:
    """Upstream's ``_test_dp_state_dict_save_load`` without ``shard_placement_fn``, on ``mesh``
    (None: the default 1-D mesh)."""
    base_model = mlp_stack(mlp_dim)
    # Check basic `reshard_after_forward=True`
    model1 = shard_children(impl, copy.deepcopy(base_model), mesh=mesh)
    # The keys (and their order) are the unsharded model's
    assert list(model1.state_dict()) == list(base_model.state_dict()), (
        f"{list(model1.state_dict())} vs {list(base_model.state_dict())}")
    out = [_test_state_dict_save_load(rank, impl, model1)]

    # Check `reshard_after_forward=False` before and after a forward
    model2 = shard_children(impl, copy.deepcopy(base_model), mesh=mesh, reshard_after_forward=False)
    out.append(_test_state_dict_save_load(rank, impl, model2))
    ref_sharded_sd = model2.state_dict()
    inp = torch.randn((2, mlp_dim))
    model2(inp)  # parameters are not resharded after this forward
    # Check that state dict hooks reshard
    sharded_sd = model2.state_dict()
    record_sd(impl, "state_dict after forward", sharded_sd)
    assert set(ref_sharded_sd.keys()) == set(sharded_sd.keys())
    for key, value in ref_sharded_sd.items():
        assert isinstance(sharded_sd[key], DTensor), f"{key}: state dict after forward is not a DTensor"
        assert sharded_sd[key].placements == value.placements and sharded_sd[key].shape == value.shape
        assert_equal(sharded_sd[key].to_local(), value.to_local(), f"{key} after forward")
    return out


@cases.case()
def dp_state_dict_save_load(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess::test_dp_state_dict_save_load
    (1-D mesh, mlp_dim 2..5) — state-dict keys equal the parameter names, values are DTensors sharing
    the sharded parameters' storage, loading new DTensors (``value.detach().clone().fill_(v)``)
    writes them in place, and with ``reshard_after_forward=False`` the state dict after a forward
    is the sharded one from before."""
    return [_test_dp_state_dict_save_load(rank, impl, mlp_dim) for mlp_dim in (2, 3, 4, 5)]


@cases.case(world_size=4)
def dp_state_dict_save_load_hsdp(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess::test_dp_state_dict_save_load
    (its HSDP subtests: a (W/2, 2) mesh named ("dp_replicate", "dp_shard"), mlp_dim 2..5) — the same
    checks with ``(Replicate(), Shard(0))`` DTensor values."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (world_size // 2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    return [_test_dp_state_dict_save_load(rank, impl, mlp_dim, mesh) for mlp_dim in (2, 3, 4, 5)]


@cases.case()
def dp_state_dict_save_load_mid_step(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess::test_dp_state_dict_save_load
    (the ``reshard_after_forward=False`` part, carried through a training step) — ``state_dict()``
    between forward and backward returns the sharded values from before the forward, and the
    backward and optimizer step after it still match the replicated reference."""
    base_model = mlp_stack(4)
    ref_model = copy.deepcopy(base_model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    model = shard_children(impl, copy.deepcopy(base_model), reshard_after_forward=False)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    rank_seed(rank)
    losses = []
    for step in range(2):
        inp = torch.randn((2, 4))
        before = {k: v.to_local().clone() for k, v in model.state_dict().items()}
        loss = model(inp).sum()
        sharded_sd = model.state_dict()  # parameters are unsharded here
        record_sd(impl, f"step {step}: state_dict between forward and backward", sharded_sd)
        assert set(sharded_sd) == set(before)
        for key, value in sharded_sd.items():
            assert isinstance(value, DTensor), f"step {step}: {key} is not sharded between forward and backward"
            assert_equal(value.to_local(), before[key], f"step {step}: {key} between forward and backward")
        loss.backward()
        optim.step()
        optim.zero_grad()
        ref_loss = ref_model(inp).sum()
        ref_loss.backward()
        average_grads(ref_model)
        ref_optim.step()
        ref_optim.zero_grad()
        assert_equal(loss.detach(), ref_loss.detach(), f"step {step} loss", rtol=1.3e-6, atol=1e-5)
        impl.check_sharded_parity(ref_model, model)
        record_sd(impl, f"step {step}: optim state_dict", optim.state_dict())
        losses.append(loss.detach())
    return {"losses": losses, "params": impl.full_params(model)}


@cases.case()
def dp_state_dict_save_load_dcp_relayout(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess::test_dp_state_dict_save_load
    (save/load, through DCP as FSDP2 users do) — ``dcp.save`` of a sharded state dict (per-MLP units,
    MLP buffers included) loads with ``dcp.load`` + ``load_state_dict`` into a model sharded as one
    unit and into an unsharded model; an unsharded model's DCP checkpoint loads into a sharded one.
    Every loaded parameter and buffer equals the source's and the outputs agree."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    mlp_dim = 5
    source = mlp_stack(mlp_dim, seed=42, with_buffer=True)  # the unsharded truth
    expected_sd = {k: v.detach().clone() for k, v in source.state_dict().items()}
    rank_seed(rank)
    inp = torch.randn((3, mlp_dim))
    expected_out = source(inp).detach()
    outs = {}

    def check(model, what):
        full = {n: p.full_tensor().detach() if isinstance(p, DTensor) else p.detach() for n, p in model.named_parameters()}
        for name, value in expected_sd.items():
            got = full[name] if name in full else model.get_buffer(name)
            assert_equal(got, value, f"{what}: {name}")
        outs[what] = model(inp).detach()
        assert_equal(outs[what], expected_out, f"{what}: output", rtol=1.3e-6, atol=1e-5)

    with shared_tmpdir() as tmp:
        sharded = shard_children(impl, copy.deepcopy(source))
        record_sd(impl, "saved state_dict", sharded.state_dict())
        dcp.save(sharded.state_dict(), checkpoint_id=os.path.join(tmp, "sharded"))

        # Another layout: the whole model as one unit, other initial values
        one_unit = impl.fully_shard(mlp_stack(mlp_dim, seed=7, with_buffer=True))
        sd = one_unit.state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(tmp, "sharded"))
        record_sd(impl, "one unit: loaded state_dict", sd)
        one_unit.load_state_dict(sd)
        check(one_unit, "sharded -> one unit")

        # An unsharded model
        plain = mlp_stack(mlp_dim, seed=7, with_buffer=True)
        sd = plain.state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(tmp, "sharded"))
        plain.load_state_dict(sd)
        check(plain, "sharded -> unsharded")

        # From an unsharded model's checkpoint into a sharded model
        dcp.save(source.state_dict(), checkpoint_id=os.path.join(tmp, "plain"))
        target = shard_children(impl, mlp_stack(mlp_dim, seed=7, with_buffer=True), reshard_after_forward=False)
        sd = target.state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(tmp, "plain"))
        record_sd(impl, "unsharded -> sharded: loaded state_dict", sd)
        target.load_state_dict(sd)
        check(target, "unsharded -> sharded")
    return outs


def _train_steps(model, optim, inputs, replicated=False):
    losses = []
    for inp in inputs:
        loss = model(inp).sum()
        loss.backward()
        if replicated:  # the replicated reference: average the gradients (DDP)
            average_grads(model)
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses


@cases.case()
def dp_state_dict_save_load_dsd_sharded(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess::test_dp_state_dict_save_load
    (through the stock DSD API) — ``get_state_dict(model, optim)`` (sharded, default options) saved
    with DCP, loaded into a freshly initialised model sharded in another layout with its own Adam
    (``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``): training continues exactly as
    without the interruption."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: PLC0415

    mlp_dim = 5
    rank_seed(rank)
    inputs = [torch.randn((2, mlp_dim)) for _ in range(4)]
    model = shard_children(impl, mlp_stack(mlp_dim))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train_steps(model, optim, inputs[:2])
    with shared_tmpdir() as tmp:
        msd, osd = get_state_dict(model, optim)
        record_sd(impl, "get_state_dict model", msd)
        record_sd(impl, "get_state_dict optim", osd)
        for name, value in msd.items():
            assert isinstance(value, DTensor), f"get_state_dict: {name} is not a DTensor"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp)
        expected = _train_steps(model, optim, inputs[2:])

        model2 = impl.fully_shard(mlp_stack(mlp_dim, seed=7))  # one unit, other values
        optim2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
        msd2, osd2 = get_state_dict(model2, optim2)
        dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=tmp)
        record_sd(impl, "loaded model", msd2)
        record_sd(impl, "loaded optim", osd2)
        set_state_dict(model2, optim2, model_state_dict=msd2, optim_state_dict=osd2)
        resumed = _train_steps(model2, optim2, inputs[2:])
    assert_equal(torch.stack(resumed), torch.stack(expected), "losses after resuming", rtol=1.3e-6, atol=1e-5)
    full, full2 = impl.full_params(model), impl.full_params(model2)
    for name in full:
        assert_equal(full2[name], full[name], f"{name} after resuming", rtol=1.3e-6, atol=1e-5)
    return {"losses": resumed, "params": full2}


@cases.case()
def dp_state_dict_save_load_dsd_full_set(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess::test_dp_state_dict_save_load
    (loading a full state dict, the stock way) — ``set_state_dict(model, optim, ...,
    StateDictOptions(full_state_dict=True[, broadcast_from_rank0=True]))`` of an unsharded model's
    and Adam's full state dicts into a freshly initialised sharded model: training then matches the
    replicated reference."""
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

    mlp_dim = 5
    out = {}
    for broadcast_from_rank0 in (False, True):
        ref_model = mlp_stack(mlp_dim)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        rank_seed(rank)
        inputs = [torch.randn((2, mlp_dim)) for _ in range(3)]
        _train_steps(ref_model, ref_optim, inputs[:1], replicated=True)
        # A copy, as if read from a file: Optimizer.load_state_dict keeps the given 'step' tensors, which
        # would otherwise be the reference optimizer's own (stepped twice per step below).
        full_msd, full_osd = copy.deepcopy(
            get_state_dict(ref_model, ref_optim, options=StateDictOptions(full_state_dict=True)))

        model = shard_children(impl, mlp_stack(mlp_dim, seed=7))
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        if broadcast_from_rank0:  # only rank 0 holds the full state dicts
            options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
            set_model_state_dict(model, full_msd if rank == 0 else {}, options=options)
            set_optimizer_state_dict(model, optim, full_osd if rank == 0 else {}, options=options)
        else:
            set_state_dict(model, optim, model_state_dict=full_msd, optim_state_dict=full_osd,
                           options=StateDictOptions(full_state_dict=True))
        impl.check_sharded_parity(ref_model, model)
        ref_losses = _train_steps(ref_model, ref_optim, inputs[1:], replicated=True)
        losses = _train_steps(model, optim, inputs[1:])
        assert_equal(torch.stack(losses), torch.stack(ref_losses), "losses", rtol=1.3e-6, atol=1e-5)
        impl.check_sharded_parity(ref_model, model)
        record_sd(impl, f"broadcast_from_rank0={broadcast_from_rank0}: state_dict", model.state_dict())
        record_sd(impl, f"broadcast_from_rank0={broadcast_from_rank0}: optim state_dict", optim.state_dict())
        out[f"broadcast_from_rank0={broadcast_from_rank0}"] = {"losses": losses, "params": impl.full_params(model)}
    return out


def _test_cached_state_dict(rank, impl, mlp_dim: int, mutate_after_state_dict: bool):
    torch.manual_seed(42)
    model = nn.Linear(mlp_dim, mlp_dim, bias=False)
    impl.fully_shard(model, reshard_after_forward=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    # call .state_dict() once and use `sd` directly to reduce cpu overhead
    sd = model.state_dict()
    record_sd(impl, "state_dict", sd)
    assert isinstance(model.weight, DTensor), f"Expected DTensor, got {type(model.weight)}"

    def storage_ptr(t):
        return t.untyped_storage().data_ptr()

    if not mutate_after_state_dict:
        assert storage_ptr(sd["weight"]._local_tensor) == storage_ptr(model.weight._local_tensor)
    else:
        # Upstream: model.cpu(); model.cuda() (a move that re-creates the sharded storage). On a CPU-only
        # machine the round trip through another dtype is the re-creating move (values exact).
        model = model.to(torch.float64)
        model = model.to(torch.float32)
        assert storage_ptr(sd["weight"]._local_tensor) != storage_ptr(model.weight._local_tensor)

    torch.manual_seed(42 + rank)
    inp = torch.rand(mlp_dim, mlp_dim)
    losses = []
    for _ in range(5):
        losses.append(train_step(model, optim, inp))
        if not mutate_after_state_dict:
            assert storage_ptr(sd["weight"]._local_tensor) == storage_ptr(model.weight._local_tensor), (
                "the cached state dict no longer shares the parameter's storage after an optimizer step")
    return losses


@cases.case()
def cached_state_dict(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess::test_cached_state_dict
    (mutate_after_state_dict=False, mlp_dim 2..5) — a state dict taken once keeps sharing the
    sharded parameter's storage through 5 AdamW steps (a trainer may cache it)."""
    return [_test_cached_state_dict(rank, impl, mlp_dim, False) for mlp_dim in (2, 3, 4, 5)]


@cases.case()
def cached_state_dict_mutate(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess::test_cached_state_dict
    (mutate_after_state_dict=True, mlp_dim 2..5) — after the model is moved away and back (here
    ``model.to(float64).to(float32)``, upstream ``.cpu().cuda()``) the old state dict no longer
    shares its storage, and training runs."""
    return [_test_cached_state_dict(rank, impl, mlp_dim, True) for mlp_dim in (2, 3, 4, 5)]


def _test_dp_state_dict_cpu_offload(impl, offload_policy):
    """Upstream's ``_test_dp_state_dict_cpu_offload`` with cpu_state_dict=True."""
    mlp_dim = 4
    torch.manual_seed(42)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(mlp_dim, mlp_dim, bias=False), nn.Linear(mlp_dim, mlp_dim, bias=False))
    shard_children(impl, model, offload_policy=offload_policy)

    # split full sd into multiple pieces to test loading with `strict=False`
    state_dicts = []
    full_values = {}
    for name, dtensor in model.named_parameters():
        full_tensor = torch.randn(dtensor.size())
        full_values[name] = full_tensor
        sharded_tensor = distribute_tensor(full_tensor, dtensor.device_mesh, dtensor.placements)
        state_dicts.append({name: sharded_tensor.cpu()})
    # check that we can load with some parameters still on meta device
    for sd in state_dicts:
        model.load_state_dict(sd, assign=True, strict=False)

    # lazy init without error
    inp = torch.rand((mlp_dim, mlp_dim))
    out = model(inp).sum()
    state_dict = model.state_dict()
    record_sd(impl, "state_dict", state_dict)
    for name, value in state_dict.items():
        assert value.device.type == "cpu", f"{name} is on {value.device}"
    full = impl.full_params(model)
    for name, value in full_values.items():
        assert_equal(full[name], value, f"{name} after loading")
    return {"out": out.detach(), "params": full}


@cases.case()
def dp_state_dict_cpu_offload(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess::test_dp_state_dict_cpu_offload
    (``CPUOffloadPolicy(pin_memory=False)``, cpu_state_dict=True) — a meta-device model sharded with CPU
    offload loads sharded values one parameter at a time (``load_state_dict(sd, assign=True,
    strict=False)``, the others still on meta), runs forward (lazy init), and its state dict is on
    the CPU with the loaded values. (pin_memory=True needs CUDA; cpu_state_dict=False expects an error
    about parameters on a non-CPU device, which cannot happen on a CPU-only machine.)"""
    return _test_dp_state_dict_cpu_offload(impl, impl.CPUOffloadPolicy(pin_memory=False))


@cases.case()
def dp_state_dict_cpu_offload_meta_assign(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess::test_dp_state_dict_cpu_offload
    (its loading path without the offload: ``OffloadPolicy()``) — a meta-device sharded model takes
    sharded values parameter by parameter with ``load_state_dict(sd, assign=True, strict=False)``,
    runs forward and holds the loaded values."""
    return _test_dp_state_dict_cpu_offload(impl, impl.OffloadPolicy())


# ============================================================================ TestFullyShardStateDictMultiThread
def _transformer_and_sharded(impl):
    model_args = ModelArgs(dropout_p=0.0)
    torch.manual_seed(42)
    ref_model = Transformer(model_args)
    for param in ref_model.parameters():
        dist.broadcast(param.detach(), src=0)
    model = copy.deepcopy(ref_model)
    shard_transformer(impl, model)
    return ref_model, model


def _check_rank0_full_sd(rank, full_sd: dict, ref_full_sd: dict | None) -> None:
    if rank == 0:
        assert len(full_sd) == len(ref_full_sd), f"{len(full_sd)} entries, the unsharded model has {len(ref_full_sd)}"
        assert list(full_sd.keys()) == list(ref_full_sd.keys()), f"{list(full_sd)} vs {list(ref_full_sd)}"
        for (name, param), ref_param in zip(full_sd.items(), ref_full_sd.values()):
            assert not isinstance(param, DTensor), f"{name} is not a plain full tensor: {type(param).__name__}"
            assert param.device == torch.device("cpu")
            assert param.device == ref_param.device
            assert_equal(param, ref_param, name)
    else:
        assert len(full_sd) == 0, f"rank {rank} holds {len(full_sd)} entries; expected none"


@cases.case()
def rank0_offload_full_state_dict(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiThread::test_rank0_offload_full_state_dict
    — the sharded state dict of a Transformer (blocks and root sharded), made full value by value
    (``full_tensor()``) and kept on the CPU on rank 0 only, has the
    unsharded model's keys in order and its values (tied output/embedding weight included)."""
    ref_model, model = _transformer_and_sharded(impl)
    sharded_sd = model.state_dict()
    record_sd(impl, "state_dict", sharded_sd)
    ref_full_sd = {k: v.cpu() for k, v in ref_model.state_dict().items()} if rank == 0 else None
    full_sd = {}
    for name, sharded_param in sharded_sd.items():
        assert isinstance(sharded_param, DTensor), f"{name} is not a DTensor"
        full_param = sharded_param.full_tensor()
        if rank == 0:
            full_sd[name] = full_param.cpu()
    _check_rank0_full_sd(rank, full_sd, ref_full_sd)
    return full_sd


@cases.case()
def rank0_offload_full_state_dict_dsd(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiThread::test_rank0_offload_full_state_dict
    (the stock way to get it) — ``get_model_state_dict`` / ``get_state_dict`` with
    ``StateDictOptions(full_state_dict=True, cpu_offload=True)`` give rank 0 the unsharded model's
    (and, after an Adam step, the unsharded optimizer's) full state dict on the CPU, and the other
    ranks nothing."""
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    ref_model, model = _transformer_and_sharded(impl)
    full_sd = get_model_state_dict(model, options=options)
    record_sd(impl, "get_model_state_dict", full_sd)
    ref_full_sd = {k: v.cpu() for k, v in ref_model.state_dict().items()} if rank == 0 else None
    _check_rank0_full_sd(rank, full_sd, ref_full_sd)

    # After one Adam step: model and optimizer, against the replicated reference's
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    rank_seed(rank)
    inp = torch.randint(0, model.model_args.vocab_size, (3, 16))
    _train_steps(ref_model, ref_optim, [inp], replicated=True)
    _train_steps(model, optim, [inp])
    msd, osd = get_state_dict(model, optim, options=options)
    record_sd(impl, "get_state_dict model", msd)
    record_sd(impl, "get_state_dict optim", osd)
    ref_msd, ref_osd = get_state_dict(ref_model, ref_optim, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        _check_rank0_full_sd(rank, msd, {k: v.cpu() for k, v in ref_msd.items()})
        assert set(osd["state"]) == set(ref_osd["state"]), f"{sorted(osd['state'])} vs {sorted(ref_osd['state'])}"
        for name, ref_state in ref_osd["state"].items():
            for key, ref_value in ref_state.items():
                value = osd["state"][name][key]
                assert not isinstance(value, DTensor), f"optimizer state {name}.{key} is not a full tensor"
                assert_equal(value, ref_value, f"optimizer state {name}.{key}", rtol=1.3e-6, atol=1e-5)
    else:
        _check_rank0_full_sd(rank, msd, None)
        assert len(osd) == 0 or not osd.get("state"), f"rank {rank} holds optimizer state {list(osd)}"
    return {"model": full_sd, "trained": msd, "optim_state": osd.get("state", {}) if rank == 0 else {}}


test_case = cases.pytest_tests()
