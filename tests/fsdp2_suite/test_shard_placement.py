"""Ported from FSDP2's tests: ``shard_placement_fn`` returning ``Shard(k)`` for k != 0.

Upstream: ``test/distributed/_composable/fsdp/test_fully_shard_init.py::TestFullyShardShardPlacementFn``
(largest dim, ``Shard(-1)``, uneven) and ``test_fully_shard_training.py::TestFullyShardShardPlacementFn*``
(training parity with the largest dim, contiguous ``Shard(1)`` parameters and gradients). Every
case runs against torch's ``fully_shard`` and flashfsdp's on gloo ranks and the results and the
logged types (placements, global and local shapes of parameters, gradients and state-dict values)
are compared (``runner.py``). Beyond upstream: HSDP, mixed precision, ``reshard_after_forward=<int>``,
CPU offload, state dicts (sharded, DCP, flashfsdp's full ones), ``clip_grad_norm_``; and uneven
chunks along dim k, which torch refuses (NotImplementedError) and flashfsdp shards as DTensor's
``distribute_tensor`` does — those run against flashfsdp only, checked against the replicated
reference and DTensor's own chunks. The dim-0 variants of the upstream cases live in
``test_init.py`` and ``test_training.py``.
"""

from __future__ import annotations

import copy
import os
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

from tests.fsdp2_suite.common import FP32, broadcast_params, rank_seed, shard_transformer, train_parity
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)
UNEVEN = "torch's fully_shard raises NotImplementedError for uneven sharding on a dim other than 0"


def largest_dim(param: nn.Parameter) -> Shard:
    """Upstream's placement: the parameter's largest dim (the first of equal ones)."""
    dim = max(range(param.ndim), key=lambda d: (param.shape[d], -d))
    return Shard(dim)


def check_placed(impl, model: nn.Module, ref: nn.Module, placement_of, mesh_placements=()) -> None:
    """Every sharded parameter is a DTensor placed ``mesh_placements + (placement_of(p),)`` (dim
    normalised), equal to the reference in full, with DTensor's own chunk of it as local tensor."""
    for (name, p), ref_p in zip(model.named_parameters(), ref.parameters()):
        dim = placement_of(ref_p).dim % ref_p.ndim
        assert isinstance(p, DTensor), f"{name}: {type(p).__name__}"
        assert p.placements == tuple(mesh_placements) + (Shard(dim),), f"{name}: {p.placements}"
        assert p.shape == ref_p.shape and impl.local(p).is_contiguous(), name
        expected = impl.shard_of(ref_p.detach(), p)
        torch.testing.assert_close(impl.local(p), expected, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(p.full_tensor(), ref_p.detach(), rtol=0, atol=0)
    impl.record_types("params", [p for p in model.parameters()])


def transformer(seed: int = 42, **kwargs) -> nn.Module:
    torch.manual_seed(seed)
    model = Transformer(ModelArgs(n_layers=2, dropout_p=0.0, **kwargs))
    broadcast_params(model)
    return model


# ============================================================================ TestFullyShardShardPlacementFn (init)
@cases.case()
def init_1d_transformer_shard_largest_dim(rank, world_size, impl):
    """Upstream: test_fully_shard_init.py::TestFullyShardShardPlacementFn::test_init_1d_transformer_shard_largest_dim
    (n_layers 2, W = 2; upstream 3 and 8): every parameter placed on its largest dim; then a
    forward/backward/Adam step equal to the replicated reference's."""
    model = transformer()
    ref = copy.deepcopy(model)
    shard_transformer(impl, model, shard_placement_fn=largest_dim)
    check_placed(impl, model, ref, largest_dim)
    rank_seed(rank)
    inp = torch.randint(0, 8, (2, 16))
    return train_parity(impl, ref, model, lambda i: inp, steps=2)


@cases.case()
def init_1d_transformer_shard_dim_neg1(rank, world_size, impl):
    """Upstream: test_fully_shard_init.py::TestFullyShardShardPlacementFn::test_init_1d_transformer_shard_dim_neg1:
    ``Shard(-1)`` for every parameter is ``Shard(ndim - 1)`` (1-D parameters: ``Shard(0)``)."""
    model = transformer()
    ref = copy.deepcopy(model)
    shard_transformer(impl, model, shard_placement_fn=lambda param: Shard(-1))
    check_placed(impl, model, ref, lambda param: Shard(-1))
    return impl.full_params(model)


@cases.case(world_size=4, torch_reason=UNEVEN)
def init_1d_uneven_shard_largest_dim(rank, world_size, impl):
    """Upstream: test_fully_shard_init.py::TestFullyShardShardPlacementFn::test_init_1d_uneven_shard_largest_dim
    (Linear(16, 17), Linear(17, 8), largest dims: the second weight's dim 1 of 17 over W = 4)
    expects NotImplementedError from FSDP2; flashfsdp shards it as ``distribute_tensor`` cuts it
    (chunks of 5, 5, 5, 2 columns) and trains it as the replicated reference (2 Adam steps)."""
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(16, 17), nn.Linear(17, 8))
    broadcast_params(model)
    ref = copy.deepcopy(model)
    impl.fully_shard(model, shard_placement_fn=largest_dim)
    assert model[1].weight.placements == (Shard(1),)
    check_placed(impl, model, ref, largest_dim)
    rank_seed(rank)
    return train_parity(impl, ref, model, lambda i: torch.randn(3, 16), steps=2)


