"""Port of upstream ``test/distributed/_composable/fsdp/test_fully_shard_mixed_precision.py``.

Mixed-precision training parity: the reference emulates FSDP2's casts by hand, as upstream does
(a low-precision compute copy of the replicated model whose gradients are reduced the way FSDP2
reduces them — in ``reduce_dtype``, divided by W before/after the sum — then cast to the fp32
master copy that the optimizer steps, whose values are copied back into the compute copy).
Which dtype each reduce-scatter runs in is recorded with :func:`record_reduce_scatters` (upstream's
``patch_reduce_scatter`` + ``reduce_scatter_with_assert``). Then the casts of forward inputs and
outputs (``cast_forward_inputs``, ``output_dtype``), with checkpoint recomputation, norm layers,
structured activations, and ``module.to(float32)`` after ``fully_shard``.

Upstream runs the training tests at W = min(4, #GPUs) on NCCL; here W = 2 on gloo: a sum of two
bf16/fp16 values rounds the same whatever the collective's algorithm, and dividing by 2 is exact,
so the reference's low-precision reduction is bit-identical to both implementations' reduce-scatter
and parity is checked at upstream's fp32 tolerances. The fp32-reduce variant with
``reshard_after_forward=2`` runs at W = 4. ``record_reduce_scatters`` is also used by
``test_frozen.py``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing._internal.common_distributed import SaveForwardInputsModel
from torch.testing._internal.common_fsdp import MLP
from torch.utils.checkpoint import checkpoint

from tests.fsdp2_suite.common import rank_seed
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)

UPSTREAM = "test/distributed/_composable/fsdp/test_fully_shard_mixed_precision.py"
NUM_ITERS = 10

# Upstream's assertEqual on bf16/fp16 tensors uses these tolerances (torch.testing's defaults).
BF16 = dict(rtol=1.6e-2, atol=1e-5)


# ============================================================================ helpers (shared)
@dataclasses.dataclass(frozen=True)
class ReduceScatterCall:
    """One reduce-scatter the implementation issued: its output's dtype and element count."""

    dtype: torch.dtype
    numel: int


@contextlib.contextmanager
def record_reduce_scatters(impl, events: list | None = None):
    """Record a :class:`ReduceScatterCall` for every gradient reduce-scatter issued inside.

    Upstream's ``patch_reduce_scatter(reduce_scatter_with_assert)`` patches
    ``dist.reduce_scatter_single`` (what torch's FSDP2 calls); flashfsdp's collectives go through
    ``ProcessGroupCommunicator.reduce_scatter_tensor(out, inp)``. ``events``: append to this list
    (e.g. shared with gradient-arrival markers to check the order); by default a new list is
    yielded. Also used by ``test_frozen.py``.
    """
    log = [] if events is None else events
    if impl.name == "torch":
        owner = dist
        name = "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"

        def output_of(args, kwargs):
            return args[0] if args else kwargs["output"]
    else:
        from flashfsdp.runtime.process_group import ProcessGroupCommunicator  # noqa: PLC0415

        owner, name = ProcessGroupCommunicator, "reduce_scatter_tensor"

        def output_of(args, kwargs):
            return args[1] if len(args) > 1 else kwargs["out"]

    orig = getattr(owner, name)

    def wrapped(*args, **kwargs):
        out = output_of(args, kwargs)
        log.append(ReduceScatterCall(out.dtype, out.numel()))
        return orig(*args, **kwargs)

    setattr(owner, name, wrapped)
    try:
        yield log
    finally:
        setattr(owner, name, orig)


def assert_reduce_dtypes(calls, dtype: torch.dtype, where: str) -> None:
    """Upstream's ``assert_fn``: every reduce-scatter output is in ``dtype`` (and there was one)."""
    rs = [c for c in calls if isinstance(c, ReduceScatterCall)]
    assert rs, f"{where}: no reduce-scatter was issued"
    bad = [c.dtype for c in rs if c.dtype != dtype]
    assert not bad, f"{where}: reduce-scatter outputs in {bad}, expected {dtype}"


def divide_factors(world_size: int, reduce_dtype: torch.dtype) -> tuple[float, float]:
    """(pre, post) divide factors of FSDP2's reduction (``_get_gradient_divide_factors``): fp32 and
    bf16 reduce with AVG (the reference divides by W before summing, as upstream's reference does);
    fp16 divides by ~sqrt(W) before and the rest after, against overflow."""
    if reduce_dtype in (torch.float32, torch.bfloat16):
        return float(world_size), 1.0
    pre = 1
    while world_size % pre == 0 and world_size / pre > pre:
        pre *= 2
    return float(pre), world_size / pre


