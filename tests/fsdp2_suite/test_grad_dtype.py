"""Port of upstream ``test/distributed/_composable/fsdp/test_fully_shard_grad_dtype.py`` (the parts
that do not need ``MixedPrecisionPolicy.grad_dtype``).

Upstream's file tests ``MixedPrecisionPolicy(grad_dtype=...)``, added to FSDP2 after torch 2.13
(the installed torch, whose policy has no ``grad_dtype``; flashfsdp follows 2.13's fields). What is
portable here is what that file checks of the policy without it: the dtype of the unsharded
gradient and of the sharded ``.grad`` by default (``param_dtype=bf16, reduce_dtype=fp32``), the
reduction dtype and ``set_reduce_scatter_unused_params`` with a sum reduction (divide factor 1),
gradients surviving ``nn.Module._apply`` conversions (a failed one included), and the policy's
positional fields.

Upstream's ``_FP32WGrad`` computes the weight gradient with ``torch.mm(..., out_dtype=fp32)``
(CUDA only); here the same FP32 product of the bf16 operands is computed by upcasting them. Its
fp32 result reaches a bf16 unsharded parameter, so autograd casts it to bf16 (that is the default
behaviour checked). Upstream's hook on the private ``FSDPParam.unsharded_param`` is a hook
registered on ``module.weight`` inside forward, where both implementations hold the unsharded
parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)

UPSTREAM = "test/distributed/_composable/fsdp/test_fully_shard_grad_dtype.py"
VALUE = 1.0078125  # 1 + 2^-7: exact in bf16, its square is not


class _FP32WGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp, weight):
        ctx.save_for_backward(inp, weight)
        return inp @ weight.T

    @staticmethod
    def backward(ctx, grad_output):
        inp, weight = ctx.saved_tensors
        grad_weight = grad_output.T.float() @ inp.float()  # upstream: torch.mm(..., out_dtype=torch.float32)
        return grad_output @ weight, grad_weight


class _Linear(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.full((32, 32), 0.125, dtype=dtype))
        self.unsharded_grad_dtypes: list | None = None  # record the unsharded weight's gradient dtype

    def forward(self, inp):
        if self.unsharded_grad_dtypes is not None and torch.is_grad_enabled():
            self.weight.register_hook(lambda grad: self.unsharded_grad_dtypes.append(grad.dtype))
        return _FP32WGrad.apply(inp, self.weight)


def _default_gradient_dtype(rank, world_size, impl, storage_dtype):
    projection = _Linear(storage_dtype)
    impl.fully_shard(projection, mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                     reduce_dtype=torch.float32))
    projection.unsharded_grad_dtypes = []
    inp = torch.full((2, 32), VALUE, dtype=torch.bfloat16)
    output = projection(inp)
    output.backward(torch.full_like(output, VALUE))
    assert projection.unsharded_grad_dtypes == [torch.bfloat16], projection.unsharded_grad_dtypes
    grad = projection.weight.grad
    assert grad.dtype == storage_dtype, grad.dtype
    # The bf16 unsharded gradient (2 * VALUE^2 rounded to bf16 = 2.03125), averaged over equal ranks
    expected = torch.full((32, 32), 2 * VALUE * VALUE).bfloat16().to(storage_dtype)
    torch.testing.assert_close(impl.local(grad), impl.shard_of(expected, projection.weight), rtol=0, atol=0)
    return impl.full(grad, projection.weight).float()


@cases.case(world_size=2)
def default_gradient_dtype_bf16_storage(rank, world_size, impl):
    """Upstream: test_fully_shard_grad_dtype.py::TestFullyShardGradientDtype::test_default_gradient_dtype
    (storage_dtype=bf16): with param_dtype=bf16, reduce_dtype=fp32 and no grad_dtype, the unsharded
    weight's gradient is bf16 (the fp32 weight-gradient product is cast by autograd) and the
    sharded ``.grad`` has the parameter's dtype (bf16), valued the bf16-rounded product."""
    return _default_gradient_dtype(rank, world_size, impl, torch.bfloat16)


@cases.case(world_size=2)
def default_gradient_dtype_fp32_storage(rank, world_size, impl):
    """Upstream: test_fully_shard_grad_dtype.py::TestFullyShardGradientDtype::test_default_gradient_dtype
    (storage_dtype=fp32): the same with fp32 parameters: bf16 unsharded gradient, fp32 ``.grad``."""
    return _default_gradient_dtype(rank, world_size, impl, torch.float32)


