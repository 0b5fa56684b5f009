"""Port of upstream ``test/distributed/_composable/fsdp/test_fully_shard_state_dict.py``.

A fully_shard'ed model's ``state_dict()`` has the unsharded model's keys and holds sharded values
that share storage with the sharded parameters; ``load_state_dict`` of sharded values writes into the
sharded parameters in place; the state dict is sharded also after a forward that left the
parameters unsharded; the values stay the parameters' storage across optimizer steps; a full state
dict on rank 0 (CPU) equals the unsharded model's.

torch's values are DTensors (``Shard(0)``), flashfsdp's are ``flashfsdp.ShardedPiece`` (the
parameter's full shape around this rank's 1-D range of the flattened parameter). Upstream's DTensor
calls are adapted through the helpers below (``to_local()`` -> :func:`sd_local`, ``full_tensor()``
-> :func:`sd_full`, ``distribute_tensor`` -> :func:`sharded_value`); the operations upstream runs on
state-dict values themselves (``detach().clone().fill_()``) are kept as they are in
``dp_state_dict_save_load_value_ops``.

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
from torch.testing._internal.common_fsdp import MLP
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

from tests.fsdp2_suite.common import average_grads, rank_seed, shard_transformer, train_step
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)

UPSTREAM = "test/distributed/_composable/fsdp/test_fully_shard_state_dict.py"


# ============================================================================ helpers
def sd_is_sharded(impl, value) -> bool:
    """Whether a state-dict value is the implementation's sharded value (upstream: ``isinstance(v, DTensor)``)."""
    if impl.name == "torch":
        from torch.distributed.tensor import DTensor  # noqa: PLC0415

        return isinstance(value, DTensor)
    return isinstance(value, impl.api.ShardedPiece)


def sd_local(impl, value) -> torch.Tensor:
    """This rank's values of a sharded state-dict value (upstream: ``to_local()``)."""
    return value.to_local() if impl.name == "torch" else value.local()


def sd_full(impl, value) -> torch.Tensor:
    """The full tensor of a sharded state-dict value (upstream: ``full_tensor()``); collective."""
    if impl.name == "torch":
        return value.full_tensor()
    mine = (value.start, value.local().detach().clone())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    flat = torch.full((value.shape.numel(),), float("nan"), dtype=value.dtype)
    for start, local in everyone:
        flat[start : start + local.numel()] = local
    return flat.view(value.shape)


def sharded_value(impl, full: torch.Tensor, param: nn.Parameter) -> torch.Tensor:
    """A sharded state-dict value of ``param`` holding ``full`` (upstream: ``distribute_tensor(full,
    param.device_mesh, param.placements)``)."""
    if impl.name == "torch":
        from torch.distributed.tensor import distribute_tensor  # noqa: PLC0415

        return distribute_tensor(full, param.device_mesh, param.placements)
    return impl.api.ShardedPiece(impl.shard_of(full, param).clone(), impl.full_shape(param),
                                 param._flashfsdp_piece.param_start)


