"""flashfsdp.sim.contention: the rates recovered from overlap measurements, and bad input."""

from __future__ import annotations

import math

import pytest

from flashfsdp import sim
from tests.sim.common import LINK, W
from tests.sim.common import model as _model


def test_contention_rates_recovered_from_overlap_measurements():
    compute_rate, comm_rate = 0.6, 0.45
    samples = []
    for c, m in ((0.01, 0.05), (0.02, 0.06), (0.005, 0.03)):
        c_ov = c / compute_rate  # the kernel overlapped the collective throughout
        samples.append((c, c_ov, m, m - comm_rate * c_ov))
    assert sim.contention_rates(samples) == (pytest.approx(compute_rate), pytest.approx(comm_rate))
    fitted = sim.fit_contention(samples, [(c, c_ov, m, m - 0.2 * c_ov) for c, c_ov, m, _ in samples])
    assert fitted.rates("all_gather") == (pytest.approx(compute_rate), pytest.approx(comm_rate))
    assert fitted.rates("reduce_scatter") == (pytest.approx(compute_rate), pytest.approx(0.2))
    # noise above 1 is clipped: overlap never speeds anything up
    assert sim.contention_rates([(0.011, 0.01, 0.05, 0.03)])[0] == 1.0


def test_bad_contention():
    with pytest.raises(ValueError, match="compute_rate"):
        sim.Contention(0.0, 0.5)
    with pytest.raises(ValueError, match="comm_rate"):
        sim.Contention(0.5, 1.5)
    with pytest.raises(ValueError, match="reduce_scatter_comm_rate"):
        sim.Contention(0.5, 0.5, reduce_scatter_comm_rate=math.nan)
    with pytest.raises(ValueError, match="at least one"):
        sim.contention_rates([])
    with pytest.raises(ValueError, match="outlasts it"):
        sim.contention_rates([(0.01, 0.02, 0.005, 0.0)])
    with pytest.raises(ValueError, match="> 0 seconds"):
        sim.contention_rates([(-0.01, 0.02, 0.05, 0.01)])
    with pytest.raises(ValueError, match="contention must be"):
        sim.simulate(_model(), W, LINK, contention=(0.5, 0.5))
