"""Port of upstream's FSDP + tensor parallelism cases (2-D ``(dp, tp)`` and 3-D HSDP + TP meshes).

``parallelize_module(model, mesh["tp"], plan)`` makes the parameters DTensors on the TP mesh, then
``fully_shard(module, mesh=mesh["dp"])`` (HSDP: ``mesh["dp_replicate", "dp_shard"]``) shards
their TP-local tensors over the data-parallel ranks. Both implementations give each sharded
parameter as a DTensor on the joined mesh with FSDP2's placements (a colwise weight
``(_StridedShard(0, split_factor=tp), Shard(0))``, a rowwise one ``(Shard(0), Shard(1))``, a
replicated one ``(Shard(0), Replicate())``); every case runs at W = 4 on gloo ranks, compares the
values with torch's ``fully_shard`` and the logged types, placements and shapes
(``Impl.record_types``).

Upstream files: test_fully_shard_training.py (``TestFullyShard2DTraining``,
``TestFullyShardHSDP3DTraining``), test_fully_shard_init.py (2-D init), test_fully_shard_state_dict.py
(2-D state dicts), test_fully_shard_clip_grad_norm_.py (``test_clip_grad_norm_2d``).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._composable import checkpoint
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.distributed.tensor.placement_types import _StridedShard
from torch.testing._internal.common_fsdp import MLP, MLPStack
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer, TransformerBlock

from tests.fsdp2_suite.common import FP32, average_grads, rank_seed
from tests.fsdp2_suite.runner import CaseSet
from tests.fsdp2_suite.test_clip_grad_norm import _test_clip_grad_norm, stock_clip
from tests.fsdp2_suite.test_init import assert_raises
from tests.fsdp2_suite.test_state_dict import _test_state_dict_save_load, assert_equal, record_sd, shared_tmpdir

cases = CaseSet(__name__)


def mesh_2d():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def mesh_3d(replicas: int, shards: int):
    return init_device_mesh("cpu", (replicas, shards, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))


def parallelize_mlp_stack(impl, model: MLPStack, tp_mesh, dp_mesh, use_activation_checkpointing: bool = False,
                          **fsdp_kwargs) -> MLPStack:
    """Upstream's ``MLPStack.parallelize`` with the implementation's ``fully_shard``."""
    plan = {
        "0.in_proj": ColwiseParallel(use_local_output=False),
        "0.out_proj": RowwiseParallel(use_local_output=False),
        "1.in_proj": ColwiseParallel(use_local_output=False),
        "1.out_proj": RowwiseParallel(use_local_output=False),
        "2.in_proj": ColwiseParallel(use_local_output=False),
        "2.out_proj": RowwiseParallel(output_layouts=Shard(1)) if model.with_seq_parallel else RowwiseParallel(),
    }
    if model.with_seq_parallel:
        plan["3"] = SequenceParallel(sequence_dim=1)
    parallelize_module(model, device_mesh=tp_mesh, parallelize_plan=plan)
    for module in model:
        if isinstance(module, nn.LayerNorm):
            continue
        if use_activation_checkpointing:
            checkpoint(module)
        impl.fully_shard(module, mesh=dp_mesh, **fsdp_kwargs)
    impl.fully_shard(model, mesh=dp_mesh, **fsdp_kwargs)
    return model


def record_params(impl, tag: str, model: nn.Module) -> None:
    impl.record_types(tag, {n: p for n, p in model.named_parameters()})
    impl.record_types(f"{tag} grads", {n: p.grad for n, p in model.named_parameters()})


def parity_step(impl, ref: tuple, sharded: tuple, inp, iter_idx: int, tol: dict) -> torch.Tensor:
    """One of upstream's parity iterations: zero_grad (to None on even iterations), forward,
    backward and step of the replicated reference (gradients averaged: every DP input appears once
    per TP rank, so the world mean is the DP mean) and of the sharded model (its parameters' and
    gradients' types logged); the losses equal. Returns the sharded model's loss."""
    losses = []
    for model, optim in (ref, sharded):
        optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
        losses.append(model(inp).sum())
        losses[-1].backward()
        if model is ref[0]:
            average_grads(model)
        else:
            record_params(impl, f"iter {iter_idx}", model)
        optim.step()
    torch.testing.assert_close(losses[1], losses[0], **tol)
    return losses[1].detach()


def _mlp_parity(impl, mesh, dp_mesh, tp_mesh, dp_group, reshard_after_forward: bool, use_activation_checkpointing: bool,
                mlp_dim: int, iters: int = 3) -> list:
    """Upstream's ``_test_train_parity_2d_mlp`` / ``_test_3d_mlp_with_nd_mesh``: MLPStack parallelized,
    vs the reference replicated over DP (inputs per DP rank, the same on the TP ranks)."""
    torch.manual_seed(42)
    model = MLPStack(mlp_dim)
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2, foreach=False)
    parallelize_mlp_stack(impl, model, tp_mesh, dp_mesh, use_activation_checkpointing,
                          reshard_after_forward=reshard_after_forward)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    torch.manual_seed(42 + dist.get_rank(dp_group) + 1)
    losses = [parity_step(impl, (ref_model, ref_optim), (model, optim), torch.randn((8, mlp_dim)), i, FP32)
              for i in range(iters)]
    for name, p in model.named_parameters():
        assert isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == mesh.mesh_dim_names, name
        torch.testing.assert_close(p.full_tensor(), ref_model.get_parameter(name), **FP32)
    return losses


# ============================================================================ TestFullyShard2DTraining
@cases.case(4)
def train_parity_2d_mlp(rank, world_size, impl):
    """Upstream: test_fully_shard_training.py::TestFullyShard2DTraining::test_train_parity_2d_mlp.

    Two opposite corners of upstream's grid (reshard_after_forward x activation checkpointing x
    mlp_dim in 3, 5, 16, 17): (True, no checkpointing, 3: uneven TP and DP chunks) and (False,
    checkpointing, 16); 3 iterations instead of 10."""
    mesh = mesh_2d()
    out = []
    for raf, ac, dim in ((True, False, 3), (False, True, 16)):
        out += _mlp_parity(impl, mesh, mesh["dp"], mesh["tp"], mesh["dp"].get_group(), raf, ac, dim)
    return out


def _train_parity_2d_transformer(impl, use_seq_parallel: bool) -> list:
    """Upstream's ``_test_train_parity_2d_transformer`` (compile off)."""
    mesh = mesh_2d()
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    torch.manual_seed(42)
    model_args = ModelArgs(n_layers=2, dropout_p=0.0)
    model = Transformer(model_args)
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    # (local outputs for attention: DTensor has no CPU SDPA strategy)
    model = Transformer.parallelize(model, tp_mesh, use_seq_parallel, local_output_for_attn=True)
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            impl.fully_shard(module, mesh=dp_mesh)
    impl.fully_shard(model, mesh=dp_mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + dp_mesh.get_local_rank() + 1)
    tol = {"rtol": 1e-5, "atol": 1e-4}
    return [parity_step(impl, (ref_model, ref_optim), (model, optim),
                        torch.randint(0, model_args.vocab_size, (2, 16)), i, tol) for i in range(3)]


