"""benchmarks.distributed: the spawner shared with tests.harness reports a failing rank's traceback."""

from __future__ import annotations

import pytest

from tests.harness import run_distributed


def _fails_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError(f"rank {rank} of {world_size} fails")
    return rank


def test_a_failing_rank_fails_the_call_with_its_traceback():
    with pytest.raises(AssertionError, match=r"(?s)--- rank 1 ---.*ValueError: rank 1 of 2 fails"):
        run_distributed(_fails_on_rank_1, 2, timeout=120)
