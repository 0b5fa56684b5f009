"""flashfsdp.sim.model: the Llama builders, models from measurements, and bad units."""

from __future__ import annotations

import math

import pytest

from flashfsdp import sim


def test_llama_builders():
    m8, m70 = sim.llama3_8b(), sim.llama3_70b()
    assert len(m8.blocks) == 32 and len(m70.blocks) == 80
    assert m8.num_params() == pytest.approx(8.03e9, rel=0.01)
    assert m70.num_params() == pytest.approx(70.55e9, rel=0.01)
    block = m8.blocks[0]
    matmul = sim.LLAMA3_8B.block_params() - 2 * 4096
    assert block.forward_s + block.backward_s == pytest.approx(6 * matmul * 8192 / 400e12)
    assert block.backward_s == pytest.approx(2 * block.forward_s)
    assert block.param_bytes == 2 and block.reduce_bytes == 4
    faster = sim.llama3_8b(flops_per_s=800e12)
    assert faster.compute_s() == pytest.approx(m8.compute_s() / 2)
    assert sim.llama3_8b(seq_len=8192).compute_s() > m8.compute_s()


def test_model_from_measurements_uses_milliseconds():
    units = {"<root>": {"numel": 10, "forward_ms": 1.0, "backward_ms": 2.0},
             "layers.0": {"numel": 20, "forward_ms": 3.0, "backward_ms": 6.0, "param_bytes": 4}}
    model = sim.model_from_measurements(units, loss_s=0.001)
    assert model.root.forward_s == pytest.approx(1e-3) and model.blocks[0].backward_s == pytest.approx(6e-3)
    assert model.blocks[0].param_bytes == 4
    assert model.compute_s() == pytest.approx(0.013)


@pytest.mark.parametrize("field,value", [("numel", -1), ("forward_s", -0.1), ("backward_s", math.nan),
                                         ("param_bytes", -2)])
def test_bad_unit(field, value):
    kwargs = {"name": "u", "numel": 1, "forward_s": 0.0, "backward_s": 0.0, field: value}
    with pytest.raises(ValueError, match=field):
        sim.Unit(**kwargs)