@cases.case(4, atol=1e-4)
def train_parity_2d_transformer(rank, world_size, impl):
    """Upstream: test_fully_shard_training.py::TestFullyShard2DTraining::test_train_parity_2d_transformer
    (use_seq_parallel=False; compile off), 2 layers, 3 iterations instead of 10."""
    return _train_parity_2d_transformer(impl, use_seq_parallel=False)


@cases.case(4, atol=1e-4)
def train_parity_2d_transformer_seq_parallel(rank, world_size, impl):
    """Upstream: test_fully_shard_training.py::TestFullyShard2DTraining::test_train_parity_2d_transformer
    (use_seq_parallel=True: the norms' Partial gradients are all-reduced over TP before the
    reduce-scatter)."""
    return _train_parity_2d_transformer(impl, use_seq_parallel=True)


@cases.case(4)
def tp_with_fsdp_offloading(rank, world_size, impl):
    """Upstream: test_fully_shard_training.py::TestFullyShard2DTraining::test_tp_with_fsdp_offloading.

    4-way TP and 1-way FSDP with ``CPUOffloadPolicy``: the parameters live on the CPU (upstream:
    moved there from CUDA; here the device is the CPU already, so the offload path's copies run
    host to host), and training matches the reference (3 iterations of upstream's 10; upstream's
    counts of FSDP2's no-op c10d calls are FSDP2 internals, not ported)."""
    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(42)
    model = MLPStack(16)
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2, foreach=False)
    parallelize_mlp_stack(impl, model, mesh["tp"], mesh["dp"], reshard_after_forward=True,
                          offload_policy=impl.CPUOffloadPolicy(pin_memory=False))
    for p in model.parameters():
        assert p.device.type == "cpu"
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=False)
    inp = torch.randn((4, 16))  # the same on all ranks
    return [parity_step(impl, (ref_model, ref_optim), (model, optim), inp, i, FP32) for i in range(3)]


