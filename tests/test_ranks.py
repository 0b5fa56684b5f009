"""flashfsdp_dev.ranks: the spawner (through tests.harness) reports a failing rank's traceback, a
rank that exits without one (``os._exit``, as the ported suites' runner does) by its exit code,
and a rank killed by a fatal signal (gloo's abort) by the Python stack faulthandler wrote."""

from __future__ import annotations

import os

import pytest
import torch

from flashfsdp_dev.ranks import RanksFailed, failure_message, spawn_ranks
from tests.harness import run_distributed, start_method


def _fails_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError(f"rank {rank} of {world_size} fails")
    return rank


def test_a_failing_rank_fails_the_call_with_its_traceback():
    with pytest.raises(AssertionError, match=r"(?s)--- rank 1 ---.*ValueError: rank 1 of 2 fails"):
        run_distributed(_fails_on_rank_1, 2, timeout=120)


def _exits_on_rank_0(rank: int, world_size: int) -> int:
    if rank == 0:
        os._exit(3)
    return rank


def test_a_rank_that_exits_fails_the_call_with_its_exit_code():
    with pytest.raises(RanksFailed, match="exit code 3"):
        spawn_ranks(_exits_on_rank_0, 2, threads=1, timeout=120, start_method=start_method())


def test_every_failed_rank_is_reported_whichever_the_join_noticed_first(tmp_path):
    # Rank 0 exited (os._exit(3)) and rank 1 then raised in its next collective; on a loaded
    # machine rank 1's traceback can reach the join first. Both are named, the exit first.
    torch.save({"error": "Traceback ...\nRuntimeError: Connection reset by peer"}, tmp_path / "rank1.pt")
    message = failure_message(str(tmp_path), [3, 1])
    assert message.startswith("--- rank 0: exited with exit code 3 before it returned ---\n--- rank 1 ---\n")
    assert "Connection reset by peer" in message
    torch.save({"ok": 0}, tmp_path / "rank0.pt")  # a rank that returned its result is not listed as exited
    assert failure_message(str(tmp_path), [3, None]).startswith("--- rank 1 ---")


def _aborts_on_rank_1(rank: int, world_size: int) -> int:
    if rank == 1:
        os.abort()  # what gloo's std::terminate on a mismatched collective does
    return rank


def test_a_rank_killed_by_a_signal_fails_the_call_with_its_python_stack():
    with pytest.raises(RanksFailed, match=r"(?s)--- rank 1: fatal signal before it returned ---.*Aborted.*"
                                          r"_aborts_on_rank_1"):
        spawn_ranks(_aborts_on_rank_1, 2, threads=1, timeout=120, start_method=start_method())


def test_a_rank_killed_while_writing_its_result_leaves_no_truncated_file(tmp_path, monkeypatch):
    # the spawner kills the ranks still running once one failed; one may be inside torch.save
    from flashfsdp_dev import ranks

    def save_then_die(obj, path):
        with open(path, "wb") as fh:
            fh.write(b"PK\x03\x04 truncated")
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(ranks.torch, "save", save_then_die)
    with pytest.raises(KeyboardInterrupt):
        ranks._save_result({"error": "Traceback ..."}, str(tmp_path), 0)
    monkeypatch.undo()
    assert not (tmp_path / "rank0.pt").exists()
    # the report still reads every other rank and says which rank exited how
    torch.save({"error": "Traceback: rank 1 failed"}, tmp_path / "rank1.pt")
    assert failure_message(str(tmp_path), [None, 1]) == "--- rank 1 ---\nTraceback: rank 1 failed"
