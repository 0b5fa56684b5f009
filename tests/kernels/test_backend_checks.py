"""The kernels never take the reference path silently: counted calls, a Triton too old to tell its
mode refused, and a warning when CUDA tensors end up on the reference."""

from __future__ import annotations

import types
import warnings

import pytest
import torch

import flashfsdp.kernels as kernels
from flashfsdp.kernels import dispatch, triton_support


def test_each_call_is_counted_per_op_backend_and_device():
    dispatch.reset_backend_counts()
    x = torch.arange(4.0)
    with dispatch.use_reference():
        kernels.flatten([x], [0], torch.empty(4))
        kernels.flatten([x], [0], torch.empty(4))
    assert dispatch.backend_counts() == {("flatten", "reference", "cpu"): 2}
    if dispatch.triton_device_type() == "cpu":
        with dispatch.use_triton():
            kernels.accumulate_grad_shard(x, torch.zeros(4))
            kernels.flatten([x.double()], [0], torch.empty(4, dtype=torch.float64))  # float64: reference
        counts = dispatch.backend_counts()
        assert counts[("accumulate_grad_shard", "triton", "cpu")] == 1
        assert counts[("flatten", "reference", "cpu")] == 3
    dispatch.reset_backend_counts()
    assert dispatch.backend_counts() == {}


def test_a_triton_without_knobs_is_refused_not_guessed():
    old = types.SimpleNamespace(__version__="3.2.0")
    with pytest.raises(ImportError, match=r"needs Triton >= 3.4 \(triton.knobs\), found triton 3.2.0"):
        triton_support._interpret_mode(old)
    new = types.SimpleNamespace(knobs=types.SimpleNamespace(runtime=types.SimpleNamespace(interpret=True)))
    assert triton_support._interpret_mode(new) is True


def test_cuda_tensors_on_the_reference_path_warn_once(monkeypatch):
    monkeypatch.setattr(dispatch, "_warned_cuda_on_reference", False)
    with pytest.warns(RuntimeWarning, match="CUDA tensors run the plain-torch reference kernels because"):
        dispatch._warn_cuda_on_reference()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dispatch._warn_cuda_on_reference()  # once only: no second warning