def filled_like(impl, value, fill) -> torch.Tensor:
    """A new sharded value like ``value`` whose local values are all ``fill`` (upstream builds it with
    ``value.detach().clone().fill_(fill)``, see ``dp_state_dict_save_load_value_ops`` for that call)."""
    if impl.name == "torch":
        return value.detach().clone().fill_(fill)
    return impl.api.ShardedPiece(torch.full_like(value.local(), fill), value.shape, value.start)


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
        assert impl.is_sharded(param), f"expects parameters to be sharded but got {name} as {type(param)}"
    old_fill_value = 1
    new_fill_value = 42 + rank
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(old_fill_value)
    # Use that the parameters are currently sharded, meaning that their data pointers correspond to
    # the sharded parameter data
    param_name_to_data_ptr = {n: impl.local(p).data_ptr() for n, p in model.named_parameters()}
    ref_sharded_sizes = [p.size() for p in model.parameters()]
    state_dict = model.state_dict()
    for param, ref_sharded_size in zip(model.parameters(), ref_sharded_sizes):
        assert param.size() == ref_sharded_size
        assert isinstance(param, nn.Parameter)

    # Verify that keys match, values are sharded, and values share the same storage as the existing
    # sharded parameter data
    assert set(state_dict.keys()) == set(param_name_to_data_ptr.keys()), (
        f"{sorted(state_dict)} vs {sorted(param_name_to_data_ptr)}")
    for name, tensor in state_dict.items():
        assert sd_is_sharded(impl, tensor), f"{name}: {type(tensor).__name__} is not a sharded value"
        if param_name_to_data_ptr[name] == 0:
            # Check that this is padding (added by DTensor, on trailing ranks only). Adapted: a flashfsdp
            # piece is empty when this rank's range of the unit's flat buffer holds none of the
            # parameter, which can be any rank's.
            if impl.name == "torch":
                assert rank > 0
            else:
                assert sd_local(impl, tensor).numel() == 0, f"{name}: null data pointer but a non-empty piece"
            assert torch.count_nonzero(sd_local(impl, tensor)).item() == 0
        else:
            assert sd_local(impl, tensor).data_ptr() == param_name_to_data_ptr[name], (
                f"{name}: the state-dict value does not share the sharded parameter's storage")

    # Verify that we can load a new state dict that contains sharded values with storages different
    # from the current model parameters
    new_state_dict = {name: filled_like(impl, value, new_fill_value) for name, value in state_dict.items()}
    for param in model.parameters():
        assert_equal(impl.local(param), torch.ones_like(impl.local(param)) * old_fill_value, "before load")
    model.load_state_dict(new_state_dict)
    for name, param in model.named_parameters():
        local_param = impl.local(param)
        assert_equal(local_param, torch.ones_like(local_param) * new_fill_value, f"{name} after load")
        # Only guarantee that the local tensor's data pointer does not change if the sharding was even
        # (i.e. no padding); otherwise, FSDP may re-pad the local tensor, changing its data pointer.
        # (flashfsdp writes into its flat shard in place: always the same pointer.)
        even = impl.name == "flashfsdp" or local_param.size(0) * dist.get_world_size() == param.size(0)
        if even:
            assert local_param.data_ptr() == param_name_to_data_ptr[name], f"{name}: data pointer changed on load"
    return len(state_dict)


def _test_dp_state_dict_save_load(rank, impl, mlp_dim: int) -> list[int]:
    """Upstream's ``_test_dp_state_dict_save_load`` on a 1-D mesh without ``shard_placement_fn``."""
    base_model = mlp_stack(mlp_dim)
    # Check basic `reshard_after_forward=True`
    model1 = shard_children(impl, copy.deepcopy(base_model))
    # The keys (and their order) are the unsharded model's
    assert list(model1.state_dict()) == list(base_model.state_dict()), (
        f"{list(model1.state_dict())} vs {list(base_model.state_dict())}")
    out = [_test_state_dict_save_load(rank, impl, model1)]

    # Check `reshard_after_forward=False` before and after a forward
    model2 = shard_children(impl, copy.deepcopy(base_model), reshard_after_forward=False)
    out.append(_test_state_dict_save_load(rank, impl, model2))
    ref_sharded_sd = model2.state_dict()
    inp = torch.randn((2, mlp_dim))
    model2(inp)  # parameters are not resharded after this forward
    # Check that state dict hooks reshard
    sharded_sd = model2.state_dict()
    assert set(ref_sharded_sd.keys()) == set(sharded_sd.keys())
    for key, value in ref_sharded_sd.items():
        assert sd_is_sharded(impl, sharded_sd[key]), f"{key}: state dict after forward is not sharded"
        assert sharded_sd[key].shape == value.shape
        assert_equal(sd_local(impl, sharded_sd[key]), sd_local(impl, value), f"{key} after forward")
    return out


