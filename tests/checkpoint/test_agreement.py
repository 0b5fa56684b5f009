"""flashfsdp.checkpoint at W = 2: an error on one rank alone is raised on both, never a hang.

One run of two gloo ranks goes through save and load failing on one rank only (a bad argument,
a missing path, an unreadable file, a shard file failing its checksum, a failed directory
operation on rank 0) and checks that both ranks raised the same error, then that a save and a
load still work (the ranks are still in step). A rank left waiting in a collective would hang the
run: the spawner kills it after ``TIMEOUT_S`` and the test fails.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch
import torch.distributed as dist

from flashfsdp import checkpoint
from flashfsdp.checkpoint import atomic, checksums
from tests.checkpoint.common import assert_values, local_values, sharded_mlp
from tests.harness import run_distributed

TIMEOUT_S = 120  # generous for process start-up on a busy machine; a hang never ends


def _outcome(action) -> tuple[str, str] | None:
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return type(exc).__name__, str(exc)
    return None


def _unreadable(file):
    raise PermissionError(errno.EACCES, "Permission denied", file)


def _disk_full(path):
    raise OSError(errno.ENOSPC, "No space left on device", path)


def _failing_on_one_rank(rank: int, world_size: int, out: str) -> dict:
    model = sharded_mlp(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    good = checkpoint.save(os.path.join(out, "good"), model, opt, step=1)
    mine = lambda value, other: value if rank == 0 else other  # noqa: E731 - rank 1 gets ``other``
    outcomes = {
        "save: bad path": _outcome(lambda: checkpoint.save(mine(good, 3), model, step=2)),
        "save: bad extra": _outcome(lambda: checkpoint.save(good, model, step=2, extra=mine({}, {"x": object()}))),
        "load: missing path": _outcome(lambda: checkpoint.load(mine(good, os.path.join(out, "nowhere")), model)),
    }
    with pytest.MonkeyPatch.context() as patch:
        if rank == 1:
            patch.setattr(checksums, "crc32_of_file", _unreadable)
        outcomes["load: unreadable shard file"] = _outcome(lambda: checkpoint.load(good, model))
    if rank == 0:  # rank 1 alone checks __1_0.distcp
        with open(os.path.join(good, "__1_0.distcp"), "r+b") as f:
            f.seek(os.path.getsize(f.name) // 2)
            f.write(b"\xff" * 256)
    dist.barrier()  # damaged before rank 1 looks
    outcomes["load: checksum mismatch"] = _outcome(lambda: checkpoint.load(good, model))
    with pytest.MonkeyPatch.context() as patch:
        if rank == 0:
            patch.setattr(atomic, "prepare", _disk_full)
        outcomes["save: rank 0's directory fails"] = _outcome(lambda: checkpoint.save(good, model, step=2))
    # still in step: a save and a load that work
    again = checkpoint.save(os.path.join(out, "again"), model, opt, step=3)
    fresh = sharded_mlp(seed=2)
    info = checkpoint.load(again, fresh, torch.optim.SGD(fresh.parameters(), lr=1.0, momentum=0.9))
    assert_values(fresh, local_values(model))
    return {"outcomes": outcomes, "step": info["step"]}


EXPECTED = {  # scenario: (error class, what its message says)
    "save: bad path": ("TypeError", "save: path must be a str or os.PathLike, got int (rank 1)"),
    "save: bad extra": ("ValueError", "save: extra must hold only what torch.load(weights_only=True) reads back"),
    "load: missing path": ("FileNotFoundError", "nowhere does not exist (rank 1)"),
    "load: unreadable shard file": ("PermissionError", "Permission denied"),
    "load: checksum mismatch": ("ValueError", "__1_0.distcp fails its checksum"),
    "save: rank 0's directory fails": ("OSError", "No space left on device"),
}


def test_a_failure_on_one_rank_is_raised_on_both(tmp_path):
    results = run_distributed(_failing_on_one_rank, 2, str(tmp_path), timeout=TIMEOUT_S)
    for rank, result in enumerate(results):
        assert result["step"] == 3
        assert result["outcomes"].keys() == EXPECTED.keys()
        for scenario, (kind, says) in EXPECTED.items():
            outcome = result["outcomes"][scenario]
            assert outcome is not None and outcome[0] == kind and says in outcome[1], (rank, scenario, outcome)
    assert results[0]["outcomes"] == results[1]["outcomes"]  # the very same error on both