@cases.case(world_size=4, torch_reason=UNEVEN)
def uneven_shard_last_dim_empty_chunks(rank, world_size, impl):
    """flashfsdp: the last dim of every parameter over W = 4 where sizes 7, 3 and 2 leave short
    and empty chunks (columns 2,2,2,1; 1,1,1,0; 1,1,0,0): DTensor's chunks, and training equal to
    the replicated reference (3 Adam steps)."""
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(7, 3), nn.ReLU(), nn.Linear(3, 2, bias=False), nn.Linear(2, 5))
    broadcast_params(model)
    ref = copy.deepcopy(model)
    impl.fully_shard(model, shard_placement_fn=lambda param: Shard(param.ndim - 1))
    check_placed(impl, model, ref, lambda param: Shard(param.ndim - 1))
    rank_seed(rank)
    return train_parity(impl, ref, model, lambda i: torch.randn(3, 7), steps=3)


@cases.case()
def shard_placement_fn_bad_placement(rank, world_size, impl):
    """A placement that is not a ``Shard`` (``Replicate()``) raises ValueError in both."""
    model = nn.Linear(4, 4)
    try:
        impl.fully_shard(model, shard_placement_fn=lambda param: Replicate())
    except ValueError as exc:
        return 1
    raise AssertionError("no ValueError for Replicate()")


@cases.case(torch_reason="torch's fully_shard raises AssertionError for a dim out of range")
def invalid_shard_dim(rank, world_size, impl):
    """Upstream: test_fully_shard_init.py::TestFullyShardShardPlacementFn::test_invalid_shard_dim:
    ``Shard(1)`` for every parameter of Linear(16, 16), Linear(16, 8) is invalid for the 1-D
    biases (FSDP2: AssertionError); flashfsdp raises ValueError naming the parameter and the dims
    it has. Also ``Shard(-3)`` of a matrix, and a result that is no placement at all."""
    for placement, name, dims in ((Shard(1), "'0.bias'", "-1..0"), (Shard(-3), "'0.weight'", "-2..1")):
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8))
        try:
            impl.fully_shard(model, shard_placement_fn=lambda param, p=placement: p)
        except ValueError as exc:
            assert name in str(exc) and dims in str(exc), str(exc)
        else:
            raise AssertionError(f"no ValueError for {placement}")
    try:
        impl.fully_shard(nn.Linear(2, 2), shard_placement_fn=lambda param: 1)
    except ValueError as exc:
        assert "'weight'" in str(exc) and "Shard(dim)" in str(exc), str(exc)
    else:
        raise AssertionError("no ValueError for a non-placement")
    return 0