@cases.case()
def dp_state_dict_save_load(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess::test_dp_state_dict_save_load
    (1-D mesh, mlp_dim 2..5) — state-dict keys equal the parameter names, values are sharded and share
    the sharded parameters' storage, loading new sharded values writes them in place, and with
    ``reshard_after_forward=False`` the state dict after a forward is the sharded one from before.
    New values are built per implementation (``filled_like``; upstream's ``clone().fill_()`` on the
    value is ``dp_state_dict_save_load_value_ops``)."""
    return [_test_dp_state_dict_save_load(rank, impl, mlp_dim) for mlp_dim in (2, 3, 4, 5)]


@cases.case()
def dp_state_dict_save_load_value_ops(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess::test_dp_state_dict_save_load
    (its construction of new values, as upstream writes it) — ``value.detach().clone().fill_(v)`` on a
    state-dict value gives a new sharded value of the same shape that ``load_state_dict`` writes into
    the parameters (DTensors support every op; this is what user code does to state-dict values)."""
    model = shard_children(impl, mlp_stack(3))
    state_dict = model.state_dict()
    new_state_dict = {name: value.detach().clone().fill_(42 + rank) for name, value in state_dict.items()}
    for name, value in new_state_dict.items():
        assert sd_is_sharded(impl, value) and value.shape == state_dict[name].shape
    model.load_state_dict(new_state_dict)
    for name, param in model.named_parameters():
        assert_equal(impl.local(param), torch.full_like(impl.local(param), 42 + rank), f"{name} after load")
    return len(state_dict)


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
        before = {k: sd_local(impl, v).clone() for k, v in model.state_dict().items()}
        loss = model(inp).sum()
        sharded_sd = model.state_dict()  # parameters are unsharded here
        assert set(sharded_sd) == set(before)
        for key, value in sharded_sd.items():
            assert sd_is_sharded(impl, value), f"step {step}: {key} is not sharded between forward and backward"
            assert_equal(sd_local(impl, value), before[key], f"step {step}: {key} between forward and backward")
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
        full = {n: impl.full(p).detach() if impl.is_sharded(p) else p.detach() for n, p in model.named_parameters()}
        for name, value in expected_sd.items():
            got = full[name] if name in full else model.get_buffer(name)
            assert_equal(got, value, f"{what}: {name}")
        outs[what] = model(inp).detach()
        assert_equal(outs[what], expected_out, f"{what}: output", rtol=1.3e-6, atol=1e-5)

    with shared_tmpdir() as tmp:
        sharded = shard_children(impl, copy.deepcopy(source))
        dcp.save(sharded.state_dict(), checkpoint_id=os.path.join(tmp, "sharded"))

        # Another layout: the whole model as one unit, other initial values
        one_unit = impl.fully_shard(mlp_stack(mlp_dim, seed=7, with_buffer=True))
        sd = one_unit.state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(tmp, "sharded"))
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
        for name, value in msd.items():
            assert sd_is_sharded(impl, value), f"get_state_dict: {name} is not sharded"
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp)
        expected = _train_steps(model, optim, inputs[2:])

        model2 = impl.fully_shard(mlp_stack(mlp_dim, seed=7))  # one unit, other values
        optim2 = torch.optim.Adam(model2.parameters(), lr=1e-2)
        msd2, osd2 = get_state_dict(model2, optim2)
        dcp.load({"model": msd2, "optim": osd2}, checkpoint_id=tmp)
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
        out[f"broadcast_from_rank0={broadcast_from_rank0}"] = {"losses": losses, "params": impl.full_params(model)}
    return out