# ============================================================================ TestFullyShardHSDP3DTraining
@cases.case(4)
def hsdp_3d_mlp_with_nd_mesh(rank, world_size, impl):
    """Upstream: test_fully_shard_training.py::TestFullyShardHSDP3DTraining::test_3d_mlp_with_nd_mesh.

    Upstream's (2, 2, 2) mesh at W = 8 becomes two W = 4 meshes (dp_replicate, dp_shard, tp) =
    (2, 1, 2) (replicas only) and (1, 2, 2) (shards only), each one corner of upstream's grid;
    the parameters are DTensors on the 3-D mesh, placements ``(Replicate(), <FSDP>, <TP>)``."""
    out = []
    for (replicas, shards), raf, ac, dim in (((2, 1), True, False, 17), ((1, 2), False, True, 3)):
        mesh = mesh_3d(replicas, shards)
        dp_mesh = mesh["dp_replicate", "dp_shard"]
        out += _mlp_parity(impl, mesh, dp_mesh, mesh["tp"], dp_mesh._flatten().get_group(), raf, ac, dim)
    return out


# ============================================================================ test_fully_shard_init.py
@cases.case(4)
def shard_dtensor_parameters(rank, world_size, impl):
    """Upstream: test_fully_shard_init.py::TestFullyShardShardedParameterDTensor::test_shard_dtensor_parameters
    (and the layout arithmetic of DTensor's test_utils.py::test_fsdp_tp_meta_compute on the result).

    An MLP (8 and, uneven, 9) parallelized colwise/rowwise on the TP mesh, then fully_shard'ed on the
    DP mesh: each parameter is a DTensor on the (dp, tp) mesh of the original shape and stride,
    placed as FSDP2 places it, whose full tensor is the original; its local tensor is the slice of
    the original at ``compute_local_shape_and_global_offset``'s offset."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset  # noqa: PLC0415

    mesh = mesh_2d()
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    out = []
    for mlp_dim in (8, 9):
        torch.manual_seed(42)
        model = MLP(mlp_dim, dim_multiplier=3)
        orig = {n: p.detach().clone() for n, p in model.named_parameters()}
        parallelize_module(model, tp_mesh, {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
        impl.fully_shard(model, mesh=dp_mesh)
        impl.record_types(f"mlp {mlp_dim}", {n: p for n, p in model.named_parameters()})
        assert len(list(model.parameters())) == len(orig)
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor) and param.device_mesh == mesh, name
            assert param.size() == orig[name].size() and param.stride() == orig[name].stride(), name
            if "in_proj" in name:
                expected = (_StridedShard(0, split_factor=tp_mesh.size()), Shard(0))
            elif "out_proj" in name and "weight" in name:
                expected = (Shard(0), Shard(1))
            else:
                expected = (Shard(0), Replicate())
            assert param.placements == expected, f"{name}: {param.placements} vs {expected}"
            assert_equal(param.full_tensor(), orig[name], name)
            shape, offset = compute_local_shape_and_global_offset(param.shape, mesh, param.placements)
            local = param.to_local()
            assert tuple(local.shape) == tuple(shape), f"{name}: local {tuple(local.shape)} vs {shape}"
            want = orig[name]
            for d, (o, n) in enumerate(zip(offset, shape)):
                want = want.narrow(d, o, n)
            assert_equal(local, want, f"{name} local")
            out.append(local.detach().clone())
    return out

@cases.case(4)
def meta_device_2d_init(rank, world_size, impl):
    """Upstream: test_fully_shard_init.py::TestFullyShardMetaDeviceInit::test_meta_device_2d_init.

    An MLP (8, and uneven 3) built on the meta device, parallelized and fully_shard'ed there (the
    parameters stay on meta), then ``to_empty`` + ``reset_parameters()`` and one training step
    (upstream's ``_test_to_empty_and_reset_parameters``). The TP parameters are initialised per
    shard as DTensors, as FSDP2's: the values after the step are compared with torch's."""
    from tests.fsdp2_suite.test_init import _to_empty_and_reset_parameters  # noqa: PLC0415

    mesh = mesh_2d()
    out = []
    for mlp_dim in (8, 3):
        torch.manual_seed(42)
        with torch.device("meta"):
            model = MLP(mlp_dim, with_buffer=True)
            parallelize_module(model, mesh["tp"], {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
            for p in model.parameters():
                assert p.device == torch.device("meta")
            for module in (model.in_proj, model.out_proj, model):
                impl.fully_shard(module, mesh=mesh["dp"])
        for p in model.parameters():
            assert p.device == torch.device("meta")
        _to_empty_and_reset_parameters(impl, model, mlp_dim)
        impl.record_types(f"mlp {mlp_dim}", {n: p for n, p in model.named_parameters()})
        out.append([p.to_local().detach().clone() for p in model.parameters()])
    return out


# ============================================================================ test_fully_shard_clip_grad_norm_.py
def _clip_2d(impl, norm_type: float) -> dict:
    """Upstream's ``_test_clip_grad_norm`` on the 2-D MLPStack with sequence parallelism: the
    stock ``torch.nn.utils.clip_grad_norm_`` of the sharded model's DTensor gradients equals the
    reference's total norm, and the clipped gradients the reference's."""
    from tests.fsdp2_suite.test_clip_grad_norm import count_all_reduces  # noqa: PLC0415

    mesh = mesh_2d()
    torch.manual_seed(42)
    model = MLPStack(16, with_seq_parallel=True)
    ref_model = copy.deepcopy(model)
    parallelize_mlp_stack(impl, model, mesh["tp"], mesh["dp"], reshard_after_forward=True)
    torch.manual_seed(42 + mesh["dp"].get_local_rank() + 1)
    inp = torch.randn(2, 16)
    ref_model(inp).sum().backward()
    average_grads(ref_model)
    model(inp).sum().backward()
    record_params(impl, f"norm {norm_type}", model)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm=1, norm_type=norm_type)
    with count_all_reduces() as all_reduces:
        norm = stock_clip(model, 1, norm_type)
        count = all_reduces()
    impl.record_types(f"norm {norm_type} total", norm)
    norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
    torch.testing.assert_close(norm, ref_norm, rtol=1.3e-6, atol=1e-5)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), ref_model.get_parameter(name).grad, rtol=1.3e-6, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}.grad after clipping: {m}")
    return {"norm": norm, "all_reduces": count}


@cases.case(4)
def clip_grad_norm_2d(rank, world_size, impl):
    """Upstream: test_fully_shard_clip_grad_norm_.py::TestClipGradNormWorldSize4::test_clip_grad_norm_2d
    (norm types 2, 1 and inf of upstream's 2, 1, 3, inf; one iteration), the functional all-reduces
    counted as torch's."""
    return [_clip_2d(impl, norm_type) for norm_type in (2.0, 1.0, float("inf"))]


@cases.case(4, torch_reason="flashfsdp's own clip_grad_norm_ and its refusal")
def clip_grad_norm_flashfsdp_2d_refused(rank, world_size, impl):
    """``flashfsdp.clip_grad_norm_`` (one all-reduce per unit communicator, over the DP ranks) does
    not sum over the TP ranks: it refuses a tensor-parallel parameter by name, before any
    communication, and names the stock function that is right."""
    import flashfsdp  # noqa: PLC0415

    mesh = mesh_2d()
    torch.manual_seed(42)
    model = parallelize_mlp_stack(impl, MLPStack(8), mesh["tp"], mesh["dp"])
    model(torch.randn(2, 8)).sum().backward()
    assert_raises(NotImplementedError, lambda: flashfsdp.clip_grad_norm_(model, 1.0), "'0.in_proj.weight'",
                  "torch.nn.utils.clip_grad_norm_")


@cases.case(4)
def flashfsdp_optim_2d(rank, world_size, impl):
    """flashfsdp.optim's AdamW steps a unit's flat shard as one tensor, which is elementwise and so
    right for tensor-parallel shards too: two steps of the 2-D MLPStack with it (flashfsdp) and with
    torch's AdamW (torch's fully_shard) give the same parameters. With ``max_grad_norm`` its
    clipping norm would need the TP ranks too: refused, naming the parameter."""
    import flashfsdp  # noqa: PLC0415

    mesh = mesh_2d()
    torch.manual_seed(42)
    model = parallelize_mlp_stack(impl, MLPStack(8), mesh["tp"], mesh["dp"])
    optim_cls = flashfsdp.optim.AdamW if impl.name == "flashfsdp" else torch.optim.AdamW
    optim = optim_cls(model.parameters(), lr=1e-2)
    torch.manual_seed(42 + mesh["dp"].get_local_rank() + 1)
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optim.step()
    if impl.name == "flashfsdp":
        clipping = flashfsdp.optim.AdamW(model.parameters(), lr=1e-2, max_grad_norm=1.0)
        assert_raises(NotImplementedError, clipping.step, "'0.in_proj.weight'", "tensor-parallel")
    return [p.to_local().detach().clone() for p in model.parameters()]


# ============================================================================ test_fully_shard_state_dict.py
TP_PLAN = {f"{i}.{name}": style() for i in range(3)
           for name, style in (("in_proj", ColwiseParallel), ("out_proj", RowwiseParallel))}


def mlp_stack_2d(impl, mlp_dim: int, dp_mesh, tp_mesh, seed: int = 42) -> tuple[nn.Module, nn.Module]:
    """Upstream's 2-D state-dict model: three MLPs parallelized colwise/rowwise, each a unit, then
    the root; and an unsharded copy of the same initial values."""
    torch.manual_seed(seed)
    model = nn.Sequential(*[MLP(mlp_dim) for _ in range(3)])
    ref_model = copy.deepcopy(model)
    parallelize_module(model, device_mesh=tp_mesh, parallelize_plan=TP_PLAN)
    for mlp in model:
        impl.fully_shard(mlp, mesh=dp_mesh)
    impl.fully_shard(model, mesh=dp_mesh)
    return ref_model, model


@cases.case(4)
def state_dict_2d_correctness(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess::test_2d_state_dict_correctness.

    The sharded state dict's keys are the unsharded model's, its values DTensors on the (dp, tp)
    mesh whose full tensors are the unsharded values; loaded back from full values it is unchanged."""
    mesh = mesh_2d()
    ref_model, model = mlp_stack_2d(impl, 4, mesh["dp"], mesh["tp"])
    ref_sd, sd = ref_model.state_dict(), model.state_dict()
    record_sd(impl, "state_dict", sd)
    assert list(ref_sd) == list(sd), f"{list(sd)} vs {list(ref_sd)}"
    for key, value in ref_sd.items():
        assert isinstance(sd[key], DTensor) and sd[key].device_mesh == mesh, key
        assert_equal(sd[key].full_tensor(), value, key)
    # DSD's full state dict (full_tensor() of each value) is the unsharded model's too
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict  # noqa: PLC0415

    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    record_sd(impl, "full state_dict", full_sd)
    for key, value in ref_sd.items():
        assert_equal(full_sd[key], value, f"full state dict: {key}")
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    model.load_state_dict({k: v.detach().clone() for k, v in sd.items()})
    return [v.to_local().clone() for v in model.state_dict().values()]


@cases.case(4)
def dp_tp_state_dict_save_load(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess::test_dp_tp_state_dict_save_load
    (mlp_dim 4 and 6 of 4, 6, 8, 10): ``_test_state_dict_save_load`` on the 2-D model — the state
    dict's DTensors share the parameters' storage, and a state dict of new DTensors loads in place."""
    mesh = mesh_2d()
    return [_test_state_dict_save_load(rank, impl, mlp_stack_2d(impl, dim, mesh["dp"], mesh["tp"])[1])
            for dim in (4, 6)]


@cases.case(4)
def hsdp_tp_state_dict_save_load(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess::test_hsdp_tp_state_dict_save_load
    on a (dp_replicate, dp_shard, tp) = (1, 2, 2) mesh (upstream's (2, 2, 2) needs W = 8)."""
    mesh = mesh_3d(1, 2)
    _, model = mlp_stack_2d(impl, 6, mesh["dp_replicate", "dp_shard"], mesh["tp"])
    return _test_state_dict_save_load(rank, impl, model)


@cases.case(4, torch_reason="flashfsdp's load_state_dict of full-shape plain tensors into sharded parameters")
def load_full_tensors_2d(rank, world_size, impl):
    """``load_state_dict`` of the unsharded model's plain tensors into the (dp, tp) model: each
    rank keeps its DP chunk of its TP part (uneven TP and DP chunks: mlp_dim 5)."""
    mesh = mesh_2d()
    ref_model, model = mlp_stack_2d(impl, 5, mesh["dp"], mesh["tp"], seed=7)
    torch.manual_seed(42)
    source = nn.Sequential(*[MLP(5) for _ in range(3)])
    model.load_state_dict(source.state_dict())
    for name, p in model.named_parameters():
        assert_equal(p.full_tensor(), source.get_parameter(name), name)
    return []


def _check_model(model: nn.Module, expected: dict, inp, expected_out, what: str) -> torch.Tensor:
    for name, value in expected.items():
        p = model.get_parameter(name)
        assert_equal(p.full_tensor() if isinstance(p, DTensor) else p, value, f"{what}: {name}")
    out = model(inp)
    out = out.full_tensor() if isinstance(out, DTensor) else out
    assert_equal(out, expected_out, f"{what}: output", rtol=1.3e-6, atol=1e-5)
    return out.detach()


@cases.case(4)
def dp_tp_state_dict_dcp_reshard(rank, world_size, impl):
    """Upstream: test_fully_shard_state_dict.py::TestFullyShardStateDictMultiProcess::test_dp_tp_state_dict_save_load
    (save/load through DCP, as FSDP2 users do): a (dp, tp) model's ``dcp.save`` loads into the 1-D
    FSDP layout over all 4 ranks, into (tp, dp) with the mesh dims the other way round, and into an
    unsharded model; a 1-D FSDP checkpoint loads into the (dp, tp) layout. Values and outputs are
    the source's."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    mesh = mesh_2d()
    source, model = mlp_stack_2d(impl, 6, mesh["dp"], mesh["tp"])
    expected = {n: p.detach().clone() for n, p in source.named_parameters()}
    rank_seed(0)
    inp = torch.randn(3, 6)
    expected_out = source(inp).detach()
    outs = []
    with shared_tmpdir() as tmp:
        dcp.save(model.state_dict(), checkpoint_id=os.path.join(tmp, "2d"))
        fsdp_1d = impl.fully_shard(nn.Sequential(*[impl.fully_shard(MLP(6)) for _ in range(3)]))
        swapped = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
        _, other_2d = mlp_stack_2d(impl, 6, swapped["dp"], swapped["tp"], seed=7)
        plain = nn.Sequential(*[MLP(6) for _ in range(3)])
        for what, target in (("2-D -> 1-D", fsdp_1d), ("2-D -> swapped 2-D", other_2d), ("2-D -> unsharded", plain)):
            sd = target.state_dict()
            dcp.load(sd, checkpoint_id=os.path.join(tmp, "2d"))
            record_sd(impl, f"{what}: loaded", sd)
            target.load_state_dict(sd)
            outs.append(_check_model(target, expected, inp, expected_out, what))
        dcp.save(fsdp_1d.state_dict(), checkpoint_id=os.path.join(tmp, "1d"))
        _, back = mlp_stack_2d(impl, 6, mesh["dp"], mesh["tp"], seed=7)
        sd = back.state_dict()
        dcp.load(sd, checkpoint_id=os.path.join(tmp, "1d"))
        back.load_state_dict(sd)
        outs.append(_check_model(back, expected, inp, expected_out, "1-D -> 2-D"))
    return outs


# ============================================================================ refusals
@cases.case(4, torch_reason="flashfsdp's own refusals")
def tensor_parallel_refusals(rank, world_size, impl):
    """What tensor parallelism is not supported with is refused at fully_shard, naming the
    parameter: a TP mesh that overlaps the DP mesh (one over all the ranks, or the DP mesh itself)
    rather than being its sibling dim, no mesh at all, a TP placement other than Shard/Replicate, and
    ``reshard_after_forward=<int>`` (as FSDP2, which refuses it in its post-forward reshard)."""
    from torch.distributed.tensor import Partial  # noqa: PLC0415

    mesh = mesh_2d()
    over_all = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))

    def tp_mlp(tp_mesh):
        torch.manual_seed(42)
        return parallelize_module(MLP(8), tp_mesh, {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})

    for tp_mesh, dp_mesh in ((over_all, mesh["dp"]), (mesh["dp"], mesh["dp"])):
        assert_raises(ValueError, lambda: impl.fully_shard(tp_mlp(tp_mesh), mesh=dp_mesh), "'in_proj.weight'",
                      "cannot be joined", "mesh['dp']")
    assert_raises(ValueError, lambda: impl.fully_shard(tp_mlp(mesh["tp"])), "'in_proj.weight'", "cannot be joined")
    dp4 = init_device_mesh("cpu", (world_size, 1), mesh_dim_names=("dp", "tp"))  # (k = 2 must divide DP < 4)
    assert_raises(NotImplementedError,
                  lambda: impl.fully_shard(tp_mlp(dp4["tp"]), mesh=dp4["dp"], reshard_after_forward=2),
                  "'in_proj.weight'", "reshard_after_forward=2", "tensor parallelism")
    partial = nn.Linear(4, 4)
    partial.weight = nn.Parameter(DTensor.from_local(torch.ones(4, 4), mesh["tp"], [Partial()]))
    assert_raises(NotImplementedError, lambda: impl.fully_shard(partial, mesh=mesh["dp"]), "'weight'", "Partial")
    model = impl.fully_shard(tp_mlp(mesh["tp"]), mesh=mesh["dp"])
    import flashfsdp  # noqa: PLC0415

    for name, call in (("get_full_state_dict", lambda: flashfsdp.get_full_state_dict(model)),
                       ("set_full_state_dict", lambda: flashfsdp.set_full_state_dict(model, {}))):
        assert_raises(NotImplementedError, call, name, "'in_proj.weight'", "tensor-parallel")
    return []


test_case = cases.pytest_tests()