# ============================================================================ TestFullyShardShardPlacementFn* (training)
@cases.case()
def train_parity_shard_placement_fn_shard_largest_dim(rank, world_size, impl):
    """Upstream: test_fully_shard_training.py::TestFullyShardShardPlacementFnMultiProcess::test_train_parity_shard_placement_fn_shard_largest_dim
    (W = 2, n_layers 2, 4 AdamW steps; upstream n_layers 3, 5 steps): full parameters equal the
    reference's at init and after training, losses equal every step."""
    model = transformer()
    ref = copy.deepcopy(model)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    shard_transformer(impl, model, shard_placement_fn=largest_dim)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rank_seed(rank)
    inp = torch.randint(0, 8, (2, 16))
    losses = []
    for i in range(4):
        for m, o in ((ref, ref_optim), (model, optim)):
            loss = m(inp).sum()
            loss.backward()
            if m is ref:
                for p in ref.parameters():
                    dist.all_reduce(p.grad)
                    p.grad.div_(world_size)
            o.step()
            o.zero_grad()
        losses.append(loss.detach())
    for (name, p), ref_p in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), ref_p.detach(), **FP32, msg=lambda m, n=name: f"{n}: {m}")
    return {"losses": torch.stack(losses)}


def _single_group_largest_dim(rank, impl, lin_shapes, steps: int = 5):
    """Upstream's ``_test_train_parity_single_group`` with the largest-dim placement: Linear-ReLU-
    Linear as one unit, Adam on it and on the replicated reference; losses per step."""
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(*lin_shapes[0]), nn.ReLU(), nn.Linear(*lin_shapes[1]))
    broadcast_params(model)
    ref = copy.deepcopy(model)
    impl.fully_shard(model, shard_placement_fn=largest_dim)
    check_placed(impl, model, ref, largest_dim)
    rank_seed(rank)
    inp = torch.randn(4, lin_shapes[0][0])
    return train_parity(impl, ref, model, lambda i: inp, steps=steps)


@cases.case()
def train_parity_single_group_shard_largest_dim(rank, world_size, impl):
    """Upstream: test_fully_shard_training.py::TestFullyShard1DTrainingCore::test_train_parity_single_group_shard_largest_dim
    (5 Adam steps, upstream 10): shapes whose largest dims split evenly over W = 2 (FSDP2 refuses
    uneven ones on dim 1; see the next case)."""
    return {str(s): _single_group_largest_dim(rank, impl, s) for s in ([(16, 16), (16, 8)], [(7, 16), (16, 4)])}


@cases.case(world_size=4, torch_reason=UNEVEN)
def train_parity_single_group_shard_largest_dim_uneven(rank, world_size, impl):
    """flashfsdp: the upstream dim-0 case's shapes with the largest-dim placement at W = 4, where
    (15, 16), (8, 15), (3, 15) and (17, 16), (8, 17) split unevenly (a (3, 15) weight on dim 1:
    4, 4, 4, 3 columns)."""
    return {str(s): _single_group_largest_dim(rank, impl, s)
            for s in ([(16, 15), (15, 8)], [(7, 15), (15, 3)], [(16, 17), (17, 8)])}


