"""The optimizer tests run the runtime's kernels on their torch reference path (the kernels have
their own tests; under the Triton interpreter every unshard would cost seconds)."""

import pytest

from flashfsdp.kernels import dispatch


@pytest.fixture(autouse=True)
def _reference_kernels():
    with dispatch.use_reference():
        yield
