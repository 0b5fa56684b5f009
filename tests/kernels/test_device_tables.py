"""Cached device segment tables: a launch whose table is byte-for-byte one already uploaded reuses
it (no pinned staging, no host-to-device copy); any difference, device or stream is a new upload."""

import numpy as np
import pytest
import torch

from flashfsdp.kernels import segments
from flashfsdp.kernels.segments import DEVICE_TABLES, DeviceTables
from tests.kernels.spec import assert_same, expected_flatten, random_tensor


def _table(seed: int, rows: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 2**40, size=(rows, segments.TABLE_COLUMNS), dtype=np.int64)


def test_same_bytes_reuse_the_upload_and_the_cache_owns_its_copy():
    tables = DeviceTables()
    host = _table(0)
    first = tables.get(host, torch.device("cpu"))
    host[0, 0] += 1  # the caller's array changes: the cached copy does not
    assert first[0, 0].item() == host[0, 0] - 1
    again = tables.get(host.copy(), torch.device("cpu"))
    assert again is not first and (tables.hits, tables.uploads) == (0, 2)
    host[0, 0] -= 1
    assert tables.get(host, torch.device("cpu")) is first
    assert (tables.hits, tables.uploads, len(tables)) == (1, 2, 2)
    assert torch.equal(first, torch.from_numpy(host))


def test_another_stream_or_shape_is_another_entry():
    tables = DeviceTables()
    host = _table(1, rows=4)
    a = tables.get(host, torch.device("cpu"), stream=1)
    b = tables.get(host, torch.device("cpu"), stream=2)
    c = tables.get(host.reshape(2, 2 * segments.TABLE_COLUMNS), torch.device("cpu"), stream=1)
    assert a is not b and c is not a and tables.uploads == 3 and tables.hits == 0


def test_least_recently_used_tables_go_first():
    t0, t1, t2 = _table(10), _table(11), _table(12)
    tables = DeviceTables(capacity_bytes=2 * t0.nbytes)
    first = tables.get(t0, torch.device("cpu"))
    tables.get(t1, torch.device("cpu"))
    assert tables.get(t0, torch.device("cpu")) is first  # t0 is now the most recent
    tables.get(t2, torch.device("cpu"))  # evicts t1
    assert len(tables) == 2 and tables.nbytes == 2 * t0.nbytes and tables.get(t0, torch.device("cpu")) is first
    uploads = tables.uploads
    tables.get(t1, torch.device("cpu"))
    assert tables.uploads == uploads + 1
    tables.clear()
    assert len(tables) == 0 and tables.nbytes == tables.hits == tables.uploads == 0


def test_a_table_larger_than_the_capacity_is_kept_alone():
    tables = DeviceTables(capacity_bytes=8)
    tables.get(_table(20), torch.device("cpu"))
    big = tables.get(_table(21, rows=50), torch.device("cpu"))
    assert len(tables) == 1 and tables.get(_table(21, rows=50), torch.device("cpu")) is big


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="capacity_bytes must be >= 1, got 0"):
        DeviceTables(capacity_bytes=0)


@pytest.mark.gpu
def test_a_repeated_launch_reuses_its_table_and_a_moved_tensor_does_not(cuda_triton_ops):
    """Steady-state training: the same gradients' addresses step after step hit the cache; new
    addresses (a tensor reallocated) upload a new table, and the results stay exact either way."""
    device = torch.device("cuda")
    tensors = [random_tensor((n,), torch.float32, device, seed=n) for n in (1000, 4097, 33)]
    offsets = [0, 1000, 6000]
    out = torch.empty(6100, dtype=torch.bfloat16, device=device)
    DEVICE_TABLES.clear()
    for _ in range(3):
        cuda_triton_ops.flatten(tensors, offsets, out, scale=0.5)
    assert (DEVICE_TABLES.uploads, DEVICE_TABLES.hits) == (1, 2)
    assert_same(out, expected_flatten(tensors, offsets, out.numel(), torch.bfloat16, scale=0.5))
    tensors[1] = tensors[1].clone()  # another block: another address, another table
    tensors[1].mul_(3)
    cuda_triton_ops.flatten(tensors, offsets, out, scale=0.5)
    torch.cuda.synchronize()
    assert DEVICE_TABLES.uploads == 2
    assert_same(out, expected_flatten(tensors, offsets, out.numel(), torch.bfloat16, scale=0.5))