@cases.case(world_size=4)
def shard_placement_fn_contiguous_params_grads(rank, world_size, impl):
    """Upstream: test_fully_shard_training.py::TestFullyShardShardPlacementFnMultiThread::test_shard_placement_fn_contiguous_params_grads:
    ``Shard(1)`` for matrices (a Linear 4 -> 8 and 8 -> 4, W = 4): sharded parameters, local
    tensors, unsharded parameters in forward and gradients are all contiguous."""
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    broadcast_params(model)

    def placement(param):
        return Shard(1) if param.ndim > 1 else None

    impl.fully_shard(model[0], shard_placement_fn=placement)
    impl.fully_shard(model[1], shard_placement_fn=placement)
    impl.fully_shard(model, shard_placement_fn=placement)
    seen = []

    def assert_contiguous_params(module, args):
        seen.extend(p.is_contiguous() for p in module.parameters())

    for lin in model:
        lin.register_forward_pre_hook(assert_contiguous_params)
    for p in model.parameters():
        assert p.is_contiguous() and impl.local(p).is_contiguous()
    rank_seed(rank)
    model(torch.randn(2, 4)).sum().backward()
    assert seen == [True] * 4, seen
    for p in model.parameters():
        assert p.grad.is_contiguous() and impl.local(p.grad).is_contiguous()
    impl.record_types("grads", [p.grad for p in model.parameters()])
    return {"grads": impl.full_grads(model)}


@cases.case()
def train_parity_frozen_params_shard_dim1(rank, world_size, impl):
    """A unit whose ``Shard(1)`` and ``Shard(0)`` parameters are partly frozen, one before
    ``fully_shard`` (the last Linear's bias) and two after it (the first Linear's weight and bias:
    the rest of their group is then reduced alone, in the trainable parameters' layout): the
    others train as the reference's, frozen ones get no gradient (3 Adam steps)."""
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 8), nn.Linear(8, 2))
    broadcast_params(model)
    model[3].bias.requires_grad_(False)
    ref = copy.deepcopy(model)
    impl.fully_shard(model, shard_placement_fn=lambda param: Shard(1) if param.ndim > 1 else None)
    for m in (model, ref):
        m[0].weight.requires_grad_(False)
        m[0].bias.requires_grad_(False)
    rank_seed(rank)
    return train_parity(impl, ref, model, lambda i: torch.randn(3, 4), steps=3)


@cases.case(world_size=4)
def train_parity_hsdp_shard_dim1(rank, world_size, impl):
    """HSDP (2 replicas x 2 shards) with ``Shard(1)`` matrices: ``(Replicate(), Shard(1))``
    parameters, training equal to the replicated reference (3 Adam steps)."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = transformer()
    ref = copy.deepcopy(model)
    placement = lambda p: Shard(1) if p.ndim > 1 else None  # noqa: E731
    shard_transformer(impl, model, mesh=mesh, shard_placement_fn=placement)
    check_placed(impl, model, ref, lambda p: placement(p) or Shard(0), (Replicate(),))
    rank_seed(rank)
    return train_parity(impl, ref, model, lambda i: torch.randint(0, 8, (2, 16)), steps=3)


@cases.case(rtol=2e-2, atol=2e-2)
def train_parity_mixed_precision_shard_largest_dim(rank, world_size, impl):
    """bf16 parameters and bf16 gradient reduction (pre-divided) with largest-dim placements:
    losses and gradients within bf16 tolerance of torch's, 2 SGD steps."""
    model = transformer()
    mp = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    shard_transformer(impl, model, shard_placement_fn=largest_dim, mp_policy=mp)
    optim = torch.optim.SGD(model.parameters(), lr=1e-2)
    rank_seed(rank)
    inp = torch.randint(0, 8, (2, 16))
    losses = []
    for _ in range(2):
        loss = model(inp).float().sum()
        loss.backward()
        losses.append(loss.detach())
        grads = impl.full_grads(model)
        optim.step()
        optim.zero_grad()
    return {"losses": torch.stack(losses), "grads": grads}