def _test_cached_state_dict(rank, impl, mlp_dim: int, mutate_after_state_dict: bool):
    torch.manual_seed(42)
    model = nn.Linear(mlp_dim, mlp_dim, bias=False)
    impl.fully_shard(model, reshard_after_forward=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    # call .state_dict() once and use `sd` directly to reduce cpu overhead
    sd = model.state_dict()
    assert impl.is_sharded(model.weight), f"expected a sharded parameter, got {type(model.weight)}"

    def storage_ptr(t):
        return t.untyped_storage().data_ptr()

    if not mutate_after_state_dict:
        assert storage_ptr(sd_local(impl, sd["weight"])) == storage_ptr(impl.local(model.weight))
    else:
        # Upstream: model.cpu(); model.cuda() (a move that re-creates the sharded storage). On a CPU-only
        # machine the round trip through another dtype is the re-creating move (values exact).
        model = model.to(torch.float64)
        model = model.to(torch.float32)
        assert storage_ptr(sd_local(impl, sd["weight"])) != storage_ptr(impl.local(model.weight))

    torch.manual_seed(42 + rank)
    inp = torch.rand(mlp_dim, mlp_dim)
    losses = []
    for _ in range(5):
        losses.append(train_step(model, optim, inp))
        if not mutate_after_state_dict:
            assert storage_ptr(sd_local(impl, sd["weight"])) == storage_ptr(impl.local(model.weight)), (
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
    for name, param in model.named_parameters():
        full_tensor = torch.randn(impl.full_shape(param))
        full_values[name] = full_tensor
        state_dicts.append({name: sharded_value(impl, full_tensor, param).cpu()})
    # check that we can load with some parameters still on meta device
    for sd in state_dicts:
        model.load_state_dict(sd, assign=True, strict=False)

    # lazy init without error
    inp = torch.rand((mlp_dim, mlp_dim))
    out = model(inp).sum()
    state_dict = model.state_dict()
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
            assert not sd_is_sharded_any(param), f"{name} is not a plain full tensor: {type(param).__name__}"
            assert param.device == torch.device("cpu")
            assert param.device == ref_param.device
            assert_equal(param, ref_param, name)
    else:
        assert len(full_sd) == 0, f"rank {rank} holds {len(full_sd)} entries; expected none"


def sd_is_sharded_any(value) -> bool:
    from torch.distributed.tensor import DTensor  # noqa: PLC0415

    import flashfsdp  # noqa: PLC0415

    return isinstance(value, (DTensor, flashfsdp.ShardedPiece))


@cases.case()
def rank0_offload_full_state_dict(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiThread::test_rank0_offload_full_state_dict
    — the sharded state dict of a Transformer (blocks and root sharded), made full value by value
    (``full_tensor()``, adapted: :func:`sd_full`) and kept on the CPU on rank 0 only, has the
    unsharded model's keys in order and its values (tied output/embedding weight included)."""
    ref_model, model = _transformer_and_sharded(impl)
    sharded_sd = model.state_dict()
    ref_full_sd = {k: v.cpu() for k, v in ref_model.state_dict().items()} if rank == 0 else None
    full_sd = {}
    for name, sharded_param in sharded_sd.items():
        assert sd_is_sharded(impl, sharded_param), f"{name} is not sharded"
        full_param = sd_full(impl, sharded_param)
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
    ranks nothing. (flashfsdp documents that these getters raise today.)"""
    from torch.distributed.checkpoint.state_dict import (  # noqa: PLC0415
        StateDictOptions,
        get_model_state_dict,
        get_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    ref_model, model = _transformer_and_sharded(impl)
    full_sd = get_model_state_dict(model, options=options)
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
    ref_msd, ref_osd = get_state_dict(ref_model, ref_optim, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        _check_rank0_full_sd(rank, msd, {k: v.cpu() for k, v in ref_msd.items()})
        assert set(osd["state"]) == set(ref_osd["state"]), f"{sorted(osd['state'])} vs {sorted(ref_osd['state'])}"
        for name, ref_state in ref_osd["state"].items():
            for key, ref_value in ref_state.items():
                value = osd["state"][name][key]
                assert not sd_is_sharded_any(value), f"optimizer state {name}.{key} is not a full tensor"
                assert_equal(value, ref_value, f"optimizer state {name}.{key}", rtol=1.3e-6, atol=1e-5)
    else:
        _check_rank0_full_sd(rank, msd, None)
        assert len(osd) == 0 or not osd.get("state"), f"rank {rank} holds optimizer state {list(osd)}"
    return {"model": full_sd, "trained": msd, "optim_state": osd.get("state", {}) if rank == 0 else {}}


test_case = cases.pytest_tests()