def reduce_like_fsdp(params, world_size: int, reduce_dtype: torch.dtype) -> list[torch.Tensor]:
    """Each ``param.grad`` reduced over the ranks as FSDP2 reduces it: cast to ``reduce_dtype``,
    divided by the pre-factor, summed, divided by the post-factor (returned in ``reduce_dtype``;
    ``.grad`` itself is left alone: a bf16 parameter may not hold an fp32 gradient).

    Upstream sums with reduce-scatter + all-gather because NCCL's all-reduce rounds differently;
    at W = 2 the sum of two values is the same whatever the algorithm."""
    pre, post = divide_factors(world_size, reduce_dtype)
    out = []
    for p in params:
        g = p.grad.to(reduce_dtype)
        if pre != 1:
            g.div_(pre)
        dist.all_reduce(g)
        if post != 1:
            g.div_(post)
        out.append(g)
    return out


def init_models_and_optims(impl, reshard_after_forward, param_dtype, reduce_dtype):
    """Upstream's ``_init_models_and_optims``: 3 MLP(16) units + root, Adam(lr=1e-2) on both."""
    torch.manual_seed(42)
    model = nn.Sequential(*[MLP(16, torch.device("cpu")) for _ in range(3)])
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    mp_policy = impl.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    fully_shard_fn = functools.partial(impl.fully_shard, reshard_after_forward=reshard_after_forward,
                                       mp_policy=mp_policy)
    for mlp in model:
        fully_shard_fn(mlp)
    fully_shard_fn(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    return ref_model, ref_optim, model, optim


def step_master_from_compute(ref_model, ref_model_lp, ref_optim, grads) -> None:
    """The emulated mixed-precision optimizer step: the compute copy's reduced gradients ``grads``
    become the fp32 master's, the fp32 optimizer steps, and the compute copy takes the new values."""
    for p32, plp, g in zip(ref_model.parameters(), ref_model_lp.parameters(), grads):
        p32.grad = g.to(p32.dtype)
        plp.grad = None
    ref_optim.step()
    with torch.no_grad():
        for p32, plp in zip(ref_model.parameters(), ref_model_lp.parameters()):
            plp.copy_(p32)


# ============================================================================ TestFullyShardMixedPrecisionTraining
def _low_precision_training(rank, world_size, impl, param_dtype, reduce_dtype, reshard_after_forward):
    """Upstream's ``_test_compute_dtype`` (``reduce_dtype`` None: the gradients are reduced in
    ``param_dtype``), ``_test_reduce_dtype_fp32_reduce`` and ``_test_reduce_dtype_bf16_reduce``
    (fp32 compute: the reference's compute copy is an fp32 copy of the master): each reduce-scatter
    runs in the reduce dtype, and losses, sharded parameters and gradients match the reference
    whose gradients are reduced the same way, upcast and stepped on the fp32 master."""
    ref_model, ref_optim, model, optim = init_models_and_optims(impl, reshard_after_forward, param_dtype,
                                                                reduce_dtype)
    reduced_in = reduce_dtype or param_dtype
    ref_model_lp = copy.deepcopy(ref_model).to(param_dtype)
    rank_seed(rank)
    inp = torch.randn((4, 16), dtype=param_dtype)
    losses = []
    for iter_idx in range(NUM_ITERS):
        optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
        fsdp_loss = model(inp).sum()
        with record_reduce_scatters(impl) as calls:
            fsdp_loss.backward()
        assert_reduce_dtypes(calls, reduced_in, f"iteration {iter_idx}")
        optim.step()

        ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
        ref_loss = ref_model_lp(inp.to(param_dtype)).sum()
        ref_loss.backward()
        grads = reduce_like_fsdp(ref_model_lp.parameters(), world_size, reduced_in)
        step_master_from_compute(ref_model, ref_model_lp, ref_optim, grads)

        torch.testing.assert_close(fsdp_loss, ref_loss)
        impl.check_sharded_parity(ref_model, model)
        losses.append(fsdp_loss.detach().float())
    return {"losses": torch.stack(losses), "params": impl.full_params(model)}


@cases.case(world_size=2)
def compute_dtype_bf16(rank, world_size, impl):
    """Upstream: test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining::test_compute_dtype
    (param_dtype=bf16, reshard_after_forward in {False, True}): bf16 forward/backward with the
    gradients reduced in bf16 (reduce_dtype unset) and an fp32 optimizer step match the emulated
    reference: losses per step, sharded parameters and gradients."""
    return {str(raf): _low_precision_training(rank, world_size, impl, torch.bfloat16, None, raf)
            for raf in (False, True)}


@cases.case(world_size=2)
def compute_dtype_fp16(rank, world_size, impl):
    """Upstream: test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining::test_compute_dtype
    (param_dtype=fp16, reshard_after_forward=True): fp16 compute and reduction (pre-divide by 2,
    no post-divide at W = 2) match the emulated reference."""
    return _low_precision_training(rank, world_size, impl, torch.float16, None, True)


@cases.case(world_size=2)
def compute_dtype_per_unit(rank, world_size, impl):
    """Extension of test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining::test_compute_dtype
    (a different policy per unit, reshard_after_forward in {True, False}): MLP 0 computes in bf16
    and reduces in fp32, MLP 1 computes and reduces in fp16 (its pre-forward casts MLP 0's bf16
    output), MLP 2 computes and reduces in bf16 with ``output_dtype=fp32``, the root has no policy.
    The reference emulates each unit's casts and reduction by hand: losses, sharded parameters and
    gradients match, and each unit's reduce-scatter runs in its own reduce dtype."""
    policies = [  # (param_dtype, reduce_dtype, output_dtype) per MLP
        (torch.bfloat16, torch.float32, None),
        (torch.float16, None, None),
        (torch.bfloat16, torch.bfloat16, torch.float32),
    ]
    out = {}
    for reshard_after_forward in (True, False):
        torch.manual_seed(42)
        model = nn.Sequential(*[MLP(16, torch.device("cpu")) for _ in range(3)])
        ref_model = copy.deepcopy(model)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        ref_compute = [copy.deepcopy(mlp).to(pd) for mlp, (pd, _, _) in zip(ref_model, policies)]
        for mlp, (pd, rd, od) in zip(model, policies):
            impl.fully_shard(mlp, reshard_after_forward=reshard_after_forward,
                             mp_policy=impl.MixedPrecisionPolicy(param_dtype=pd, reduce_dtype=rd, output_dtype=od))
        impl.fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        rank_seed(rank)
        inp = torch.randn((4, 16))
        losses = []
        for iter_idx in range(NUM_ITERS):
            optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            fsdp_loss = model(inp).sum()
            assert fsdp_loss.dtype == torch.float32, fsdp_loss.dtype
            with record_reduce_scatters(impl) as calls:
                fsdp_loss.backward()
            want = sorted(str(rd or pd) for pd, rd, _ in policies)
            assert sorted(str(c.dtype) for c in calls) == want, (calls, want)
            optim.step()

            ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            x = inp
            for mlp, (pd, _, od) in zip(ref_compute, policies):
                x = mlp(x.to(pd))  # each unit casts its inputs to its param_dtype
                if od is not None:
                    x = x.to(od)
            ref_loss = x.sum()
            ref_loss.backward()
            grads = []
            for mlp, (pd, rd, _) in zip(ref_compute, policies):
                grads += reduce_like_fsdp(mlp.parameters(), world_size, rd or pd)
            for p32, g in zip(ref_model.parameters(), grads):
                p32.grad = g.to(p32.dtype)
            for mlp in ref_compute:
                mlp.zero_grad(set_to_none=True)
            ref_optim.step()
            with torch.no_grad():
                for mlp32, mlp in zip(ref_model, ref_compute):
                    for p32, p in zip(mlp32.parameters(), mlp.parameters()):
                        p.copy_(p32)

            torch.testing.assert_close(fsdp_loss, ref_loss)
            impl.check_sharded_parity(ref_model, model)
            losses.append(fsdp_loss.detach())
        out[str(reshard_after_forward)] = {"losses": torch.stack(losses), "params": impl.full_params(model)}
    return out


@cases.case(world_size=2)
def reduce_dtype_fp32_reduce(rank, world_size, impl):
    """Upstream: test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining::test_reduce_dtype
    (_test_reduce_dtype_fp32_reduce, reshard_after_forward in {False, True}): bf16 compute with the
    gradients upcast and reduced in fp32 (reduce-scatters in fp32) match the reference."""
    return {str(raf): _low_precision_training(rank, world_size, impl, torch.bfloat16, torch.float32, raf)
            for raf in (False, True)}


@cases.case(world_size=4)
def reduce_dtype_fp32_reduce_post_forward_int(rank, world_size, impl):
    """Upstream: test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining::test_reduce_dtype
    (_test_reduce_dtype_fp32_reduce, reshard_after_forward=2 at W = 4): the same with the
    parameters resharded to groups of 2 ranks after forward (bf16 all-gather in backward)."""
    return _low_precision_training(rank, world_size, impl, torch.bfloat16, torch.float32, 2)


@cases.case(world_size=2)
def reduce_dtype_bf16_reduce(rank, world_size, impl):
    """Upstream: test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining::test_reduce_dtype
    (_test_reduce_dtype_bf16_reduce, reshard_after_forward in {False, True}): fp32 compute with the
    gradients reduced in bf16 (reduce-scatters in bf16) and upcast to fp32 match the reference."""
    return {str(raf): _low_precision_training(rank, world_size, impl, torch.float32, torch.bfloat16, raf)
            for raf in (False, True)}


@cases.case(world_size=2, torch_reason=(
    "torch 2.13's fully_shard has the bug this upstream test was added for: after a first forward "
    "with every parameter frozen, the backward assigns a bf16 gradient to the fp32 sharded parameter "
    "(foreach_reduce: 'attempting to assign a gradient with dtype BFloat16 to a tensor with grad_dtype "
    "Float'); fixed upstream after 2.13"))
def reduce_dtype_after_frozen_first_forward(rank, world_size, impl):
    """Upstream: test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining::test_reduce_dtype_after_frozen_first_forward:
    a root unit with an int64 frozen parameter, frozen entirely (``requires_grad_(False)`` after
    fully_shard) for a first no-grad forward, then partly unfrozen: the backward still reduces in
    the policy's fp32 reduce_dtype and the gradients are fp32. (Upstream also reads the param
    group's private ``_orig_dtype``/``_reduce_dtype``; their observable effect is checked here.)"""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
            self.non_float = nn.Parameter(torch.ones(16, dtype=torch.int64), requires_grad=False)

        def forward(self, inp):
            return self.layers(inp)

    mp_policy = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    torch.manual_seed(42)
    model = Model()
    impl.fully_shard(model, mp_policy=mp_policy)
    model.requires_grad_(False)
    rank_seed(rank)
    inp = torch.randn((4, 16))
    with torch.no_grad():
        model(inp)
    model.layers.requires_grad_(True)
    with record_reduce_scatters(impl) as calls:
        model(inp).sum().backward()
    assert_reduce_dtypes(calls, torch.float32, "backward after unfreezing")
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            assert param.grad.dtype == torch.float32, f"{name}.grad is {param.grad.dtype}"
            grads[name] = impl.full(param.grad, param)
    assert model.non_float.grad is None
    assert set(grads) == {f"layers.{i}.{n}" for i in (0, 1) for n in ("weight", "bias")}, sorted(grads)
    return grads


def _grad_acc_with_reduce_dtype(rank, world_size, impl, reshard_after_forward):
    torch.manual_seed(42)
    param_dtype, reduce_dtype = torch.bfloat16, torch.float32
    mp_policy = impl.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model = nn.Sequential(*[MLP(16, torch.device("cpu")) for _ in range(3)])
    # The reference keeps an fp32 master copy (optimizer) and a bf16 compute copy (forward/backward).
    ref_model = copy.deepcopy(model)
    ref_model_compute = copy.deepcopy(ref_model).to(param_dtype)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for mlp in model:
        impl.fully_shard(mlp, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    impl.fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=mp_policy)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    rank_seed(rank)
    num_microbatches = 4
    # Train on the same input to avoid loss explosion
    inp = torch.randn((2 * num_microbatches, 16), dtype=param_dtype)
    losses = []
    for iter_idx in range(NUM_ITERS):
        microbatch_inps = torch.chunk(inp, num_microbatches)
        for microbatch_idx in range(num_microbatches):
            is_last_microbatch = microbatch_idx == num_microbatches - 1
            model.set_requires_gradient_sync(is_last_microbatch)
            model.set_reshard_after_backward(is_last_microbatch or reshard_after_forward)
            step_losses = []
            for _model in (ref_model_compute, model):
                step_losses.append(_model(microbatch_inps[microbatch_idx].detach()).sum())
                assert step_losses[-1].dtype == param_dtype, step_losses[-1].dtype
                with record_reduce_scatters(impl) as calls:
                    step_losses[-1].backward()
                if _model is model and calls:
                    assert_reduce_dtypes(calls, reduce_dtype, f"iteration {iter_idx}.{microbatch_idx}")
                    assert is_last_microbatch, "reduce-scatter issued with gradient sync disabled"
            torch.testing.assert_close(step_losses[1], step_losses[0])
            losses.append(step_losses[1].detach().float())
            # Accumulate the compute copy's bf16 gradients into the fp32 master's, in fp32
            for ref_param, ref_param_compute in zip(ref_model.parameters(), ref_model_compute.parameters()):
                assert ref_param_compute.grad is not None
                if ref_param.grad is not None:
                    ref_param.grad += ref_param_compute.grad
                else:
                    ref_param.grad = ref_param_compute.grad.to(ref_param.dtype)
                ref_param_compute.grad = None
            if is_last_microbatch:  # data parallelism on the last microbatch
                for ref_param in ref_model.parameters():
                    dist.all_reduce(ref_param.grad)
                    ref_param.grad /= world_size
        impl.check_sharded_parity(ref_model, model)
        ref_optim.step()
        optim.step()
        ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
        optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
        with torch.no_grad():
            for ref_param, ref_param_compute in zip(ref_model.parameters(), ref_model_compute.parameters()):
                ref_param_compute.copy_(ref_param)
    return {"losses": torch.stack(losses), "params": impl.full_params(model)}


@cases.case(world_size=2)
def grad_acc_with_reduce_dtype(rank, world_size, impl):
    """Upstream: test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionTraining::test_grad_acc_with_reduce_dtype
    (reshard_after_forward in {True, False}): 4 micro-batches with ``set_requires_gradient_sync``
    off for the first 3 (param bf16, reduce fp32): the unsharded gradients accumulate in fp32
    (parity with a reference that accumulates the bf16 micro-batch gradients in fp32), one fp32
    reduce-scatter per unit on the last micro-batch only."""
    return {str(raf): _grad_acc_with_reduce_dtype(rank, world_size, impl, raf) for raf in (True, False)}


# ------------------------------------------------------------------ structured activations
@dataclasses.dataclass
class DC:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Inner:
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Outer:
    inner: Inner
    z: torch.Tensor


class TensorPair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


class ContainerModule(nn.Module):
    """Applies one linear layer to each tensor of the container."""

    def __init__(self, ctype: str, dim: int):
        super().__init__()
        self.ctype = ctype
        self._layer = nn.Linear(dim, dim)

    def forward(self, inp: Any) -> Any:
        if self.ctype == "dataclass":
            return DC(x=self._layer(inp.x), y=self._layer(inp.y))
        if self.ctype == "nested_dataclass":
            return Outer(inner=Inner(x=self._layer(inp.inner.x), y=self._layer(inp.inner.y)), z=self._layer(inp.z))
        return TensorPair(x=self._layer(inp.x), y=self._layer(inp.y))


class ToContainer(nn.Module):
    def __init__(self, ctype: str):
        super().__init__()
        self.ctype = ctype

    def forward(self, x: torch.Tensor) -> Any:
        # clone() so that each field has an autograd path of its own
        if self.ctype == "dataclass":
            return DC(x=x, y=x.clone())
        if self.ctype == "nested_dataclass":
            return Outer(inner=Inner(x=x, y=x.clone()), z=x.clone())
        return TensorPair(x=x, y=x.clone())


class FromContainer(nn.Module):
    def __init__(self, ctype: str):
        super().__init__()
        self.ctype = ctype

    def forward(self, inp: Any) -> torch.Tensor:
        if self.ctype == "nested_dataclass":
            return inp.inner.x + inp.inner.y + inp.z
        return inp.x + inp.y


def _structured_input_output(rank, world_size, impl, container_type, mp_config):
    param_dtype, reduce_dtype = mp_config
    torch.manual_seed(42)
    dim, local_batch_size = 16, 2
    global_batch_size = world_size * local_batch_size
    model = nn.Sequential(ToContainer(container_type), ContainerModule(container_type, dim),
                          ContainerModule(container_type, dim), FromContainer(container_type))
    ref_model = copy.deepcopy(model)
    mp_policy = impl.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    for module in model:
        impl.fully_shard(module, mp_policy=mp_policy)
    impl.fully_shard(model, mp_policy=mp_policy)
    ref_model_compute = copy.deepcopy(ref_model).to(param_dtype) if param_dtype is not None else None
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1)  # same on all ranks
    losses = []
    for iter_idx in range(NUM_ITERS):
        global_inp = torch.rand((global_batch_size, dim))
        local_inp = global_inp[rank * local_batch_size : (rank + 1) * local_batch_size].detach()
        optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
        fsdp_loss = model(local_inp).sum()
        fsdp_loss.backward()
        optim.step()

        ref_optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
        if param_dtype is not None:
            ref_loss = ref_model_compute(global_inp.to(param_dtype)).sum()
            ref_loss.backward()
            # The reference saw the global batch: its gradients are the sum over the ranks
            if reduce_dtype is not None and reduce_dtype != param_dtype:
                # cast to reduce_dtype, all-reduce, divide (as the sharded model does)
                grads = [p.grad.to(reduce_dtype) for p in ref_model_compute.parameters()]
                for g in grads:
                    dist.all_reduce(g)
                    g.div_(world_size)
            else:
                grads = [p.grad / world_size for p in ref_model_compute.parameters()]
            step_master_from_compute(ref_model, ref_model_compute, ref_optim, grads)
        else:
            ref_loss = ref_model(global_inp).sum()
            ref_loss.backward()
            for p in ref_model.parameters():
                p.grad.div_(world_size)
            ref_optim.step()
        dist.all_reduce(fsdp_loss)  # partial -> replicated
        torch.testing.assert_close(fsdp_loss, ref_loss)
        # bf16 gradients of the global batch vs the sum of local ones drift beyond fp32
        # tolerances: upstream checks parameter parity for fp32 only
        if param_dtype is None:
            impl.check_sharded_parity(ref_model, model)
        losses.append(fsdp_loss.detach().float())
    return {"losses": torch.stack(losses), "params": impl.full_params(model)}