@cases.case(rtol=1e-2, atol=1e-2)
def gradient_accumulation_no_sync_shard_largest_dim(rank, world_size, impl):
    """Largest-dim placements, bf16 parameters with fp32 reduction: two micro-batches without
    gradient sync (accumulated unsharded, in fp32), then one with it; the reduced gradients and
    the loss after an SGD step, compared with torch's (bf16 tolerance)."""
    model = transformer()
    mp = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_transformer(impl, model, shard_placement_fn=largest_dim, mp_policy=mp)
    optim = torch.optim.SGD(model.parameters(), lr=1e-2)
    rank_seed(rank)
    inps = [torch.randint(0, 8, (2, 16)) for _ in range(3)]
    for i, inp in enumerate(inps):
        model.set_requires_gradient_sync(i == len(inps) - 1)
        model(inp).float().sum().backward()
    impl.record_types("grads", [p.grad for p in model.parameters()])
    grads = impl.full_grads(model)
    optim.step()
    return {"grads": grads, "loss": model(inps[0]).float().sum().detach()}


@cases.case(world_size=4, torch_reason="torch's fully_shard fails in its backward all-gather's copy-out "
                                        "(IndexError) with reshard_after_forward=<int> and Shard(1) parameters")
def train_parity_reshard_after_forward_int_shard_dim1(rank, world_size, impl):
    """``reshard_after_forward=2`` (the backward all-gathers over 2 of 4 ranks, from the slice of
    the gathered layout each rank kept after forward) with ``Shard(1)`` matrices: training equal
    to the replicated reference (2 steps)."""
    model = transformer()
    ref = copy.deepcopy(model)
    placement = lambda p: Shard(1) if p.ndim > 1 else None  # noqa: E731
    for block in model.layers:
        impl.fully_shard(block, shard_placement_fn=placement, reshard_after_forward=2)
    impl.fully_shard(model, shard_placement_fn=placement, reshard_after_forward=False)
    rank_seed(rank)
    return train_parity(impl, ref, model, lambda i: torch.randint(0, 8, (2, 16)), steps=2)


@cases.case()
def state_dict_dcp_clip_shard_largest_dim(rank, world_size, impl):
    """Largest-dim placements: ``state_dict()`` values are DTensors of the parameters' placements
    (types compared with torch's), DCP save and load into a model sharded on dim 0 restores the
    values, and the stock ``clip_grad_norm_`` gives the reference's norm and clipped gradients."""
    model = transformer()
    ref = copy.deepcopy(model)
    shard_transformer(impl, model, shard_placement_fn=largest_dim)
    sd = model.state_dict()
    impl.record_types("state_dict", sd)
    other = transformer(seed=7)
    shard_transformer(impl, other)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = [tmp]
        dist.broadcast_object_list(tmp, src=0)
        dcp.save(sd, checkpoint_id=os.path.join(tmp[0], "ckpt"))
        dist.barrier()
        target = other.state_dict()
        dcp.load(target, checkpoint_id=os.path.join(tmp[0], "ckpt"))
        other.load_state_dict(target)
        dist.barrier()
    for (name, p), q in zip(other.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q.detach(), rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    rank_seed(rank)
    inp = torch.randint(0, 8, (2, 16))
    model(inp).sum().backward()
    ref(inp).sum().backward()
    for p in ref.parameters():
        dist.all_reduce(p.grad)
        p.grad.div_(world_size)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    norm = impl.clip_grad_norm_(model, 0.5)
    torch.testing.assert_close(norm, ref_norm, **FP32)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p.grad.full_tensor(), q.grad, **FP32, msg=lambda m, n=name: f"{n}: {m}")
    return {"norm": norm, "grads": impl.full_grads(model)}


@cases.case(world_size=4, torch_reason="flashfsdp's own full state dicts (get_full_state_dict / set_full_state_dict)")
def full_state_dict_uneven_shard_dim1(rank, world_size, impl):
    """flashfsdp's full state dicts with ``Shard(1)`` on uneven dims (W = 4): the full state dict
    on rank 0 is the reference's; loading another model's full state dict from rank 0 gives every
    rank the chunks ``distribute_tensor`` cuts of it."""
    from flashfsdp import get_full_state_dict, set_full_state_dict  # noqa: PLC0415

    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(7, 3), nn.Linear(3, 6, bias=False), nn.Linear(6, 2))
    broadcast_params(model)
    ref = copy.deepcopy(model)
    other = copy.deepcopy(model)
    for p in other.parameters():
        p.detach().mul_(-2.0).add_(1.0)
    impl.fully_shard(model, shard_placement_fn=lambda param: Shard(param.ndim - 1))
    full = get_full_state_dict(model)
    if rank == 0:
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(full[k], v, rtol=0, atol=0, msg=lambda m, k=k: f"{k}: {m}")
    set_full_state_dict(model, other.state_dict() if rank == 0 else None)
    check_placed(impl, model, other, lambda param: Shard(param.ndim - 1))
    return impl.full_params(model)


