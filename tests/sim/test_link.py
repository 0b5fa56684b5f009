"""flashfsdp.sim.link: the ring α–β cost, its fit, the named links and bad input."""

from __future__ import annotations

import pytest

from flashfsdp import sim
from tests.sim.common import LINK, MB, W
from tests.sim.common import model as _model


def test_ring_cost_formula():
    nbytes, alpha, beta = 3 * MB, 7e-6, 25e9
    for world_size in (2, 8, 4096):
        expected = (world_size - 1) / world_size * nbytes / beta + (world_size - 1) * alpha
        assert sim.ring_collective_s(nbytes, world_size, alpha, beta) == pytest.approx(expected)
        link = sim.Link("l", alpha, beta)
        assert link.all_gather_s(nbytes, world_size) == pytest.approx(expected)
        assert link.reduce_scatter_s(nbytes, world_size) == pytest.approx(expected)
    assert sim.ring_collective_s(nbytes, 1, alpha, beta) == 0.0
    assert sim.ring_collective_s(0, 8, alpha, beta) == 0.0


def test_fit_recovers_alpha_and_beta():
    alpha, beta = 50e-6, 2e9
    samples = [(n, 2, sim.ring_collective_s(n, 2, alpha, beta)) for n in (2**16, 2**20, 2**24)]
    fit_alpha, fit_beta = sim.fit_alpha_beta(samples)
    assert fit_alpha == pytest.approx(alpha, rel=1e-9)
    assert fit_beta == pytest.approx(beta, rel=1e-9)
    link = sim.fit_link("fitted", samples, [(n, w, 2 * t) for n, w, t in samples])
    assert link.rs_alpha_s == pytest.approx(2 * alpha) and link.rs_bandwidth == pytest.approx(beta / 2)


def test_named_links():
    assert set(sim.LINKS) == {"nvlink", "ib400", "eth100"}
    assert sim.get_link("ib400").bandwidth == 50e9
    assert sim.get_link(LINK) is LINK


@pytest.mark.parametrize("world_size", [0, -1, 2.0, True])
def test_bad_world_size(world_size):
    with pytest.raises(ValueError, match="world_size"):
        sim.simulate(_model(), world_size, LINK)
    with pytest.raises(ValueError, match="world_size"):
        sim.ring_collective_s(MB, world_size, 1e-6, 1e9)


def test_bad_link_and_sizes():
    with pytest.raises(ValueError, match="unknown link 'infiniband'.*nvlink"):
        sim.simulate(_model(), W, "infiniband")
    with pytest.raises(ValueError, match="nbytes"):
        sim.ring_collective_s(-1, 2, 1e-6, 1e9)
    with pytest.raises(ValueError, match="bandwidth"):
        sim.Link("x", 1e-6, 0)
    with pytest.raises(ValueError, match="alpha_s"):
        sim.Link("x", -1e-6, 1e9)
