"""A failed ``flashfsdp.checkpoint.save`` leaves no ``.<name>.tmp`` scratch behind, unless that
scratch is a complete checkpoint (then it is the newest copy, and ``load`` finds it).

W = 1 without torch.distributed: the scratch is rank 0's to remove, after the ranks agreed."""

from __future__ import annotations

import errno
import os

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from flashfsdp import checkpoint
from flashfsdp.checkpoint import atomic
from tests.checkpoint.common import assert_values, local_values, sharded_mlp


def _disk_full(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def test_a_disk_full_while_writing_the_shards_removes_the_scratch(tmp_path, monkeypatch):
    model = sharded_mlp(seed=1)
    path = str(tmp_path / "step_1")
    checkpoint.save(path, model, step=1)
    before = local_values(model)
    monkeypatch.setattr(FileSystemWriter, "write_data", _disk_full)
    with pytest.raises(OSError, match="writing checkpoint .* failed .* No space left on device writing "):
        checkpoint.save(path, model, step=2)
    assert not os.path.exists(atomic.scratch(path)[0])
    assert sorted(os.listdir(tmp_path)) == ["step_1"]
    fresh = sharded_mlp(seed=2)
    assert checkpoint.load(path, fresh)["step"] == 1
    assert_values(fresh, before)


def test_a_disk_full_while_publishing_removes_the_incomplete_scratch(tmp_path, monkeypatch):
    model = sharded_mlp(seed=1)
    path = str(tmp_path / "step_1")
    monkeypatch.setattr(atomic, "write_file", _disk_full)  # the extra file and the marker
    with pytest.raises(OSError, match="No space left on device"):
        checkpoint.save(path, model, step=1)
    assert os.listdir(tmp_path) == []


def test_a_complete_scratch_is_kept_when_moving_it_into_place_fails(tmp_path, monkeypatch):
    model = sharded_mlp(seed=1)
    path = str(tmp_path / "step_1")
    rename = os.rename

    def refuse_into_place(src, dst):
        if os.fspath(dst) == path:
            raise OSError(errno.EIO, "Input/output error", dst)
        rename(src, dst)

    monkeypatch.setattr(os, "rename", refuse_into_place)
    with pytest.raises(OSError, match="Input/output error"):
        checkpoint.save(path, model, torch.optim.SGD(model.parameters(), lr=0.1), step=1)
    monkeypatch.undo()
    assert os.path.isdir(atomic.scratch(path)[0])
    with pytest.warns(UserWarning, match="interrupted"):
        assert checkpoint.load(path, sharded_mlp(seed=2))["step"] == 1