@cases.case(world_size=2)
def positional_compatibility(rank, world_size, impl):
    """Upstream: test_fully_shard_grad_dtype.py::TestGradientDtypePolicy::test_positional_compatibility:
    ``MixedPrecisionPolicy(bf16, fp32, None, False)`` keeps the positional order param_dtype,
    reduce_dtype, output_dtype, cast_forward_inputs (upstream also checks that the newer
    ``grad_dtype`` defaults to None: absent in torch 2.13, so None or missing here)."""
    policy = impl.MixedPrecisionPolicy(torch.bfloat16, torch.float32, None, False)
    assert policy.param_dtype == torch.bfloat16 and policy.reduce_dtype == torch.float32, policy
    assert policy.output_dtype is None and policy.cast_forward_inputs is False, policy
    assert getattr(policy, "grad_dtype", None) is None, policy
    return {}


def _explicit_reduction_dtype_and_unused_parameter(rank, world_size, impl, reduce_dtype):
    projection = _Linear(torch.bfloat16)
    projection.register_parameter("unused", nn.Parameter(torch.zeros_like(projection.weight)))
    impl.fully_shard(projection, mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                     reduce_dtype=reduce_dtype))
    projection.set_reduce_scatter_unused_params(True)
    projection.set_gradient_divide_factor(1.0)
    projection.set_force_sum_reduction_for_comms(True)
    inp = torch.full((2, 32), VALUE, dtype=torch.bfloat16)
    output = projection(inp)
    grad_output = torch.full_like(output, VALUE)
    # The unsharded gradient is the bf16-rounded product; reduced (summed) in reduce_dtype
    expected = (grad_output.float().T @ inp.float()).bfloat16().to(reduce_dtype)
    dist.all_reduce(expected, op=dist.ReduceOp.SUM)
    output.backward(grad_output)
    grad = projection.weight.grad
    assert grad.dtype == torch.bfloat16, grad.dtype
    torch.testing.assert_close(impl.local(grad), impl.shard_of(expected.bfloat16(), projection.weight), rtol=0, atol=0)
    # set_reduce_scatter_unused_params(True): the unused parameter gets a zero gradient, not None
    assert projection.unused.grad is not None, "the unused parameter has no gradient"
    assert projection.unused.grad.dtype == torch.bfloat16, projection.unused.grad.dtype
    assert torch.count_nonzero(impl.local(projection.unused.grad)) == 0
    return impl.full(grad, projection.weight).float()


@cases.case(world_size=2)
def explicit_reduction_dtype_and_unused_parameter_bf16(rank, world_size, impl):
    """Upstream: test_fully_shard_grad_dtype.py::TestFullyShardGradientDtype::test_explicit_reduction_dtype_and_unused_parameter
    (reduce_dtype=bf16; grad_dtype=fp32 dropped: the gradient keeps the bf16 parameter dtype):
    with ``set_gradient_divide_factor(1.0)`` and ``set_force_sum_reduction_for_comms(True)`` the
    gradient is the sum over ranks of the bf16 products, exactly; with
    ``set_reduce_scatter_unused_params(True)`` the unused parameter gets a zero gradient."""
    return _explicit_reduction_dtype_and_unused_parameter(rank, world_size, impl, torch.bfloat16)


@cases.case(world_size=2)
def explicit_reduction_dtype_and_unused_parameter_fp32(rank, world_size, impl):
    """Upstream: test_fully_shard_grad_dtype.py::TestFullyShardGradientDtype::test_explicit_reduction_dtype_and_unused_parameter
    (reduce_dtype=fp32; grad_dtype dropped): the same with an fp32 reduction."""
    return _explicit_reduction_dtype_and_unused_parameter(rank, world_size, impl, torch.float32)


def assert_apply_fails(model: nn.Module, convert, message: str) -> None:
    """``model._apply(convert)`` must raise the RuntimeError ``convert`` raises (``message``)."""
    try:
        model._apply(convert)
    except RuntimeError as e:
        assert message in str(e), e
    else:
        raise AssertionError(f"model._apply({convert.__name__}) did not raise")


