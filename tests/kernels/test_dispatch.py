"""Backend selection, the package's public names, import without Triton, and GPU compilation."""

import ast
import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest
import torch

import flashfsdp.kernels as kernels
from flashfsdp.kernels import dispatch, reference, triton_support

REPO = pathlib.Path(__file__).resolve().parents[2]
KERNELS_DIR = REPO / "flashfsdp" / "kernels"


def run_python(code, **env):
    """Run ``code`` in a fresh interpreter at the repository root; return its stdout."""
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env={**os.environ, **env},
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_public_names_are_the_dispatching_functions():
    import flashfsdp.kernels.flatten  # importing an op module must not shadow the op
    import flashfsdp.kernels.quantize
    import flashfsdp.kernels.quantize_grad
    from flashfsdp.kernels import (accumulate_grad_shard, accumulate_grad_shards, dequantize_int8, dequantize_reduce,
                                   flatten, quantize_grad, quantize_int8, unflatten)

    assert flashfsdp.kernels.flatten is dispatch.flatten and flashfsdp.kernels.quantize_grad is dispatch.quantize_grad
    assert kernels.__all__ == ["flatten", "unflatten", "accumulate_grad_shard", "accumulate_grad_shards",
                               "quantize_int8", "dequantize_int8", "quantize_grad", "dequantize_reduce",
                               "FlattenPlan", "UnflattenPlan"]
    public = (flatten, unflatten, accumulate_grad_shard, accumulate_grad_shards, quantize_int8, dequantize_int8,
              quantize_grad, dequantize_reduce)
    assert public == (
        dispatch.flatten, dispatch.unflatten, dispatch.accumulate_grad_shard, dispatch.accumulate_grad_shards,
        dispatch.quantize_int8, dispatch.dequantize_int8, dispatch.quantize_grad, dispatch.dequantize_reduce)
    for function in (*public, kernels.FlattenPlan.run, kernels.UnflattenPlan.run):
        assert "Raises:" in function.__doc__ and "Args:" in function.__doc__


def test_automatic_choice_follows_the_kernels_mode():
    served = dispatch.triton_device_type()
    expected = "cpu" if triton_support.INTERPRETED else "cuda"
    assert served == (expected if triton_support.AVAILABLE else None)
    assert dispatch.select_backend(torch.device("meta")) == "reference"
    if served is not None:
        assert dispatch.select_backend(torch.device(served)) == "triton"


def test_forcing_a_backend_and_restoring_it():
    cpu = torch.device("cpu")
    automatic = dispatch.select_backend(cpu)
    with dispatch.use_reference():
        assert dispatch.select_backend(cpu) == "reference"
        with dispatch.use_backend(None):
            assert dispatch.select_backend(cpu) == automatic
        assert dispatch.select_backend(cpu) == "reference"
    assert dispatch.select_backend(cpu) == automatic
    with pytest.raises(ValueError, match="backend must be one of"):
        with dispatch.use_backend("cuda"):
            pass


def test_forcing_triton_where_it_cannot_run_raises():
    with dispatch.use_triton():
        with pytest.raises(RuntimeError, match="Triton backend forced"):
            dispatch.select_backend(torch.device("meta"))


def test_forced_reference_really_runs_the_reference(monkeypatch):
    calls = []
    monkeypatch.setattr(reference, "flatten", lambda *args, **kwargs: calls.append(args) or args[2])
    out = torch.zeros(2)
    with dispatch.use_reference():
        assert kernels.flatten([torch.ones(2)], [0], out) is out
    assert len(calls) == 1


def test_kernels_import_nothing_from_runtime_or_bindings():
    for path in KERNELS_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert not name.startswith(("flashfsdp.runtime", "flashfsdp.bindings")), (path, name)


