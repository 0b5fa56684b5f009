"""benchmarks.step: a toy-size run end to end (files, columns, notes), its device-dependent
defaults and argument checks, and the in-process runner's guard (the peak-memory meter it uses is
tested in tests/runtime/test_memory.py)."""

from __future__ import annotations

import csv
import math

import pytest

from benchmarks.environment import environment_columns
from benchmarks.step import COLUMNS, SYSTEMS, main, parse_args
from flashfsdp_dev.ranks import run_ranks

TOY = ["--dim", "32", "--layers", "2", "--heads", "2", "--seq", "16", "--batch", "2", "--steps", "1",
       "--warmup", "1", "--profile-steps", "1", "--rounds", "1"]


def test_toy_run_writes_every_file_with_every_column(tmp_path):
    rows = main(["--cpu", "--world-size", "1", "--in-process", "--out", str(tmp_path), *TOY])
    for name in ("step_w1.csv", "step_w1.md", "step_w1.png", "step_w1_timeline.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    for png in ("step_w1.png", "step_w1_timeline.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with open(tmp_path / "step_w1.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == COLUMNS + environment_columns()
    assert [r["system"] for r in table] == list(SYSTEMS)
    by = {r["system"]: r for r in rows}
    assert by["unsharded"]["overhead_ms"] == 0.0
    for system, r in by.items():
        assert r["step_ms"] > 0 and r["peak_mem_MiB"] >= 0
        assert r["overhead_ms"] == pytest.approx(r["step_ms"] - by["unsharded"]["step_ms"])
        traced = not math.isnan(r["traced_comm_ms"]) and not math.isnan(r["traced_exposed_ms"])
        assert traced == (system == "flashfsdp"), system
    assert 0 <= by["flashfsdp"]["traced_exposed_ms"] <= by["flashfsdp"]["traced_comm_ms"]
    md = (tmp_path / "step_w1.md").read_text()
    assert "| " + " | ".join(COLUMNS) in md
    assert "every system holds, computes and reduces in fp32" in md
    assert "from after the model is sharded/wrapped" in md and "overhead_ms = step_ms - unsharded step_ms" in md


def test_host_bound_case_compares_three_systems_per_unit(tmp_path):
    rows = main(["--cpu", "--host-bound", "--in-process", "--out", str(tmp_path), *TOY])
    assert [r["system"] for r in rows] == ["unsharded", "flashfsdp", "fsdp2"]
    for name in ("step_host_bound_w1.csv", "step_host_bound_w1.md", "step_host_bound_w1.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    assert not (tmp_path / "step_w1.csv").exists()
    for r in rows:  # 2 blocks + the root: 3 units
        assert r["unit_overhead_us"] == pytest.approx(r["overhead_ms"] * 1e3 / 3)
    assert "unit_overhead_us = overhead_ms / 3 units" in (tmp_path / "step_host_bound_w1.md").read_text()


def test_host_bound_defaults_are_48_tiny_blocks_on_one_rank():
    args = parse_args(["--host-bound"], cuda_available=False)
    assert (args.world_size, args.layers, args.dim, args.seq, args.profile_steps) == (1, 48, 32, 16, 0)
    assert args.systems == ["unsharded", "flashfsdp", "fsdp2"]
    assert parse_args(["--host-bound", "--layers", "8"], cuda_available=False).layers == 8
    plain = parse_args([], cuda_available=False)
    assert (plain.profile_steps, plain.systems) == (3, list(SYSTEMS))


def test_defaults_follow_the_device_that_runs():
    cpu = parse_args(["--cpu"], cuda_available=True)
    assert (cpu.device, cpu.world_size, cpu.dim, cpu.seq, cpu.param_dtype) == ("cpu", 2, 384, 128, "fp32")
    gpu = parse_args([], cuda_available=True)
    assert (gpu.device, gpu.dim, gpu.layers, gpu.seq, gpu.param_dtype) == ("cuda", 2048, 18, 2048, "bf16")
    assert gpu.world_size >= 1
    assert parse_args(["--dim", "64"], cuda_available=False).dim == 64
    assert parse_args([], cuda_available=False).device == "cpu"


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "0"], "--world-size must be >= 1"),
    (["--world-size", "2", "--in-process"], "--in-process runs one rank: it needs --world-size 1, got 2"),
    (["--dim", "0"], "--dim must be >= 1, got 0"),
])
def test_bad_arguments_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv, cuda_available=False)
    assert message in capsys.readouterr().err


def test_in_process_ranks_need_a_one_rank_group():
    with pytest.raises(ValueError, match="in_process needs world_size 1 inside single_process_group"):
        run_ranks(print, 1, in_process=True)



def test_int8_all_gathers_are_measured(tmp_path):
    """--systems flashfsdp flashfsdp-int8: both traced, int8 all-gathers about a quarter of fp32's bytes."""
    rows = main(["--cpu", "--world-size", "1", "--in-process", "--out", str(tmp_path), *TOY,
                 "--systems", "flashfsdp", "flashfsdp-int8"])
    by = {r["system"]: r for r in rows}
    assert by["flashfsdp"]["all_gather_MB"] > 0
    assert by["flashfsdp-int8"]["all_gather_MB"] == pytest.approx(by["flashfsdp"]["all_gather_MB"] * 0.254, rel=0.05)
    assert not math.isnan(by["flashfsdp-int8"]["traced_comm_ms"])