@cases.case(world_size=2)
def parameter_conversion_with_gradient(rank, world_size, impl):
    """Upstream: test_fully_shard_grad_dtype.py::TestFullyShardGradientDtype::test_parameter_conversion_with_gradient
    (grad_dtype=None, storage_dtype in {bf16, fp32}; CPU only, so the device moves are no-ops): a
    ``model._apply`` that fails on the parameters leaves each parameter's ``.grad`` object as it
    was; ``model.cpu()`` keeps the parameter objects, values, gradients and their dtype; after
    ``model.to(device)`` a second backward accumulates onto the kept gradient (2x)."""
    out = {}
    for storage_dtype in (torch.bfloat16, torch.float32):
        model = nn.Sequential(_Linear(storage_dtype))
        impl.fully_shard(model, mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        inp = torch.full((3, 32), VALUE, dtype=torch.bfloat16)
        model(inp).backward(torch.full_like(inp, VALUE))
        param = model[0].weight
        expected_param = impl.local(param).detach().clone()
        expected_grad = impl.local(param.grad).clone()
        expected_dtype = storage_dtype

        def fail_on_parameter(tensor):
            if tensor.requires_grad:
                raise RuntimeError("parameter conversion failed")
            return tensor.clone()

        original_grad = param.grad
        assert_apply_fails(model, fail_on_parameter, "parameter conversion failed")
        assert param.grad is original_grad, "a failed _apply replaced the gradient"
        del original_grad

        model.cpu()
        assert model[0].weight is param, "model.cpu() replaced the parameter object"
        assert param.device.type == "cpu" and param.grad.device.type == "cpu"
        assert param.grad_dtype == expected_dtype, param.grad_dtype
        assert param.grad.dtype == expected_dtype, param.grad.dtype
        torch.testing.assert_close(impl.local(param), expected_param, rtol=0, atol=0)
        torch.testing.assert_close(impl.local(param.grad), expected_grad, rtol=0, atol=0)

        model.to(device="cpu")
        assert param.grad.dtype == expected_dtype, param.grad.dtype
        torch.testing.assert_close(impl.local(param.grad), expected_grad, rtol=0, atol=0)
        model(inp).backward(torch.full_like(inp, VALUE))
        torch.testing.assert_close(impl.local(param.grad), expected_grad * 2, rtol=0, atol=0)
        out[str(storage_dtype)] = impl.full(param.grad, param).float()
    return out


@cases.case(world_size=2)
def partial_parameter_conversion_failure(rank, world_size, impl):
    """Upstream: test_fully_shard_grad_dtype.py::TestFullyShardGradientDtype::test_partial_parameter_conversion_failure
    (storage_dtype in {bf16, fp32}; grad_dtype=fp32 dropped: the gradients keep the parameters'
    dtype; CPU only): an ``_apply`` that fails on a buffer after converting the first
    submodule's parameters leaves every gradient present, on its parameter's device, in its
    dtype and value; training then accumulates onto them (2x)."""
    out = {}
    for storage_dtype in (torch.bfloat16, torch.float32):
        model = nn.Sequential(_Linear(storage_dtype), _Linear(storage_dtype))
        model[0].register_buffer("conversion_sentinel", torch.ones(1))
        impl.fully_shard(model, mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        inp = torch.full((3, 32), VALUE, dtype=torch.bfloat16)
        model(inp).backward(torch.full_like(inp, VALUE))
        params = list(model.parameters())
        expected_grads = [impl.local(p.grad).clone() for p in params]

        def fail_on_buffer(tensor):
            if tensor.numel() == 1:
                raise RuntimeError("buffer conversion failed")
            return tensor.cpu()

        assert_apply_fails(model, fail_on_buffer, "buffer conversion failed")
        for param, expected in zip(params, expected_grads):
            assert param.grad is not None
            assert param.grad.device == param.device
            assert param.grad.dtype == storage_dtype, param.grad.dtype
            torch.testing.assert_close(impl.local(param.grad), expected, rtol=0, atol=0)
        model.to(device="cpu")
        model(inp).backward(torch.full_like(inp, VALUE))
        for param, expected in zip(params, expected_grads):
            torch.testing.assert_close(impl.local(param.grad), expected * 2, rtol=0, atol=0)
        out[str(storage_dtype)] = [impl.full(p.grad, p).float() for p in params]
    return out


test_case = cases.pytest_tests()