def _structured_case(container_type: str, low_precision: bool):
    configs = [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)] if low_precision else [(None, None)]
    what = ("bf16 compute with bf16 or fp32 reduction (loss parity)" if low_precision
            else "fp32 (loss and parameter parity)")

    def case(rank, world_size, impl):
        return [_structured_input_output(rank, world_size, impl, container_type, c) for c in configs]

    case.__name__ = f"structured_input_output_{container_type}" + ("_bf16" if low_precision else "")
    case.__doc__ = (
        f"Upstream: {UPSTREAM.rsplit('/', 1)[1]}::TestFullyShardMixedPrecisionTraining::test_structured_input_output "
        f"(container_type={container_type!r}, {what}): activations between units are carried in a "
        f"{container_type.replace('_', ' ')} and training matches the replicated reference on the global batch.")
    return case


for _ctype in ("dataclass", "nested_dataclass", "namedtuple"):
    cases.case(world_size=2)(_structured_case(_ctype, False))
    # bf16 runs: the flashfsdp-vs-torch comparison at bf16 tolerance (the losses are bf16 sums)
    cases.case(world_size=2, **BF16)(_structured_case(_ctype, True))


# ============================================================================ TestFullyShardMixedPrecisionJVP
@cases.case(world_size=2)
def no_warmup_jvp_reshard_after_forward_false(rank, world_size, impl):
    """Upstream: test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionJVP::test_no_warmup_jvp_reshard_after_forward_false:
    meta-device units (bf16 compute, fp32 reduce, reshard_after_forward=False) materialised with
    ``to_empty`` and initialised in place; the first forward of the second unit runs inside
    ``torch.func.jvp`` (no warm-up forward): output shape (320,), dtype bf16, tangent zero (the
    output does not depend on the primal)."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    dtype = torch.bfloat16
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("fsdp",))
    mp_policy = impl.MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=True)
    with torch.device("meta"):
        enc = nn.Linear(128, 256, bias=False)
        dec = nn.Linear(256, 320, bias=False)
    for module in (enc, dec):
        impl.fully_shard(module, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False)
    gen = torch.Generator("cpu")
    for idx, module in enumerate((enc, dec)):
        module.to_empty(device="cpu")
        with torch.no_grad():
            module.weight.normal_(std=module.in_features**-0.5, generator=gen.manual_seed(42 + idx))
    x = torch.randn((128,), dtype=dtype, generator=gen.manual_seed(0))
    primal = torch.randn((320,), dtype=dtype, generator=gen.manual_seed(1), requires_grad=True)
    tangent = torch.randn((320,), dtype=dtype, generator=gen.manual_seed(2))
    e = enc(x)

    def fn(unused):
        return dec(e)

    output, tangent_output = torch.func.jvp(fn, (primal,), (tangent,))
    assert output.shape == (320,), output.shape
    assert output.dtype == dtype, output.dtype
    torch.testing.assert_close(tangent_output, torch.zeros_like(output))
    # The weights are drawn differently (torch: DTensor's random op per local chunk; flashfsdp: its
    # init window, as the unsharded module would draw them): compare only the tangent.
    return {"tangent": tangent_output.float()}


# ============================================================================ TestFullyShardMixedPrecisionCasts
@cases.case(world_size=2)
def float16_on_one_submodule(rank, world_size, impl):
    """Upstream: test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionCasts::test_float16_on_one_submodule:
    fp16 on one child unit only: (1) the child casts its own inputs to fp16; (2) with
    ``cast_forward_inputs=False`` the child sees fp32 inputs (the user module casts); (3) fp16 on
    the first child with ``output_dtype=fp32``: the second child gets fp32 without casting."""
    x = torch.zeros(2, 100)
    mp = impl.MixedPrecisionPolicy
    f16, f32 = torch.float16, torch.float32
    subtests = {  # (child with the policy, the user module casts, policy, expected dtypes of root, c1, c2)
        # 1: fp16 on the second child; its pre-forward casts
        "sub1": ("c2", False, mp(param_dtype=f16), (f32, f32, f16)),
        # 2: fp16 on the second child, the user module owns the cast
        "sub2": ("c2", True, mp(param_dtype=f16, cast_forward_inputs=False), (f32, f32, f32)),
        # 3: fp16 on the first child with output_dtype fp32: the second child needs no cast
        "sub3": ("c1", False, mp(param_dtype=f16, output_dtype=f32), (f32, f16, f32)),
    }
    out = {}
    for name, (child, user_casts, policy, dtypes) in subtests.items():
        forward_inputs = {}
        model = SaveForwardInputsModel(forward_inputs, cast_forward_inputs=user_casts)
        impl.fully_shard(getattr(model, child), mp_policy=policy)
        impl.fully_shard(model)
        model(x).sum().backward()
        got = tuple(forward_inputs[m].dtype for m in (model, model.c1, model.c2))
        assert got == dtypes, f"{name}: forward input dtypes of (root, c1, c2) {got}, expected {dtypes}"
        out[name] = impl.full_grads(model)
    return out


@cases.case(world_size=2)
def submodules_with_external_inputs(rank, world_size, impl):
    """Upstream: test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionCasts::test_submodules_with_external_inputs
    (enable_submodule_cast in {False, True}): a child unit's input created inside the parent's
    forward (fp32) is cast to fp16 only if the child's own policy casts forward inputs."""
    out = []
    for enable_submodule_cast in (False, True):

        class ToyModule(nn.Module):
            def __init__(self, forward_inputs):
                super().__init__()
                self.l = nn.Linear(100, 100)
                self.forward_inputs = forward_inputs

            def forward(self, x, y):
                self.forward_inputs["l2_input_x"] = x
                self.forward_inputs["l2_input_y"] = y
                return self.l(x)

        class ToyModel(nn.Module):
            def __init__(self, forward_inputs):
                super().__init__()
                self.l1 = nn.Linear(100, 100)
                self.l2 = ToyModule(forward_inputs)
                self.forward_inputs = forward_inputs

            def forward(self, x):
                self.forward_inputs["model_input_x"] = x
                y = torch.ones(2, 100, dtype=torch.float32)  # external input
                return self.l2(self.l1(x), y)

        forward_inputs = {}
        torch.manual_seed(42)
        model = ToyModel(forward_inputs)
        x = torch.zeros(2, 100, dtype=torch.float32)
        impl.fully_shard(model.l2, mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.float16,
                                                                       cast_forward_inputs=enable_submodule_cast))
        impl.fully_shard(model, mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.float16))
        model(x).sum().backward()
        assert forward_inputs["model_input_x"].dtype == torch.float16
        assert forward_inputs["l2_input_x"].dtype == torch.float16
        want = torch.float16 if enable_submodule_cast else torch.float32
        assert forward_inputs["l2_input_y"].dtype == want, (enable_submodule_cast, forward_inputs["l2_input_y"].dtype)
        out.append(impl.full_grads(model))
    return out


