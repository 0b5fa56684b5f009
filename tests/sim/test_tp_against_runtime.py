"""The simulator's bytes per step and rank at (dp, tp) = (2, 2) against a real run of the project's
Llama with its TP plan on 4 gloo ranks (``tests/tp_run.py``): the FSDP all-gathers' and
reduce-scatters' buffers over the data-parallel link and the TP all-gathers, reduce-scatters and
all-reduces over the TP link, fp32, the second step of each."""

from __future__ import annotations

from flashfsdp import sim
from tests.harness import run_distributed
from tests.tp_run import CONFIG, ROWS, measure_2x2


def test_bytes_per_link_match_a_2x2_dp_tp_run():
    model = sim.llama_tp_model(CONFIG, 4, 2, tokens=ROWS * CONFIG.max_seq_len, param_dtype=None, reduce_dtype=None)
    predicted = sim.simulate(model, 4, sim.LINKS["ib400"], tp_link="nvlink").collective_bytes
    assert predicted["tp_all_gather"] > 0 and predicted["reduce_scatter"] > 0
    for rank in run_distributed(measure_2x2, 4):
        seen = rank["collectives"]
        assert set(seen) == {("fsdp", "all_gather"), ("fsdp", "reduce_scatter"), ("tp", "all_gather"),
                             ("tp", "reduce_scatter"), ("tp", "all_reduce")}, seen
        assert seen[("fsdp", "all_gather")] == predicted["all_gather"]
        assert seen[("fsdp", "reduce_scatter")] == predicted["reduce_scatter"]  # gloo: an all-to-all of the input
        assert predicted["all_reduce"] == 0  # no HSDP
        for kind in ("all_gather", "reduce_scatter", "all_reduce"):
            assert seen[("tp", kind)] == predicted[f"tp_{kind}"], kind
