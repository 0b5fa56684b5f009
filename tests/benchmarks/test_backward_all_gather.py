"""benchmarks.backward_all_gather: FSDP2's backward all-gathers counted through whichever
torch.distributed function this torch's FSDP2 calls (``all_gather_single`` from torch 2.12,
``all_gather_into_tensor`` before), and the function put back afterwards."""

from __future__ import annotations

import torch.distributed as dist

from benchmarks.backward_all_gather import fsdp2_backward_bytes


def test_the_counted_function_is_wrapped_and_put_back(monkeypatch):
    name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    original = getattr(dist, name)
    with fsdp2_backward_bytes() as counted:
        assert getattr(dist, name) is not original and counted == {"bytes": 0}
    assert getattr(dist, name) is original


def test_a_torch_without_all_gather_single_counts_all_gather_into_tensor(monkeypatch):
    monkeypatch.delattr(dist, "all_gather_single", raising=False)
    original = dist.all_gather_into_tensor
    with fsdp2_backward_bytes():
        assert dist.all_gather_into_tensor is not original
    assert dist.all_gather_into_tensor is original and not hasattr(dist, "all_gather_single")
