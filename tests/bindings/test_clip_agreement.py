"""Global clipping with parameters outside any unit: one norm on every rank, or the same refusal.

At W = 2 (``tests/bindings/disagreement_cases.py``): ``flashfsdp.clip_grad_norm_`` and
``flashfsdp.optim.AdamW(max_grad_norm=...)`` over a model whose ``ignored_params`` keep rank-local
gradients raise the same ValueError on both ranks (each rank would otherwise scale its shards of
the same parameters by its own factor); once those gradients are equal, both ranks get one norm.
"""

from __future__ import annotations

import pytest

from tests.bindings import disagreement_cases as cases
from tests.harness import run_distributed


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    store_dir = str(tmp_path_factory.mktemp("clip"))
    by_rank = run_distributed(cases.run_cases, 2, list(cases.CLIP_CASES), store_dir, timeout=240)
    return [{name: result for name, (result, _) in mine.items()} for mine in by_rank]


@pytest.mark.parametrize("case", ["clip_ignored_params_differ", "optimizer_max_grad_norm_mixed"])
def test_rank_local_gradients_in_a_global_clip_are_refused_on_both_ranks(outcomes, case):
    results = [by_rank[case] for by_rank in outcomes]
    assert results[0] == results[1], results
    kind, raised, message = results[0]
    assert (kind, raised) == ("error", "ValueError"), results
    for fragment in ("2 parameter(s) outside any fully_shard unit", "differ across ranks", "no gradient was clipped"):
        assert fragment in message, message


def test_equal_ignored_gradients_give_one_norm_on_both_ranks(outcomes):
    norms = [by_rank["clip_ignored_params_equal"] for by_rank in outcomes]
    assert norms[0][0] == "ok" and norms[0] == norms[1], norms
