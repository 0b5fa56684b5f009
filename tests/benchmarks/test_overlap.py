"""benchmarks.overlap: a toy-size run end to end (files, columns, the null model and the scores
beside every prediction), and its argument checks."""

from __future__ import annotations

import csv

import pytest

from benchmarks.overlap import (
    EXPOSED_COLUMNS, NONCOMPUTE_COLUMNS, SCHEDULES, STEP_COLUMNS, TARGET_PCT, VERDICT_COLUMNS,
)
from benchmarks.overlap.__main__ import main, parse_args


def _csv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_toy_run_writes_every_file_with_every_column(tmp_path):
    result = main(["--quick", "--steps", "1", "--out", str(tmp_path)])
    for name in ("overlap_validation.csv", "overlap_validation.md", "overlap_validation.png",
                 "overlap.csv", "overlap.md", "overlap.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    for png in ("overlap_validation.png", "overlap.png"):
        assert (tmp_path / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    table = _csv(tmp_path / "overlap_validation.csv")
    for column in dict.fromkeys(STEP_COLUMNS + NONCOMPUTE_COLUMNS + EXPOSED_COLUMNS):
        assert column in table[0], column
    rows = result["validation"]
    assert [(r["config"], r["schedule"]) for r in rows] == [
        (c, s) for c in ("compute-bound", "comm-heavy") for s in SCHEDULES]
    for r in rows:
        step = r["measured_step_ms"]
        assert step > 0 and r["null_ms"] > 0 and r["measured_exposed_ms"] >= 0
        # every predictor next to the null model, each with its error against the same measured step
        assert r["null_err_pct"] == pytest.approx((r["null_ms"] / step - 1) * 100)
        assert r["sim_err_pct"] == pytest.approx((r["sim_ms"] / step - 1) * 100)
        assert r["traced_sim_err_pct"] == pytest.approx((r["traced_sim_ms"] / step - 1) * 100)
        # the simulator adds communication to the same compute: never below its null model (the
        # slower rank's compute: coupled ranks leave the step together)
        assert r["sim_ms"] >= r["null_ms"] - 1e-9 and r["traced_sim_ms"] >= r["traced_null_ms"] - 1e-9
        # what it predicts: the non-compute part and exposed communication, measured vs predicted
        assert r["measured_noncompute_ms"] == pytest.approx(step - r["null_ms"])
        assert r["sim_noncompute_ms"] == pytest.approx(r["sim_ms"] - r["null_ms"])
        assert r["sim_exposed_ms"] >= 0 and r["traced_sim_exposed_ms"] >= 0
        if r["host_ms"] == r["host_ms"]:  # contention measured (NaN otherwise)
            assert r["host_ms"] >= r["sim_ms"] - 1e-9
            assert 0 < r["compute_rate"] <= 1 and 0 < r["comm_rate"] <= 1
    md = (tmp_path / "overlap_validation.md").read_text()
    for columns in (STEP_COLUMNS, VERDICT_COLUMNS, NONCOMPUTE_COLUMNS, EXPOSED_COLUMNS):
        assert "| " + " | ".join(columns) in md
    assert f"## Verdict: step within {TARGET_PCT:.0f}%, and against the null model" in md
    assert "Host contention" in md and "measured *without communication*" in md
    # the verdict table agrees with the rows: one line per configuration and predictor; sim+host only
    # where that configuration's contention was measurable (a busy machine can leave it unmeasured)
    verdicts = [line for line in md.splitlines() if line.startswith("| compute-bound | sim") or
                line.startswith("| comm-heavy | sim")]
    host_measured = {r["config"] for r in rows if r["host_ms"] == r["host_ms"]}
    assert len(verdicts) == 2 * 2 + len(host_measured)
    for config in ("compute-bound", "comm-heavy"):
        assert (f"| {config} | sim+host |" in md) == (config in host_measured), config
    default = next(r for r in rows if r["config"] == "comm-heavy" and r["schedule"] == "fwd+bwd (default)")
    assert default["null_ms"] < default["sim_ms"]

    sweep = _csv(tmp_path / "overlap.csv")
    assert {int(r["world_size"]) for r in sweep} == {8, 64, 512, 4096}
    assert {r["model"] for r in sweep} == {"Llama-8B", "Llama-70B"}
    for column in ("link", "setting", "step_ms", "compute_ms", "exposed_ms", "efficiency", "peak_GiB"):
        assert column in sweep[0], column


def test_defaults():
    args = parse_args([])
    assert (args.steps, args.warmup, args.out, args.quick) == (12, 3, None, False)
    assert args.configs == ["compute-bound", "comm-heavy"]
    quick = parse_args(["--quick"])
    assert (quick.steps, quick.warmup) == (2, 1)


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--warmup", "-1"], "--warmup must be >= 1, got -1"),
    (["--tokens", "0"], "--tokens must be >= 1, got 0"),
    (["--flops", "0"], "--flops must be a positive FLOP/s, got 0.0"),
    (["--configs", "huge"], "invalid choice: 'huge'"),
])
def test_bad_arguments_are_refused_with_the_reason(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
