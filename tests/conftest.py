"""Test-suite set-up: which Triton mode the kernels get, `gpu` tests skipped without CUDA, and every
`gpu` test checked to run the compiled Triton kernels.

``TRITON_INTERPRET`` (when the environment does not set it) defaults to 1 without CUDA, so that
the Triton kernels run on CPU tensors under the interpreter, and to 0 with CUDA, so that a GPU
machine tests the compiled kernels (the interpreter would leave CUDA tensors on the reference
path, and the `gpu` tests could pass without running Triton at all). It must be decided before
anything imports triton (see [Note: interpreter mode is fixed at import] in
``flashfsdp/kernels/triton_support.py``); spawned ranks inherit it.
"""

import os

import pytest
import torch

if "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "0" if torch.cuda.is_available() else "1"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_tests_run_triton(request):
    """For a `gpu` test: fail unless CUDA tensors get the compiled Triton kernels in this process,
    and, after the test, unless every kernel call it made here on CUDA tensors ran them. Ranks the
    test spawns inherit the mode; tests that train in spawned ranks return and check their counts."""
    if "gpu" not in request.keywords:
        yield
        return
    from flashfsdp.kernels import dispatch  # noqa: PLC0415 - after TRITON_INTERPRET is settled

    backend = dispatch.select_backend(torch.device("cuda"))
    assert backend == "triton", (
        f"gpu tests must run the compiled Triton kernels, but CUDA tensors get the {backend} path here "
        f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r}, triton importable: "
        f"{dispatch.triton_support.AVAILABLE}); unset TRITON_INTERPRET or set it to 0")
    dispatch.reset_backend_counts()
    yield
    on_reference = {k: n for k, n in dispatch.backend_counts().items() if k[1:] == ("reference", "cuda")}
    assert not on_reference, f"kernel calls on CUDA tensors took the reference path: {on_reference}"