def _checkpoint_recompute_casts(impl, recompute_cast: str):
    class RecordingLinear(nn.Linear):
        def __init__(self):
            super().__init__(1, 1)
            self.input_dtypes = []

        def forward(self, x):
            self.input_dtypes.append(x.dtype)
            return super().forward(x)

    class Model(nn.Module):
        def __init__(self, checkpoint_input_dtype):
            super().__init__()
            self.linear1 = RecordingLinear()
            self.checkpoint_input_dtype = checkpoint_input_dtype
            self.linear1_output_dtypes = []

        def checkpointed_linear1(self, x):
            x = self.linear1(x)
            self.linear1_output_dtypes.append(x.dtype)
            return x

        def forward(self, x):
            x = x.to(dtype=self.checkpoint_input_dtype)
            x = checkpoint(self.checkpointed_linear1, x, use_reentrant=False, early_stop=False)
            return x.float().sum()

    if recompute_cast == "input":
        checkpoint_input_dtype = torch.float32
        mp_policy = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    else:
        checkpoint_input_dtype = torch.bfloat16
        mp_policy = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                                              output_dtype=torch.float32, cast_forward_inputs=False)
    torch.manual_seed(42)
    model = Model(checkpoint_input_dtype)
    impl.fully_shard(model.linear1, mp_policy=mp_policy)
    impl.fully_shard(model, mp_policy=mp_policy)
    inp = torch.randn(8, 1)
    model(inp).backward()
    if recompute_cast == "input":
        assert model.linear1.input_dtypes == [torch.bfloat16, torch.bfloat16], model.linear1.input_dtypes
    else:
        assert model.linear1_output_dtypes == [torch.float32, torch.float32], model.linear1_output_dtypes
    return impl.full_grads(model)


