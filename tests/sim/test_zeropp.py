"""sim.zeropp: ZeRO++'s qgZ (hierarchical quantised reduction), hpZ and qwZ across nodes."""

from __future__ import annotations

import pytest

from flashfsdp import sim
from flashfsdp.kernels.quantize import packed_nbytes
from flashfsdp.sim.zeropp import (
    ZeroPPLink,
    all_to_all_s,
    compare_zeropp,
    format_table,
    qgz_bytes_per_value,
    qgz_reduce,
    zeropp_model,
)
from tests.sim.common import model

INTRA = sim.Link("intra", alpha_s=1e-6, bandwidth=100e9)
INTER = sim.Link("inter", alpha_s=10e-6, bandwidth=10e9)


def test_all_to_all_against_hand_computed_values():
    # 4 ranks, 8 MB each: 3 steps of 2 MB at 1 GB/s + 3 latencies of 5 µs
    assert all_to_all_s(8e6, 4, 5e-6, 1e9) == pytest.approx(6e-3 + 15e-6)
    assert all_to_all_s(1e9, 2, 0.0, 1e9) == pytest.approx(0.5)
    assert all_to_all_s(1e9, 1, 1e-3, 1e9) == 0.0 and all_to_all_s(0, 8, 1e-3, 1e9) == 0.0
    with pytest.raises(ValueError, match="nbytes"):
        all_to_all_s(-1, 4, 0.0, 1e9)
    with pytest.raises(ValueError, match="bandwidth"):
        all_to_all_s(1, 4, 0.0, 0)


def test_bytes_per_value_match_the_packed_kernel_layout():
    assert qgz_bytes_per_value(4) == 0.5 + 4 / 256 and qgz_bytes_per_value(8) == 1 + 4 / 256
    for bits in (4, 8):
        assert packed_nbytes(256 * 64, bits=bits) == 256 * 64 * qgz_bytes_per_value(bits)


def test_int4_inter_node_bytes():
    p, w, local = 8 * 256 * 1000, 64, 8
    cost = qgz_reduce(p, w, local, INTRA, INTER, bits=4, mem_bandwidth=None)
    n = w // local
    assert cost.inter_bytes == pytest.approx((n - 1) / n * (1 / local) * p * (0.5 + 4 / 256))
    assert cost.intra_bytes == pytest.approx((local - 1) / local * p * (0.5 + 4 / 256))
    assert cost.inter_s == pytest.approx(cost.inter_bytes / 10e9 + (n - 1) * 10e-6)
    assert cost.intra_s == pytest.approx(cost.intra_bytes / 100e9 + (local - 1) * 1e-6)
    assert cost.dequant_s == 0.0 and cost.total_s == pytest.approx(cost.intra_s + cost.inter_s)
    int8 = qgz_reduce(p, w, local, INTRA, INTER, bits=8, mem_bandwidth=None)
    assert int8.inter_bytes / cost.inter_bytes == pytest.approx((1 + 4 / 256) / (0.5 + 4 / 256))


def test_identity_bytes_on_one_node_is_an_intra_only_reduce_scatter():
    p = 1 << 20
    cost = qgz_reduce(p, 8, 8, INTRA, INTER, wire_bytes=2, mem_bandwidth=None)
    assert cost.inter_bytes == 0 and cost.inter_s == 0
    assert cost.total_s == pytest.approx(INTRA.reduce_scatter_s(2 * p, 8))
    # the dequantisation passes: (P·q + P·q/L) + (P·q/L + P/W·4) bytes at 1e9 B/s
    charged = qgz_reduce(p, 8, 8, INTRA, INTER, wire_bytes=2, mem_bandwidth=1e9)
    assert charged.dequant_s == pytest.approx((2 * p + 2 * (2 * p / 8) + p / 8 * 4) / 1e9)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="does not divide world_size"):
        qgz_reduce(1024, 12, 8, INTRA, INTER)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        qgz_reduce(1024, 16, 8, INTRA, INTER, bits=2)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        ZeroPPLink.build(INTER, INTRA, qgz_bits=16)
    with pytest.raises(ValueError, match="local_size"):
        ZeroPPLink.build(INTER, INTRA, local_size=0)
    with pytest.raises(ValueError, match="does not divide world_size"):
        compare_zeropp([model()], [INTER], [12], intra=INTRA)
    with pytest.raises(ValueError, match="mem_bandwidth"):
        qgz_reduce(1024, 16, 8, INTRA, INTER, mem_bandwidth=-1)


def test_link_prices_hpz_backward_gathers_and_qgz_reductions():
    plain = ZeroPPLink.build(INTER, INTRA, local_size=4)
    assert plain.reduce_scatter_s(4e6, 16) == INTER.reduce_scatter_s(4e6, 16)
    assert plain.unit_all_gather_s(1e6, 2e6, 16, "backward") == INTER.all_gather_s(1e6, 16)
    zpp = ZeroPPLink.build(INTER, INTRA, local_size=4, qgz_bits=4, hpz=True, mem_bandwidth=None)
    assert zpp.unit_all_gather_s(1e6, 2e6, 16, "forward") == INTER.all_gather_s(1e6, 16)
    assert zpp.unit_all_gather_s(1e6, 2e6, 16, "backward") == INTRA.all_gather_s(2e6, 4)
    assert zpp.reduce_scatter_s(4e6, 16) == pytest.approx(qgz_reduce(1e6, 16, 4, INTRA, INTER, mem_bandwidth=None).total_s)
    assert zpp.latency_s(16, "reduce_scatter") == pytest.approx(3 * 1e-6 + 3 * 10e-6)


def test_model_passes_are_charged_where_they_run():
    plain = model()
    z = zeropp_model(plain, qwz=True, qgz_bits=4, mem_bandwidth=1e9)
    for a, b in zip(plain.units, z.units):
        assert b.all_gather_bytes == 1 + 4 / 256
        assert b.forward_s == pytest.approx(a.forward_s + a.numel * (1 + a.param_bytes) / 1e9)
        assert b.backward_s == pytest.approx(a.backward_s + a.numel * (a.param_bytes + 0.5 + 4 / 256) / 1e9)
    assert zeropp_model(plain).units == plain.units


def test_table_rows_in_order_and_qgz_faster_on_slow_ethernet():
    rows = compare_zeropp([sim.llama3_8b()], ["eth100"], [512])
    assert [r["config"] for r in rows] == ["bf16 FSDP", "+qgZ int8", "+qgZ int4", "qwZ+hpZ+qgZ int4"]
    step = [r["step_ms"] for r in rows]
    assert step[0] > step[1] >= step[2] > step[3]
    assert rows[0]["rs_ms"] > 10 * rows[2]["rs_ms"]
    assert rows[0]["speedup"] == 1.0 and rows[3]["speedup"] > 2
    table = format_table(rows)
    assert table.count("\n") == 5 and "qwZ+hpZ+qgZ int4" in table
