"""Smoke test of ``python -m benchmarks.kernels --host-only`` at a toy size: it runs and writes its files."""

import csv

from benchmarks import kernels as kernel_benchmark


def test_host_only_runs_and_writes_results(tmp_path):
    rows = kernel_benchmark.main(["--device", "cpu", "--host-only", "--sizes", "64", "--no-small", "--calls", "2",
                                  "--repeats", "1", "--out", str(tmp_path)])
    assert [(row["op"], row["impl"]) for row in rows] == [
        ("flatten", "op: validation + table"), ("flatten", "plan: check"),
        ("unflatten", "op: validation + table"), ("unflatten", "plan: check")]
    assert all(row["us_per_call"] > 0 and row["tensors"] == 9 for row in rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["kernels_host.csv", "kernels_host.md"]
    with open(tmp_path / "kernels_host.csv") as file:
        assert len(list(csv.DictReader(file))) == len(rows)
