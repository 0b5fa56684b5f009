"""flashfsdp.checkpoint at W = 2 with arguments that differ by rank: rank 0 saving into one
directory and rank 1 into another (or another step, optimizer, extra; a load of two different
checkpoints) is the same ValueError on both ranks, naming the argument and each rank's value,
before anything is written: the complete checkpoint already at rank 0's path stays as it was and
loads, and nothing appears at rank 1's."""

from __future__ import annotations

import os

import torch

from flashfsdp import checkpoint
from tests.checkpoint.common import assert_values, local_values, sharded_mlp
from tests.checkpoint.test_agreement import TIMEOUT_S, _outcome
from tests.harness import run_distributed


def _differing_arguments(rank: int, world_size: int, out: str) -> dict:
    model = sharded_mlp(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 7)).sum().backward()
    opt.step()
    good = checkpoint.save(os.path.join(out, "a", "step_1"), model, opt, step=1, extra={"loss": 1.5})
    other = checkpoint.save(os.path.join(out, "c"), model, step=0)  # a checkpoint rank 1 alone loads
    saved = local_values(model)
    with torch.no_grad():  # what a save of this model would hold differs from what is on disk
        for p in model.parameters():
            p.add_(1.0)
    changed = local_values(model)
    mine = os.path.join(out, "a" if rank == 0 else "b", "step_1")
    outcomes = {
        "path": _outcome(lambda: checkpoint.save(mine, model, opt, step=2)),
        "step": _outcome(lambda: checkpoint.save(good, model, opt, step=2 + rank)),
        "optimizer": _outcome(lambda: checkpoint.save(good, model, opt if rank == 0 else None, step=2)),
        "extra": _outcome(lambda: checkpoint.save(good, model, opt, step=2, extra={"rank": rank})),
        "load path": _outcome(lambda: checkpoint.load(good if rank == 0 else other, model)),
        "load optimizer": _outcome(lambda: checkpoint.load(good, model, opt if rank == 0 else None)),
    }
    assert_values(model, changed)  # no load read anything into it
    fresh = sharded_mlp(seed=2)
    info = checkpoint.load(good, fresh, torch.optim.SGD(fresh.parameters(), lr=1.0, momentum=0.9))
    assert_values(fresh, saved)  # the checkpoint at rank 0's path is the one saved at step 1
    return {"outcomes": outcomes, "info": info, "b": os.path.lexists(os.path.join(out, "b")),
            "a": sorted(os.listdir(os.path.join(out, "a")))}


def test_arguments_that_differ_by_rank_are_named_and_nothing_is_written(tmp_path):
    results = run_distributed(_differing_arguments, 2, str(tmp_path), timeout=TIMEOUT_S)
    a, b = (os.path.join(str(tmp_path), name, "step_1") for name in "ab")
    expected = {
        "path": f"save: the ranks passed different arguments: path is '{a}' on rank 0, '{b}' on rank 1; "
                "every rank must call save with the same path",
        "step": "save: the ranks passed different arguments: step is 2 on rank 0, 3 on rank 1;",
        "optimizer": "save: the ranks passed different arguments: optimizer is 'SGD' on rank 0, None on rank 1;",
        "extra": "save: the ranks passed different arguments: extra is {'rank': 0} on rank 0, {'rank': 1} on rank 1;",
        "load path": f"load: the ranks passed different arguments: path is '{a}' on rank 0, "
                     f"'{tmp_path / 'c'}' on rank 1; every rank must load the same checkpoint",
        "load optimizer": "load: the ranks passed different arguments: optimizer is 'SGD' on rank 0, None on rank 1;",
    }
    for rank, result in enumerate(results):
        for scenario, message in expected.items():
            outcome = result["outcomes"][scenario]
            assert outcome is not None, f"rank {rank}: {scenario} raised nothing"
            kind, text = outcome
            assert kind == "ValueError" and text.startswith(message), (rank, scenario, text)
        assert result["info"] == {"step": 1, "extra": {"loss": 1.5}}
        assert not result["b"], "rank 1's save wrote into its own path"
        assert result["a"] == ["step_1"], result["a"]  # no scratch left beside it
