"""The training job's install (`pip install "flashfsdp[train]"`, the README's set-up) plots
`loss.png`: matplotlib is in the `train` extra, and stays in `bench` for the benchmarks' plots;
without it the job says which extra to install."""

from __future__ import annotations

import logging
import sys

from flashfsdp.train import report
from tests.test_install import _setup_requirements


def test_matplotlib_is_in_the_training_jobs_extra_and_still_in_bench():
    _, extras = _setup_requirements()
    assert "matplotlib" in extras["train"] and "matplotlib" in extras["bench"]


def test_without_matplotlib_the_warning_names_the_train_extra(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with caplog.at_level(logging.WARNING, logger="flashfsdp"):
        assert report.plot_losses(str(tmp_path), 3.2) is None
    assert "pip install 'flashfsdp[train]'" in caplog.text and not (tmp_path / report.PLOT).exists()