@cases.case(world_size=2)
def checkpoint_recompute_casts_forward_inputs(rank, world_size, impl):
    """Upstream: test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionCasts::test_checkpoint_recompute_casts_forward_inputs:
    a unit inside a non-reentrant checkpoint gets its fp32 input cast to bf16 in the forward and
    again in the recomputation (input dtypes [bf16, bf16])."""
    return _checkpoint_recompute_casts(impl, "input")


@cases.case(world_size=2)
def checkpoint_recompute_casts_outputs(rank, world_size, impl):
    """Upstream: test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionCasts::test_checkpoint_recompute_casts_outputs:
    with ``output_dtype=fp32`` the unit's output is cast to fp32 in the forward and again in the
    recomputation (output dtypes [fp32, fp32])."""
    return _checkpoint_recompute_casts(impl, "output")


def _norm_modules(impl, param_dtype):
    mp_policy = impl.MixedPrecisionPolicy(param_dtype=param_dtype)
    out = []

    def inner(model, x):
        # forward and backward without dtype mismatch errors
        z = model(x)
        assert z.dtype == param_dtype, z.dtype
        z.sum().backward()
        out.append(impl.full_grads(model))

    def shard_all(model, policies=None):
        for i, module in enumerate((model[0], model[1], model[2], model)):
            impl.fully_shard(module, mp_policy=(policies or {}).get(i, mp_policy))

    def expect_dtype_mismatch(model, x):
        # CPU's batch_norm kernels require the running stats in the weight's dtype: fp32 buffers
        # with low-precision weights raise in forward (upstream expects this for BatchNorm2d on
        # CUDA/XPU; on CPU BatchNorm1d raises too)
        try:
            model(x)
        except RuntimeError as e:
            assert "expected scalar type" in str(e), e
        else:
            raise AssertionError("batch norm with fp32 running stats and low-precision weights did not raise")

    torch.manual_seed(42)
    # Layer norm
    model = nn.Sequential(nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 32))
    shard_all(model)
    inner(model, torch.randn((4, 32)))
    # Batch norm 1D: fp32 running stats raise on CPU (see above), buffers cast down work
    model = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Linear(32, 32))
    shard_all(model)
    expect_dtype_mismatch(model, torch.randn((4, 32)))
    model = nn.Sequential(nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Linear(32, 32))
    shard_all(model)
    model[1].running_mean = model[1].running_mean.to(param_dtype)
    model[1].running_var = model[1].running_var.to(param_dtype)
    inner(model, torch.randn((4, 32)))
    # Batch norm 2D: fp32 running stats with low-precision weights raise (as upstream on CUDA)
    model = nn.Sequential(nn.Conv2d(1, 5, 3), nn.BatchNorm2d(5), nn.Conv2d(5, 4, 3))
    shard_all(model)
    expect_dtype_mismatch(model, torch.randn((3, 1, 9, 9)))
    # Batch norm 2D: buffers cast down to the low precision
    model = nn.Sequential(nn.Conv2d(1, 5, 3), nn.BatchNorm2d(5), nn.Conv2d(5, 4, 3))
    shard_all(model)
    model[1].running_mean = model[1].running_mean.to(param_dtype)
    model[1].running_var = model[1].running_var.to(param_dtype)
    inner(model, torch.randn((3, 1, 9, 9)))
    # Batch norm 2D: a policy of its own for the norm (fp32 compute, low-precision output)
    model = nn.Sequential(nn.Conv2d(1, 5, 3), nn.BatchNorm2d(5), nn.Conv2d(5, 4, 3))
    shard_all(model, {1: impl.MixedPrecisionPolicy(output_dtype=param_dtype)})
    inner(model, torch.randn((3, 1, 9, 9)))
    return out


