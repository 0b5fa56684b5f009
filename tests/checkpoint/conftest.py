"""The checkpoint tests run the kernels on their torch reference path in the test process (the
Triton interpreter is slow and beside the point here); the ranks they spawn get it from
``tests.harness.run_distributed``."""

import pytest

from flashfsdp.kernels.dispatch import use_backend


@pytest.fixture(autouse=True)
def _reference_kernels():
    with use_backend("reference"):
        yield
