"""Fixtures of the kernel tests: the device the Triton kernels serve, and the three ways to run an op.

Every op test runs on:
- ``triton``: the public op with the dispatcher forced onto the Triton launcher (the interpreter on
  CPU by default; compiled kernels on CUDA when run with ``TRITON_INTERPRET=0`` on a GPU machine);
- ``reference``: the public op with the dispatcher forced onto the reference;
- ``reference-direct``: the functions of ``flashfsdp.kernels.reference`` called directly.
"""

import types

import pytest
import torch

import flashfsdp.kernels as kernels
from flashfsdp.kernels import dispatch, reference

PATHS = ("triton", "reference", "reference-direct")


def kernel_device() -> torch.device:
    """Where the tests put their tensors: the device the Triton kernels run on in this process."""
    return torch.device(dispatch.triton_device_type() or "cpu")


@pytest.fixture
def device() -> torch.device:
    return kernel_device()


def _ops(path: str):
    module = reference if path == "reference-direct" else kernels
    return types.SimpleNamespace(
        path=path,
        flatten=module.flatten,
        unflatten=module.unflatten,
        accumulate_grad_shard=module.accumulate_grad_shard,
        accumulate_grad_shards=module.accumulate_grad_shards,
    )


@pytest.fixture(params=PATHS)
def ops(request):
    """A namespace with ``flatten``, ``unflatten``, ``accumulate_grad_shard`` run on one path."""
    path = request.param
    if path == "triton" and dispatch.triton_device_type() is None:
        pytest.skip("triton cannot be imported")
    backend = None if path == "reference-direct" else path
    with dispatch.use_backend(backend):
        yield _ops(path)


@pytest.fixture(params=PATHS)
def op_module(request):
    """``flashfsdp.kernels`` with the dispatcher forced onto one path, or ``flashfsdp.kernels.reference``
    itself (``reference-direct``): every op, the quantisation ones included, by its public name."""
    path = request.param
    if path == "triton" and dispatch.triton_device_type() is None:
        pytest.skip("triton cannot be imported")
    with dispatch.use_backend(None if path == "reference-direct" else path):
        yield reference if path == "reference-direct" else kernels


@pytest.fixture
def cuda_triton_ops():
    """The ops on compiled Triton kernels for CUDA tensors (the ``gpu`` tests).

    Skips unless the kernels were compiled, i.e. the tests run on a GPU machine with
    ``TRITON_INTERPRET=0`` (the root conftest sets it to 1 only when it is unset).
    """
    if dispatch.triton_device_type() != "cuda" or not torch.cuda.is_available():
        pytest.skip("needs compiled Triton kernels on CUDA: run with TRITON_INTERPRET=0 on a GPU machine")
    with dispatch.use_backend("triton"):
        yield _ops("triton")
