"""flashfsdp.estimate at world sizes far beyond any machine: no work proportional to W.

Beyond the largest parameter's rows every rank holds at most one row of each parameter, so the
sharded states per rank (master, gradient and optimizer shards) no longer change with W: W = 10**9
and W = 10**12 give the same figures, for every sharding; the gathered buffers (W chunks, most of
them padding) grow with W. (An O(W) loop over ranks would never return here; the suite's timeout
ends it.)
"""

from __future__ import annotations

import pytest

from flashfsdp.estimate import estimate
from flashfsdp.models import LlamaConfig

CONFIG = LlamaConfig(dim=64, n_layers=2, n_heads=2, vocab_size=256)


@pytest.mark.parametrize("kwargs", [{}, {"sharding": "grad_op"}, {"sharding": "hybrid", "shard_group_size": 8},
                                    {"reshard_after_forward": 8}])
def test_per_rank_figures_stop_changing_with_w(kwargs):
    big, huge = estimate(CONFIG, 10**9, **kwargs), estimate(CONFIG, 10**12, **kwargs)
    for field in ("master_bytes", "grad_bytes", "optimizer_bytes"):
        assert getattr(big, field) == getattr(huge, field), field
    assert huge.world_size == 10**12 and huge.total_bytes >= big.total_bytes
