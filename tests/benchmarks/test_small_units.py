"""benchmarks.small_units: toy-size runs end to end (files, columns, systems and their order, the
collectives counted, the losses against FSDP2), where each count comes from, and the argument
checks. Nothing here asserts on speed."""

from __future__ import annotations

import csv
import types
import warnings

import pytest
import torch
import torch.distributed as dist

from benchmarks import small_units
from benchmarks.environment import environment_columns
from benchmarks.small_units import COLUMNS, KINDS, NOBUCKET, main, parse_args
from flashfsdp_dev.ranks import single_process_group

TOY = ["--layers", "2", "--dim", "16", "--batch", "4", "--steps", "1", "--warmup", "1", "--count-steps", "1",
       "--rounds", "1"]
IN_PROCESS = ["--cpu", "--world-size", "1", "--in-process", *TOY]


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_toy_run_writes_every_file_with_every_column(tmp_path):
    rows = main([*IN_PROCESS, "--out", str(tmp_path)])
    for suffix in ("csv", "md", "png"):
        assert (tmp_path / f"small_units_gated_w1.{suffix}").stat().st_size > 0, suffix
    assert (tmp_path / "small_units_gated_w1.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = _csv(tmp_path / "small_units_gated_w1.csv")
    assert list(table[0]) == COLUMNS + environment_columns()
    assert all(table[0][c] != "" for c in ("step_ms", "fwd_bwd_ms", "vs_fsdp2", "vs_ddp", "vs_unsharded",
                                           "unit_overhead_us", "collectives_per_step", "peak_mem_MiB"))
    with_bucket = [NOBUCKET] if small_units.bucket_bytes_supported() else []
    assert [r["system"] for r in table] == ["flashfsdp", *with_bucket, "fsdp2", "ddp", "unsharded"]
    by = {r["system"]: r for r in rows}
    for system, r in by.items():
        assert r["units"] == 2 * 4 + 1  # linear, gate, norm and the layer per layer, and the root
        assert r["step_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["peak_mem_MiB"] >= 0
        assert r["unit_overhead_us"] == pytest.approx((r["step_ms"] - by["unsharded"]["step_ms"]) * 1e3 / 9)
        for other in ("fsdp2", "ddp", "unsharded"):
            assert r[f"vs_{other}"] == pytest.approx(r["step_ms"] / by[other]["step_ms"])
        assert r["collectives_per_step"] == sum(r[f"{k}_per_step"] for k in KINDS)
        assert r["loss_max_diff_vs_fsdp2"] == 0.0, system  # W = 1: every system computes the same losses
        assert r["collectives_from"] == ("flight recorder" if system.startswith("flashfsdp") else "torch.distributed")
    assert by["ddp"]["all_reduce_per_step"] >= 1  # its bucket, through the counting hook
    assert by["unsharded"]["collectives_per_step"] == 0
    md = (tmp_path / "small_units_gated_w1.md").read_text()
    assert "| " + " | ".join(COLUMNS) in md
    for text in ("pytorch/pytorch#173680", "AdamW(foreach=True", "median of 1 steps", "1 interleaved rounds",
                 "unit_overhead_us = (step_ms - unsharded step_ms) / 9 units", "collectives_from",
                 "loss_max_diff_vs_fsdp2", "peak_mem_MiB"):
        assert text in md, text


def test_host_bound_shape_is_one_unit_per_block_with_sgd(tmp_path):
    rows = main([*IN_PROCESS, "--shape", "host-bound", "--systems", "flashfsdp", "fsdp2", "unsharded",
                 "--out", str(tmp_path)])
    assert [r["system"] for r in rows] == ["flashfsdp", "fsdp2", "unsharded"]
    assert all(r["units"] == 3 for r in rows)  # 2 blocks and the root
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"small_units_host_bound_w1.{s}" for s in ("csv", "md", "png")]
    assert rows[0]["vs_ddp"] != rows[0]["vs_ddp"]  # no ddp row: NaN
    md = (tmp_path / "small_units_host_bound_w1.md").read_text()
    assert "torch.optim.SGD" in md and "every block, then the root: 3 units" in md


def test_two_ranks_count_collectives_and_match_fsdp2_losses(tmp_path):
    rows = main(["--cpu", *TOY, "--systems", "flashfsdp", "fsdp2", "ddp", "--out", str(tmp_path)])
    assert (tmp_path / "small_units_gated_w2.csv").is_file()
    by = {r["system"]: r for r in rows}
    assert by["fsdp2"]["all_gather_per_step"] > 0 and by["fsdp2"]["reduce_scatter_per_step"] > 0
    assert by["ddp"]["all_reduce_per_step"] > 0 and by["ddp"]["collectives_per_step"] > 0
    assert by["flashfsdp"]["collectives_from"] == "flight recorder"
    assert by["flashfsdp"]["all_gather_per_step"] > 0 and by["flashfsdp"]["reduce_scatter_per_step"] > 0
    assert by["flashfsdp"]["loss_max_diff_vs_fsdp2"] == 0.0  # bit-equal at W = 2 in fp32
    assert all(r["world_size"] == 2 for r in rows)


def test_flashfsdp_collectives_are_read_from_its_flight_recorder(tmp_path, monkeypatch):
    from flashfsdp.runtime import flight

    fake = [types.SimpleNamespace(seq=i + 1, kind=k)
            for i, k in enumerate(["all_gather", "all_gather", "reduce_scatter", "control", "broadcast"])]
    monkeypatch.setattr(flight, "entries", lambda: fake)
    rows = main([*IN_PROCESS, "--systems", "flashfsdp", "--out", str(tmp_path)])
    assert {k: rows[0][f"{k}_per_step"] for k in KINDS} == {"all_gather": 2, "reduce_scatter": 1, "all_reduce": 0,
                                                            "other": 2}
    assert rows[0]["collectives_per_step"] == 5


def test_a_ring_that_lost_entries_is_refused():
    assert small_units.flight_counts([]) == {}
    with pytest.raises(RuntimeError, match="the ring lost 4 entries"):
        small_units.flight_counts([types.SimpleNamespace(seq=5, kind="all_gather")])


def test_torch_collectives_are_counted_by_kind_and_put_back():
    original = dist.all_reduce
    with single_process_group():
        x = torch.ones(4)
        with small_units.counting_torch_collectives() as counts, warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # the *_tensor names are deprecated for *_single
            dist.all_reduce(x)
            dist.all_gather_single(torch.empty(4), x)
            dist.all_gather_into_tensor(torch.empty(4), x)  # calls all_gather_single: still one call
            dist.reduce_scatter_tensor(torch.empty(4), x)
            dist.all_reduce(x)
        dist.all_reduce(x)  # after the block: not counted
    assert counts == {"all_reduce": 2, "all_gather": 2, "reduce_scatter": 1}
    assert dist.all_reduce is original


def test_bucket_bytes_reach_the_flashfsdp_root(tmp_path, monkeypatch):
    """--bucket-bytes N: root.set_bucket_bytes(N) on flashfsdp; flashfsdp-nobucket: (0); the method
    stood in by a recorder, so the test holds whether or not flashfsdp has bucketing."""
    import flashfsdp

    calls = []
    monkeypatch.setattr(flashfsdp.FSDPModule, "set_bucket_bytes", lambda self, n: calls.append((type(self), n)),
                        raising=False)
    main([*IN_PROCESS, "--systems", "flashfsdp", NOBUCKET, "fsdp2", "--bucket-bytes", "12345",
          "--out", str(tmp_path)])
    assert [n for _, n in calls] == [12345, 0]
    assert all(cls.__name__ == "FSDPSmallUnitsModel" for cls, _ in calls)  # the root, once per run
    assert "root.set_bucket_bytes(12345)" in (tmp_path / "small_units_gated_w1.md").read_text()


def test_defaults_follow_the_shape():
    gated = parse_args([], cuda_available=False)
    assert (gated.world_size, gated.layers, gated.dim, gated.batch, gated.threads) == (2, 24, 128, 32, 1)
    host = parse_args(["--shape", "host-bound"], cuda_available=False)
    assert (host.world_size, host.layers, host.dim, host.optimizer) == (1, 48, 32, "SGD(lr=1e-2)")
    assert parse_args(["--shape", "host-bound", "--layers", "8"], cuda_available=False).layers == 8


def test_without_bucketing_the_nobucket_system_is_not_a_default(monkeypatch):
    monkeypatch.setattr(small_units, "bucket_bytes_supported", lambda: False)
    assert parse_args([], cuda_available=False).systems == ["flashfsdp", "fsdp2", "ddp", "unsharded"]
    monkeypatch.setattr(small_units, "bucket_bytes_supported", lambda: True)
    assert parse_args([], cuda_available=False).systems == ["flashfsdp", NOBUCKET, "fsdp2", "ddp", "unsharded"]


@pytest.mark.parametrize("argv, supported, message", [
    (["--world-size", "0"], True, "--world-size must be >= 1, got 0"),
    (["--world-size", "2", "--in-process"], True, "--in-process runs one rank: it needs --world-size 1, got 2"),
    (["--layers", "0"], True, "--layers must be >= 1, got 0"),
    (["--count-steps", "0"], True, "--count-steps must be >= 1, got 0"),
    (["--systems", "fsdp2", "fsdp2"], True, "--systems names a system twice"),
    (["--bucket-bytes", "1024"], False, "--bucket-bytes: this flashfsdp has no FSDPModule.set_bucket_bytes"),
    (["--systems", NOBUCKET], False, f"--systems {NOBUCKET}: this flashfsdp has no FSDPModule.set_bucket_bytes"),
    (["--bucket-bytes", "-1"], True, "--bucket-bytes must be >= 0, got -1"),
    (["--bucket-bytes", "1024", "--systems", "fsdp2"], True, "--systems does not name flashfsdp"),
])
def test_bad_arguments_are_refused_naming_the_argument(argv, supported, message, monkeypatch, capsys):
    monkeypatch.setattr(small_units, "bucket_bytes_supported", lambda: supported)
    with pytest.raises(SystemExit):
        parse_args(argv, cuda_available=False)
    assert message in capsys.readouterr().err
