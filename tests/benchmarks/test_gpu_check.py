"""benchmarks.gpu_check's CPU side: arguments, the dry run without CUDA (every GPU step skipped,
results written), the time budget, the environment checks, and the pure helpers."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.gpu_check import environment, training
from benchmarks.gpu_check.__main__ import main, parse_args, run_steps
from benchmarks.gpu_check.formula import zero3_peak_bytes, zero3_state_bytes, zero3_working_bytes
from benchmarks.gpu_check.steps import STEPS, Context, _llama_params

GPU_STEPS = [name for name in STEPS if name != "environment"]


def test_arguments_keep_the_documented_order_and_refuse_bad_values():
    args = parse_args([])
    assert args.steps == list(STEPS) and args.budget == 540 and args.out is None and not args.quick
    assert parse_args(["--steps", "step", "environment"]).steps == ["environment", "step"]
    with pytest.raises(SystemExit):
        parse_args(["--steps", "nothing"])
    with pytest.raises(SystemExit):
        parse_args(["--budget", "0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run of a machine without CUDA")
def test_dry_run_without_cuda_skips_every_gpu_step_and_writes_the_results(tmp_path):
    assert main(["--out", str(tmp_path)]) == 0
    document = json.loads((tmp_path / "gpu_check.json").read_text())
    steps = document["steps"]
    assert list(steps) == list(STEPS)
    assert steps["environment"]["status"] == "ok" and document["environment"]["gpu"] == "none"
    assert set(document["environment"]) == set(environment.FIELDS)
    for name in GPU_STEPS:
        assert (steps[name]["status"], steps[name]["detail"]) == ("skipped", "skipped: no CUDA"), name
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| pytest | skipped |" in table and "backend: none (no CUDA)" in table


def test_steps_without_their_share_of_the_budget_are_skipped(tmp_path):
    ctx = Context(out=tmp_path, cuda=False, seconds_left=lambda: 0.0)
    results = run_steps(["environment", "kernels"], ctx, deadline=0.0, clock=lambda: 1.0)
    for result in results.values():
        assert result["status"] == "skipped" and result["detail"].startswith("skipped: out of time")


def test_a_step_that_raises_keeps_its_whole_message(tmp_path, monkeypatch):
    from benchmarks.gpu_check import __main__ as gpu_check

    def raising(ctx):
        raise RuntimeError("--- rank 0 ---\nTraceback (most recent call last):\n  ...\nValueError: the cause")

    monkeypatch.setitem(gpu_check.STEPS, "kernels", raising)
    ctx = Context(out=tmp_path, cuda=True, seconds_left=lambda: 1e9)
    result = run_steps(["kernels"], ctx, deadline=1e9, clock=lambda: 0.0)["kernels"]
    assert result["status"] == "failed"
    assert result["detail"] == "RuntimeError: --- rank 0 --- ... ValueError: the cause"
    assert "ValueError: the cause" in result["data"]["error"] and "raising" in result["data"]["error"]


def _gpu_env(**changes):
    env = {field: "x" for field in environment.FIELDS}
    env.update({"gpu": "NVIDIA H100 80GB HBM3", "backend": "triton", "cuda": "13.0", "cupy_cuda": "13", **changes})
    return env


def test_environment_problems_name_what_makes_figures_untrustworthy():
    assert environment.problems(_gpu_env()) == []
    assert environment.problems(_gpu_env(cupy_cuda="None")) == []
    (reference,) = environment.problems(_gpu_env(backend="reference"))
    assert "reference kernels, not Triton" in reference
    (mismatch,) = environment.problems(_gpu_env(cupy_cuda="12"))
    assert "CuPy is built for CUDA 12, torch for CUDA 13.0" in mismatch
    assert environment.problems(_gpu_env(gpu="none", backend="none (no CUDA)")) == []


def test_cuda_without_triton_is_reported_with_the_extra_to_install(monkeypatch):
    from flashfsdp.kernels import dispatch, triton_support

    monkeypatch.setattr(triton_support, "AVAILABLE", False)
    backend = environment.cuda_backend(dispatch)
    assert backend.startswith("none: flashfsdp: cuda tensors run on the Triton kernels") and "flashfsdp[cuda12]" in backend
    (problem,) = environment.problems(_gpu_env(backend=backend))
    assert problem.startswith("CUDA tensors get no kernels: flashfsdp: cuda tensors run on the Triton kernels")


def test_loaded_libraries_read_from_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libnccl.so.2.27.3\n"
        "7f01-7f02 r--p 00001000 08:01 1 /usr/lib/x86_64-linux-gnu/libnccl.so.2.27.3\n"
        "7f02-7f03 rw-p 00000000 00:00 0\n"
        "7f03-7f04 r-xp 00000000 08:01 2 /opt/lib/libcudart.so.13\n")
    assert environment.loaded_libraries("libnccl", maps) == ["/usr/lib/x86_64-linux-gnu/libnccl.so.2.27.3"]
    assert environment.loaded_libraries("libnccl", tmp_path / "absent") == []


def test_zero3_formula():
    assert zero3_state_bytes(10**9, 8) == 2e9  # 16 bytes per parameter over 8 ranks
    assert zero3_working_bytes(1000, 1) == 1000 * (3 * 2 + 3 * 4)
    assert zero3_peak_bytes(4000, 1000, 2) == 16 * 4000 / 2 + 1000 * (6 + 2.5 * 4)
    with pytest.raises(ValueError, match="world_size >= 1"):
        zero3_state_bytes(10, 0)
    with pytest.raises(ValueError, match="unit_params must be >= 0"):
        zero3_working_bytes(-1, 1)


def test_llama_parameter_counts_for_the_formula():
    args = type("Args", (), {"dim": 64, "layers": 3, "heads": 2, "seq": 16})
    total, unit = _llama_params(args)
    from flashfsdp.models.llama import Llama, LlamaConfig  # noqa: PLC0415

    model = Llama(LlamaConfig(dim=64, n_layers=3, n_heads=2, max_seq_len=16))
    assert total == sum(p.numel() for p in model.parameters())
    assert unit == max(sum(p.numel() for p in model.layers[0].parameters()),
                       total - sum(p.numel() for p in model.layers.parameters()))


def test_training_comparisons():
    assert training.max_abs_difference([1.0, 2.0], [1.0, 2.5]) == 0.5
    assert training.max_abs_difference([1.0], [1.0, 2.0]) == float("inf")
    assert training.triton_ran({("flatten", "triton", "cuda"): 3})
    assert not training.triton_ran({("flatten", "triton", "cuda"): 3, ("unflatten", "reference", "cuda"): 1})
    assert not training.triton_ran({("flatten", "reference", "cpu"): 3})


def test_the_pytest_step_collects_exactly_the_files_with_gpu_tests():
    from benchmarks.gpu_check.steps import REPO, gpu_test_files

    files = gpu_test_files()
    assert "tests/bindings/test_cuda_memory.py" in files and "tests/kernels/test_quantize.py" in files
    assert all("\n@pytest.mark.gpu\n" in (REPO / f).read_text() for f in files)
    assert "tests/test_architecture.py" not in files and "tests/benchmarks/test_gpu_check.py" not in files


def test_the_kernel_step_judges_small_tensors_through_a_launch_plan(tmp_path, monkeypatch):
    """The kernel step's verdict from benchmarks.kernels' rows: % of copy at hidden 4096, and the
    1000-tensor speedup through a launch plan (the op's, validated per call, reported beside it)."""
    from benchmarks import kernels

    rows = [{"impl": "flashfsdp", "case": "llama-h4096", "%copy": 97.0, "speedup": 1.1},
            {"impl": "flashfsdp", "case": "small-1000", "%copy": 0.4, "speedup": 0.2},
            {"impl": "flashfsdp (plan)", "case": "small-1000", "%copy": 3.0, "speedup": 1.7},
            {"impl": "torch._foreach_copy_", "case": "small-1000", "%copy": 1.5, "speedup": 1.0}]
    monkeypatch.setattr(kernels, "main", lambda argv: rows)
    outcome = STEPS["kernels"](Context(out=tmp_path, cuda=True, seconds_left=lambda: 1e9))
    assert outcome.status == "ok" and outcome.data["min_speedup_small_plan"] == 1.7
    assert "1.70x torch through a launch plan" in outcome.detail and "0.20x through the op" in outcome.detail
    rows[2]["speedup"] = 1.2
    assert STEPS["kernels"](Context(out=tmp_path, cuda=True, seconds_left=lambda: 1e9)).status == "failed"
