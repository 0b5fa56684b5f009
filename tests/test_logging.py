"""The `flashfsdp` logger: rank 0's records by default, every rank's with "all" (at W = 2, in the
training job), the job's notices through it, and no deprecation warning from flashfsdp's calls."""

from __future__ import annotations

import logging
import warnings

import pytest

from flashfsdp import log
from tests.harness import run_distributed
from tests.train.trainers import corpus_text


class _Records(logging.Handler):
    """What caplog does in the test process, in a rank: a handler on the root logger."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(f"{record.name}: {record.getMessage()}")


def _train_one_step(rank, world_size, tmp, ranks):
    from tests.train.trainers import make_trainer  # noqa: PLC0415

    log.set_log_ranks(ranks)
    captured = _Records()
    logging.getLogger().addHandler(captured)
    logging.getLogger("flashfsdp").setLevel(logging.INFO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(["--data", f"{tmp}/corpus.txt", "--out", f"{tmp}/run-{ranks}", "--steps", "1"]).train()
    return captured.lines, [str(w.message) for w in caught]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("logging")
    (tmp / "corpus.txt").write_text(corpus_text())
    return tmp


@pytest.mark.parametrize("ranks", ["0", "all"])
def test_the_job_logs_from_rank_0_by_default_and_from_every_rank_with_all(corpus, ranks):
    results = run_distributed(_train_one_step, 2, str(corpus), ranks)
    for rank, (lines, _) in enumerate(results):
        headers = [line for line in lines if "parameters, 2 rank(s) on cpu" in line]
        checkpoints = [line for line in lines if "checkpoint " in line]
        if rank == 0 or ranks == "all":
            assert len(headers) == 1 and headers[0].startswith("flashfsdp.train.trainer: ") and checkpoints
        else:
            assert not lines, lines


def test_no_deprecation_warning_from_flashfsdps_own_calls(corpus):
    for _, caught in run_distributed(_train_one_step, 2, str(corpus), "0"):
        assert not [w for w in caught if "is deprecated" in w], caught


def test_the_process_group_communicator_calls_the_current_collective():
    """runtime.process_group reaches torch's all_gather_single where torch has it (no deprecated call)."""
    import torch.distributed as dist  # noqa: PLC0415

    from flashfsdp.runtime import process_group  # noqa: PLC0415

    if hasattr(dist, "all_gather_single"):
        assert process_group.all_gather_single is dist.all_gather_single


def test_records_carry_the_rank_filter_and_configure_formats_them(caplog, monkeypatch):
    lines: list[str] = []
    logger = log.get_logger("flashfsdp.train.example")
    try:
        log.configure("all", prefix="prog", write=lines.append)
        monkeypatch.setenv("RANK", "1")
        logger.info("step %d", 3)
        logger.warning("careful")
        log.set_log_ranks(0)
        logger.info("hidden on rank 1")
        logger.error("an error shows on every rank")
        monkeypatch.setenv("RANK", "0")
        logger.info("shown on rank 0")
    finally:
        root = log.get_logger()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        root.propagate = True
        log.set_log_ranks(0)
    assert lines == ["prog [rank 1]: step 3", "prog [rank 1]: warning: careful",
                     "prog [rank 1]: error: an error shows on every rank", "prog: shown on rank 0"]


@pytest.mark.parametrize("spec", ["", "x", "-1", "0,a"])
def test_bad_log_ranks_are_refused_with_the_forms_accepted(spec):
    with pytest.raises(ValueError, match="give 'all' or ranks as non-negative integers"):
        log.set_log_ranks(spec)
    assert log.parse_ranks("all") is None and log.parse_ranks("0,3") == frozenset({0, 3})
