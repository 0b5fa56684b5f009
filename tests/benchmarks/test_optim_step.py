"""benchmarks.optim_step: a toy-size run end to end (files, columns, one run per unit for the flat
optimizer and for what torch's foreach AdamW is handed on flashfsdp, one tensor per parameter for
its single-tensor step and on FSDP2) and its argument checks."""

from __future__ import annotations

import csv

import pytest

from benchmarks.environment import environment_columns
import torch

from benchmarks.optim_step import COLUMNS, SYSTEMS, main, parse_args
from benchmarks.step import _model


def test_toy_run_writes_every_file_with_every_column(tmp_path):
    argv = ["--cpu", "--world-size", "1", "--in-process", "--out", str(tmp_path), "--layers", "3", "--dim", "32",
            "--heads", "2", "--repeats", "1", "--rounds", "1"]
    rows = main(argv)
    for name in ("optim_step_w1.csv", "optim_step_w1.md", "optim_step_w1.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    with open(tmp_path / "optim_step_w1.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == COLUMNS + environment_columns()
    assert [r["system"] for r in table] == list(SYSTEMS)
    by = {r["system"]: r for r in rows}
    assert by["flashfsdp flat AdamW"]["tensors"] == 4  # one run per unit: 3 blocks and the root
    params = len(list(_model(parse_args(argv), torch.device("meta")).parameters()))
    assert by["torch AdamW(foreach) on FSDP2 DTensors"]["tensors"] == params  # one DTensor per parameter
    assert by["torch AdamW(foreach) on flashfsdp DTensors"]["tensors"] == 4  # handed one run per unit
    assert by["torch AdamW(foreach) on plain tensors (the runs)"]["tensors"] == 4  # one copy per run
    # single-tensor: one local tensor per parameter on flashfsdp (FSDP2's temporaries), one DTensor on FSDP2
    assert by["torch AdamW(single-tensor) on flashfsdp DTensors"]["tensors"] == params
    assert by["torch AdamW(single-tensor) on FSDP2 DTensors"]["tensors"] == params
    assert all(r["faults_per_step"] >= 0 for r in rows)
    # fused: runs split after chunks that are not whole CPU vectors (here the 32-float norm weights)
    assert 4 < by["torch AdamW(fused) on flashfsdp DTensors"]["tensors"] < params
    assert all(r["step_ms"] > 0 for r in rows)
    assert by["torch AdamW(foreach) on FSDP2 DTensors"]["vs_fsdp2_foreach"] == 1.0


@pytest.mark.parametrize("argv, message", [
    (["--layers", "0"], "--layers must be >= 1"),
    (["--world-size", "2", "--in-process"], "--in-process runs one rank"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
