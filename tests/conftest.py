"""Test-suite set-up: the Triton interpreter on CPU, and `gpu` tests skipped without CUDA."""

import os

# Must happen before anything imports triton: the kernels then run on CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