@cases.case(world_size=2)
def norm_modules_bf16(rank, world_size, impl):
    """Upstream: test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionCasts::test_norm_modules_bf16
    (upstream needs NCCL for bf16 collectives; gloo has them): LayerNorm, BatchNorm1d/2d units
    with bf16 compute run forward/backward, output bf16: fp32 running stats raise the kernels'
    dtype mismatch (upstream: BatchNorm2d on CUDA; on CPU BatchNorm1d too), running stats cast
    to bf16 work, and so does a norm unit with its own fp32 policy and bf16 ``output_dtype``."""
    return _norm_modules(impl, torch.bfloat16)


@cases.case(world_size=2)
def norm_modules_fp16(rank, world_size, impl):
    """Upstream: test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionCasts::test_norm_modules_fp16:
    the same with fp16 compute."""
    return _norm_modules(impl, torch.float16)


@cases.case(world_size=2)
def clamp_reduce_dtype(rank, world_size, impl):
    """Upstream: test_fully_shard_mixed_precision.py::TestFullyShardMixedPrecisionCasts::test_clamp_reduce_dtype:
    a model initialised in bf16 with param/reduce dtype bf16, converted to fp32 after fully_shard
    (``model.to(torch.float32)``): the policy's reduce_dtype is not clamped, the reduce-scatters
    stay in bf16, and the gradients follow the fp32 parameters."""
    init_dtype = torch.bfloat16
    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(32, 32, dtype=init_dtype), nn.Linear(32, 32, dtype=init_dtype))
    mp_policy = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    assert mp_policy.reduce_dtype == torch.bfloat16
    for module in model:
        impl.fully_shard(module, mp_policy=mp_policy)
    impl.fully_shard(model, mp_policy=mp_policy)
    model.to(torch.float32)
    rank_seed(rank)
    inp = torch.randn((4, 32))
    with record_reduce_scatters(impl) as calls:
        model(inp).sum().backward()
    assert_reduce_dtypes(calls, torch.bfloat16, "backward after model.to(float32)")
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, f"{name}: {p.dtype}"
        assert p.grad is not None and p.grad.dtype == torch.float32, f"{name}.grad: {p.grad}"
    return impl.full_grads(model)


test_case = cases.pytest_tests()
