"""Where benchmarks write: an untracked ``bench-results/<device>/`` by default, the committed
``benchmarks/results/<device>/`` only with ``--record``, ``--out`` anywhere else; never both."""

from __future__ import annotations

import importlib

import pytest

from benchmarks import outputs

# Every benchmark's command line (module, the function taking argv).
MODULES = ["benchmarks.kernels", "benchmarks.step", "benchmarks.checkpoint", "benchmarks.optim_step",
           "benchmarks.soak.__main__", "benchmarks.overlap.__main__", "benchmarks.gpu_check.__main__",
           "benchmarks.estimate", "benchmarks.fp16"]


def test_default_is_untracked_scratch_under_the_current_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(outputs, "RESULTS_ROOT", tmp_path / "committed")
    path = outputs.output_dir("cpu")
    assert path == tmp_path / "bench-results" / "cpu" and path.is_dir()
    assert not (tmp_path / "committed").exists()


def test_record_writes_the_committed_tables_and_out_wins_otherwise(tmp_path, monkeypatch):
    monkeypatch.setattr(outputs, "RESULTS_ROOT", tmp_path / "committed")
    assert outputs.output_dir("cpu", record=True) == tmp_path / "committed" / "cpu"
    assert outputs.output_dir("cpu", out=str(tmp_path / "mine")) == tmp_path / "mine"
    with pytest.raises(ValueError, match=r"give out .* or record=True, not both"):
        outputs.output_dir("cpu", out=tmp_path, record=True)


def test_the_committed_folder_is_the_one_in_the_repository_and_scratch_is_ignored():
    root = outputs.RESULTS_ROOT.parent.parent
    assert outputs.RESULTS_ROOT == root / "benchmarks" / "results"
    assert "/bench-results/" in (root / ".gitignore").read_text().splitlines()


@pytest.mark.parametrize("module", MODULES)
def test_every_benchmark_refuses_out_with_record(module, capsys):
    main = importlib.import_module(module).main
    with pytest.raises(SystemExit) as exit_info:
        main(["--record", "--out", "somewhere"])
    assert exit_info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_default_run_leaves_the_committed_tables_alone(tmp_path, monkeypatch):
    """benchmarks.estimate (shapes on the meta device, a few seconds) end to end."""
    estimate = importlib.import_module("benchmarks.estimate")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(outputs, "RESULTS_ROOT", tmp_path / "committed")
    rows = estimate.main([])
    assert rows and sorted(p.name for p in (tmp_path / "bench-results" / "cpu").iterdir()) == ["estimate.csv",
                                                                                               "estimate.md"]
    assert not (tmp_path / "committed").exists()