@cases.case()
def train_parity_cpu_offload_shard_largest_dim(rank, world_size, impl):
    """``CPUOffloadPolicy(pin_memory=False)`` (pinning needs an accelerator) with largest-dim
    placements: training equal to the reference (2 steps)."""
    model = transformer()
    ref = copy.deepcopy(model)
    shard_transformer(impl, model, shard_placement_fn=largest_dim, offload_policy=impl.CPUOffloadPolicy(pin_memory=False))
    check_placed(impl, model, ref, largest_dim)
    rank_seed(rank)
    return train_parity(impl, ref, model, lambda i: torch.randint(0, 8, (2, 16)), steps=2)


@cases.case()
def meta_init_shard_largest_dim(rank, world_size, impl):
    """A model built on the meta device, sharded with largest-dim placements, materialised with
    ``to_empty`` and given the reference's values chunk by chunk (each local tensor written with
    ``distribute_tensor``'s chunk of the full value): the DTensors gather back to the reference's
    values, and a training step matches it."""
    ref = transformer()
    with torch.device("meta"):
        model = Transformer(ModelArgs(n_layers=2, dropout_p=0.0))
    shard_transformer(impl, model, shard_placement_fn=largest_dim)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            impl.local(p).copy_(impl.shard_of(q.detach(), p))
    check_placed(impl, model, ref, largest_dim)
    rank_seed(rank)
    return train_parity(impl, ref, model, lambda i: torch.randint(0, 8, (2, 16)), steps=1)


@cases.case()
def to_float64_after_init_shard_last_dim(rank, world_size, impl):
    """``model.to(torch.float64)`` after ``fully_shard`` with last-dim placements: the parameters
    stay DTensors of their placements in float64 and train as the float64 reference (2 steps)."""
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    broadcast_params(model)
    ref = copy.deepcopy(model).to(torch.float64)
    impl.fully_shard(model, shard_placement_fn=lambda param: Shard(-1))
    model.to(torch.float64)
    check_placed(impl, model, ref, lambda param: Shard(-1))
    assert all(p.dtype == torch.float64 and impl.local(p).dtype == torch.float64 for p in model.parameters())
    rank_seed(rank)
    return train_parity(impl, ref, model, lambda i: torch.randn(3, 4, dtype=torch.float64), steps=2)


@cases.case(torch_reason="flashfsdp's load_state_dict takes full-shape tensors and DTensors of other placements")
def load_state_dict_other_layouts_shard_dim1(rank, world_size, impl):
    """flashfsdp: a model with ``Shard(1)`` matrices loads a plain (full-shape) state dict, the
    state dict of a model sharded on dim 0 (DTensors redistributed to ``Shard(1)``), and a plain
    one with ``assign=True``, and a full-shape parameter assigned in place of a sharded one (taken
back at the next forward); each time its
    chunks are DTensor's chunks of the source's values."""
    torch.manual_seed(42)
    src = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 4))
    broadcast_params(src)
    placement = lambda param: Shard(1) if param.ndim > 1 else None  # noqa: E731
    model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 4))
    impl.fully_shard(model, shard_placement_fn=placement)
    model.load_state_dict(src.state_dict())
    check_placed(impl, model, src, lambda p: placement(p) or Shard(0))
    dim0 = copy.deepcopy(src)
    with torch.no_grad():
        for p in dim0.parameters():
            p.mul_(3.0)
    expected = copy.deepcopy(dim0)
    impl.fully_shard(dim0)
    model.load_state_dict(dim0.state_dict())
    check_placed(impl, model, expected, lambda p: placement(p) or Shard(0))
    model.load_state_dict(src.state_dict(), assign=True)
    model[1].weight = nn.Parameter(src[1].weight.detach().clone())  # a full tensor, taken back
    model(torch.randn(2, 5)).sum().backward()
    check_placed(impl, model, src, lambda p: placement(p) or Shard(0))
    return impl.full_params(model)