def test_works_without_triton():
    """With ``import triton`` failing, the package imports and every CPU op runs the reference;
    CUDA tensors are refused (no silent fallback), the reference forced on purpose is allowed."""
    output = run_python(
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from flashfsdp.kernels import flatten, unflatten, accumulate_grad_shard, dispatch\n"
        "out = flatten([torch.ones(2, dtype=torch.bfloat16)], [1], torch.full((4,), float('nan')))\n"
        "dst = torch.ones(4)\n"
        "norm_sq, flag = accumulate_grad_shard(out, dst)\n"
        "with dispatch.use_reference():\n"
        "    forced = dispatch.select_backend(torch.device('cuda'))\n"
        "try:\n"
        "    dispatch.select_backend(torch.device('cuda'))\n"
        "except RuntimeError as error:\n"
        "    refused = 'flashfsdp[cuda12]' in str(error)\n"
        "print(dispatch.triton_device_type(), forced, refused, out.tolist(), norm_sq.item(), flag.item())\n",
        TRITON_INTERPRET="1",
    )
    assert output.split() == ["None", "reference", "True", "[0.0,", "1.0,", "1.0,", "0.0]", "10.0", "False"]


def ptxas_available():
    if not triton_support.AVAILABLE:
        return False
    bundled = pathlib.Path(triton_support.triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    return bundled.exists() or shutil.which("ptxas") is not None


@pytest.mark.skipif(not ptxas_available(), reason="needs Triton's NVIDIA backend (ptxas)")
def test_kernels_compile_for_h100_with_vector_accesses():
    """The kernels build for sm_90 without a GPU, and their hot paths use 16-byte accesses.

    flatten's aligned full-block path must load every input dtype with ``ld.global.v4.b32``
    (per thread: 16 fp32 elements = 4 vectors, 16 bf16 or fp16 = 2 each), and unflatten's must
    store every output dtype that way.
    """
    from flashfsdp.kernels.flatten import BLOCK, NUM_WARPS

    report = json.loads(run_python(
        "from tests.kernels.compile_for_gpu import main; main()",
        TRITON_INTERPRET="0", TRITON_DEFAULT_FP_FUSION="0",
    ))
    assert len(report) == 16
    per_thread = BLOCK // (32 * NUM_WARPS)
    vectors_for_three_dtypes = per_thread // 4 + 2 * (per_thread // 8)
    for kernel, accesses in report.items():
        if kernel.startswith("flatten"):
            assert accesses.get("ld.global.v4.b32") == vectors_for_three_dtypes, (kernel, accesses)
            assert accesses.get("st.global.v4.b32"), (kernel, accesses)
        elif kernel.startswith("unflatten"):
            assert accesses.get("st.global.v4.b32") == vectors_for_three_dtypes, (kernel, accesses)
            assert accesses.get("ld.global.v4.b32"), (kernel, accesses)
        elif kernel.startswith("accumulate"):
            assert accesses.get("ld.global.v4.b32") and accesses.get("st.global.v4.b32"), (kernel, accesses)
        elif kernel.startswith("quantize"):  # reads floats, writes int8 / int4 bytes and fp32 scales
            assert accesses.get("ld.global.b32") and accesses.get("st.global.b8"), (kernel, accesses)
        elif kernel.startswith("dequantize_reduce"):  # reads int8 / int4 bytes and fp32 scales
            assert accesses.get("ld.global.b8") and accesses.get("ld.global.b32"), (kernel, accesses)


def test_float64_runs_the_reference_in_float64_even_when_triton_is_forced():
    """``model.double()`` units: the kernels compute in fp32, so a float64 tensor anywhere in the call
    routes it to the reference, which keeps every float64 digit."""
    x = torch.tensor([1.0 + 2.0 ** -40, -3.0], dtype=torch.float64)
    with dispatch.use_backend("triton" if dispatch.triton_device_type() == "cpu" else "reference"):
        out = torch.empty(4, dtype=torch.float64)
        kernels.flatten([x], [1], out, scale=0.5)
        assert out.tolist() == [0.0, 0.5 + 2.0 ** -41, -1.5, 0.0]
        back = torch.empty(2, dtype=torch.float64)
        kernels.unflatten(out, [1], [back])
        assert torch.equal(back, x * 0.5)
        dst = torch.full((2,), 2.0 ** -30, dtype=torch.float64)
        norm_sq, nonfinite = kernels.accumulate_grad_shard(x, dst, scale=2.0)
        assert dst.tolist() == [2.0 + 2.0 ** -39 + 2.0 ** -30, -6.0 + 2.0 ** -30]
        assert norm_sq.dtype == torch.float64 and norm_sq.item() == (dst ** 2).sum().item()
        assert not nonfinite
