"""The estimate at a (dp, tp) layout: states divided by dp·tp for split weights and by dp for the
replicated norms, FSDP collectives over the dp ranks, the TP plan's activation collectives; checked
against flashfsdp at a 2x2 (dp, tp) layout on CPU gloo ranks (collectives counted as they are
dispatched: DTensor's functional collectives are the TP ones, c10d's the FSDP ones, the
reduce-scatters' inputs included; optimizer state of the busiest rank); bad input named;
shard_placement_fn lays out along its dim."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Shard

from flashfsdp.estimate import estimate
from flashfsdp.models import Llama, LlamaConfig
from tests.harness import run_distributed
from tests.tp_run import CONFIG, ROWS, measure_2x2


def test_split_weights_are_divided_by_dp_tp_and_norms_by_dp():
    one_d, two_d = estimate(CONFIG, 4), estimate(CONFIG, 4, tp=2)
    assert two_d.tp == 2 and two_d.shard_group_size == 2 and two_d.replicas == 1 and one_d.tp_comm is None
    norms = (2 * CONFIG.n_layers + 1) * CONFIG.dim
    split = CONFIG.num_params() - norms
    # AdamW's two fp32 moments of the busiest rank's pieces (each divides evenly here) + a step each
    scalars = 4 * len(list(Llama(CONFIG).parameters()))
    assert two_d.optimizer_bytes - scalars == 2 * 4 * (split // 4 + norms // 2)
    assert one_d.optimizer_bytes - scalars == 2 * 4 * CONFIG.num_params() // 4
    assert two_d.comm.all_gather_forward < estimate(CONFIG, 2).comm.all_gather_forward


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=3), "tp=3 must divide world_size=4"),
    (dict(tp=0), "tp must be an integer >= 1"),
    (dict(tp=4), "tp 4 does not divide the model's n_kv_heads"),
])
def test_bad_tp_is_named(kwargs, message):
    config = LlamaConfig(**{**CONFIG.__dict__, "n_kv_heads": 2})
    with pytest.raises(ValueError, match=message):
        estimate(config, 4, **kwargs)
    with pytest.raises(ValueError, match="tp=2 needs a flashfsdp Llama"):
        estimate(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2, tp=2)


def test_shard_placement_fn_lays_out_along_its_dim():
    model = torch.nn.Sequential(torch.nn.Linear(16, 3, bias=False))  # weight (3, 16)
    along_0 = estimate(model, 4)
    along_1 = estimate(model, 4, shard_placement_fn=lambda p: Shard(1))
    assert along_0.master_bytes == 4 * 16  # ceil(3 / 4) = 1 row of 16 per rank
    assert along_1.master_bytes == 4 * 12  # 4 columns of 3 per rank


def test_estimate_matches_a_2x2_dp_tp_run():
    results = run_distributed(measure_2x2, 4)
    est = estimate(CONFIG, 4, tp=2, tokens=ROWS * CONFIG.max_seq_len)
    assert max(r["optimizer"] for r in results) == est.optimizer_bytes
    for r in results:
        seen = r["collectives"]
        assert seen[("tp", "all_gather")] == est.tp_comm.all_gather
        assert seen[("tp", "reduce_scatter")] == est.tp_comm.reduce_scatter
        assert seen.get(("tp", "all_reduce"), 0) == est.tp_comm.all_reduce, seen
        assert seen[("fsdp", "all_gather")] == est.comm.all_gather_forward + est.comm.all_gather_backward, seen
        # gloo runs a reduce-scatter as an all-to-all of its input (tests/tp_run.py): shards and flags
        assert seen[("fsdp", "reduce_scatter")] == est.comm.reduce_scatter, seen
