"""Smoke test of ``python -m benchmarks.kernels`` at toy sizes: it runs and writes its three files."""

import csv

from benchmarks import kernels as kernel_benchmark
from flashfsdp.kernels import dispatch


def test_benchmark_runs_and_writes_results(tmp_path):
    with dispatch.use_reference():  # the interpreter would be slow; the Triton path is tested elsewhere
        rows = kernel_benchmark.main(
            ["--device", "cpu", "--sizes", "64", "--no-small", "--repeats", "1", "--out", str(tmp_path)]
        )
    assert {row["op"] for row in rows} == {"flatten", "unflatten", "accumulate_grad_shard"}
    assert {row["dtypes"] for row in rows} == {"fp32->bf16", "bf16->fp32", "fp32->fp32"}
    ours = [row for row in rows if row["impl"] in ("flashfsdp", "flashfsdp (plan)")]
    assert ours and all(row["path"].startswith("reference path (CPU tensors") for row in ours)
    assert {row["op"] for row in ours if row["impl"] == "flashfsdp (plan)"} == {"flatten", "unflatten"}
    assert all(row["time_ms"] > 0 and row["GB/s"] > 0 for row in rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels.csv", "kernels.md", "kernels.png"]
    with open(tmp_path / "kernels.csv") as file:
        written = list(csv.DictReader(file))
    assert len(written) == len(rows)
    for column in ("device", "torch", "triton", "date", "bytes", "time_ms", "GB/s", "%copy", "speedup"):
        assert column in written[0]


def test_llama_block_shapes():
    shapes = kernel_benchmark.llama_block_shapes(4096)
    assert shapes.count((4096, 4096)) == 4
    assert (11008, 4096) in shapes and (4096, 11008) in shapes  # 8*4096/3 = 10922.7 -> 11008
    assert shapes.count((4096,)) == 2
    sizes = kernel_benchmark.small_tensor_shapes()
    assert len(sizes) == 1000 and sizes == kernel_benchmark.small_tensor_shapes()
    assert all(64 <= s[0] <= 4096 and s[0] % 8 == 0 for s in sizes)


def test_benchmark_labels_the_triton_path(tmp_path):
    """Under the interpreter the rows say that the Triton kernels ran, and through what."""
    if dispatch.triton_device_type() != "cpu":
        import pytest  # noqa: PLC0415

        pytest.skip("needs the Triton interpreter (triton missing, or compiled for CUDA)")
    with dispatch.use_triton():
        rows = kernel_benchmark.main(["--device", "cpu", "--sizes", "16", "--no-small", "--repeats", "1",
                                      "--ops", "flatten", "--no-save"])
    ours = [row for row in rows if row["impl"] in ("flashfsdp", "flashfsdp (plan)")]
    assert len(ours) == 6 and all(row["path"] == "triton (interpreter)" for row in ours)
