"""The simulator's pipeline step (``flashfsdp.sim.pipeline``): the bubble on top of the slowest
stage's FSDP step, and the command line's errors."""

from __future__ import annotations

import pytest

from flashfsdp.sim.__main__ import main
from flashfsdp.sim.pipeline import simulate_pipeline


def test_step_is_the_slowest_stage_over_one_minus_the_bubble_plus_fill_and_drain():
    p = simulate_pipeline("8b", 64, pp=4, microbatches=8, seq_len=4096)
    assert p.bubble_fraction == pytest.approx(3 / 11)
    assert p.stage_s == max(r.step_s for r in p.ranks)
    assert p.step_s == pytest.approx(p.stage_s * 11 / 8 + p.p2p_s)
    interleaved = simulate_pipeline("8b", 64, pp=4, microbatches=8, seq_len=4096, schedule="interleaved1f1b")
    assert interleaved.step_s < p.step_s  # the smaller bubble, (pp-1)/(v*M+pp-1) = 3/19
    # four stages of 8 blocks compute a quarter of the model each: the stage step is well under pp = 1's
    whole = simulate_pipeline("8b", 16, pp=1, microbatches=8, seq_len=4096)
    assert whole.bubble_fraction == 0 and whole.p2p_s == 0
    assert p.stage_s < whole.stage_s / 2


def test_bad_sizes_exit_2_naming_the_flags(capsys):
    assert main(["--preset", "8b", "--world-size", "64", "--pp", "5", "--microbatches", "8"]) == 2
    err = capsys.readouterr().err
    assert "--pp" in err and "--world-size" in err