@cases.case(torch_reason="flashfsdp's init window: a sharded parameter acts as its full-shape tensor")
def meta_init_window_shard_last_dim(rank, world_size, impl):
    """flashfsdp: a meta-device model sharded on every parameter's last dim, ``set_unsharded_init()``, ``to_empty``, then
    initialised through full-shape ops on the sharded parameters (the init window): the chunks
    written back are DTensor's chunks of the reference's values."""
    torch.manual_seed(42)
    ref = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 4))
    broadcast_params(ref)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 4))
    impl.fully_shard(model, shard_placement_fn=lambda param: Shard(-1))
    model.set_unsharded_init()
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p, q in zip(model.parameters(), ref.parameters()):
            p.copy_(q * 2.0)
            p.mul_(0.5)
    check_placed(impl, model, ref, lambda param: Shard(-1))
    return impl.full_params(model)


@cases.case(world_size=4, torch_reason="flashfsdp.optim steps a unit's flat shard")
def flashfsdp_optim_uneven_shard_dim1(rank, world_size, impl):
    """flashfsdp: ``flashfsdp.optim.AdamW`` and ``SGD`` (momentum) over uneven ``Shard(1)``
    parameters (W = 4), after ``flashfsdp.clip_grad_norm_`` (the norm over the units' shards),
    train as torch's optimizers on the replicated reference after the stock ``clip_grad_norm_``
    (3 steps); their states are DTensors of the parameters' placements and local shapes."""
    import flashfsdp  # noqa: PLC0415
    import flashfsdp.optim as fo  # noqa: PLC0415

    out = {}
    for make, make_ref in ((lambda ps: fo.AdamW(ps, lr=1e-2), lambda ps: torch.optim.AdamW(ps, lr=1e-2)),
                           (lambda ps: fo.SGD(ps, lr=1e-1, momentum=0.9), lambda ps: torch.optim.SGD(ps, lr=1e-1,
                                                                                                    momentum=0.9))):
        torch.manual_seed(42)
        model = nn.Sequential(nn.Linear(6, 5), nn.Linear(5, 3))
        broadcast_params(model)
        ref = copy.deepcopy(model)
        impl.fully_shard(model, shard_placement_fn=lambda param: Shard(param.ndim - 1))
        optim, ref_optim = make(model.parameters()), make_ref(ref.parameters())
        rank_seed(rank)
        for _ in range(3):
            inp = torch.randn(2, 6)
            ref(inp).sum().backward()
            for q in ref.parameters():
                dist.all_reduce(q.grad)
                q.grad.div_(world_size)
            model(inp).sum().backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
            torch.testing.assert_close(flashfsdp.clip_grad_norm_(model, 0.5), ref_norm, **FP32)
            optim.step()
            ref_optim.step()
            optim.zero_grad()
            ref_optim.zero_grad()
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p.full_tensor(), q.detach(), **FP32, msg=lambda m, n=name: f"{n}: {m}")
            assert p.placements == (Shard(p.ndim - 1),), p.placements
            states = {k: v for k, v in optim.state[p].items() if isinstance(v, DTensor)}
            assert states, f"{name}: no DTensor optimizer state"
            for key, value in states.items():
                assert value.placements == p.placements and value.to_local().shape == impl.local(p).shape, key
        out[type(optim).__name__] = impl.full_params(model)
    return out


test_case = cases.pytest_tests()
