"""The suite's runner: a case failing on one rank does not take the others with it."""

import torch

from tests.fsdp2_suite.runner import run_cases


def test_failure_is_isolated_and_later_cases_run():
    jobs = [("passes", "torch"), ("fails_on_rank_1", "flashfsdp"), ("passes_after_failure", "flashfsdp")]
    out = run_cases("tests.fsdp2_suite.probe_cases", jobs, 2)
    assert [r["sum"].item() for r in out[jobs[0]]["results"]] == [3.0, 3.0]
    assert [r["impl"] for r in out[jobs[0]]["results"]] == ["torch", "torch"]
    assert "rank 1 fails here" in out[jobs[1]]["error"] and "--- rank 1 ---" in out[jobs[1]]["error"]
    assert [r["max"] for r in out[jobs[2]]["results"]] == [torch.ones(1), torch.ones(1)]
