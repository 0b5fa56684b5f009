"""flashfsdp.checkpoint: damaged files are found by their checksums, crafted files run nothing.

At W = 1 (no torch.distributed): 256 flipped bytes inside a parameter's data fail the load, naming
the file and the entries it holds (``verify=False`` loads them as they are); a checkpoint without
checksums loads with a warning; a ``.metadata`` or an optimizer hyperparameter whose pickle calls
``os.system`` / ``builtins.exec`` is refused without running it.
"""

from __future__ import annotations

import builtins
import json
import os
import pickle
import re
import zlib

import pytest
import torch

from flashfsdp import checkpoint
from flashfsdp.checkpoint.safe_metadata import DisallowedGlobal, SafeFileSystemReader, load_metadata
from tests.checkpoint.common import assert_values, local_values, sharded_mlp
PARAM = "blocks.1.up.weight"  # 21 x 13 float32: 1092 bytes


def _saved(tmp_path, optimizer: bool = False):
    model = sharded_mlp(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer else None
    return checkpoint.save(tmp_path / "ckpt", model, opt, step=4), model


def _storage(path: str, key: str):
    """DCP's (file, offset, length) of the entry ``key``."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = load_metadata(f.read())
    (info,) = [info for index, info in metadata.storage_data.items() if index.fqn == key]
    return os.path.join(path, info.relative_path), info.offset, info.length


def _flip_inside(path: str, key: str, values: torch.Tensor, n: int = 256) -> str:
    """Flip ``n`` bytes in the middle of the raw data of entry ``key`` (found by its bytes); the file."""
    file, offset, length = _storage(path, key)
    with open(file, "r+b") as f:
        f.seek(offset)
        entry = f.read(length)
        start = entry.index(values.numpy().tobytes()) + (values.numel() * 4 - n) // 2
        f.seek(offset + start)
        f.write(bytes(b ^ 0xFF for b in entry[start : start + n]))
    return file


def _edit_marker(path: str, edit) -> None:
    file = os.path.join(path, checkpoint.MARKER)
    with open(file) as f:
        marker = json.load(f)
    edit(marker)
    with open(file, "w") as f:
        json.dump(marker, f)


def test_flipped_bytes_in_a_parameter_fail_the_load_naming_file_and_entries(tmp_path):
    path, model = _saved(tmp_path)
    file = _flip_inside(path, f"model.{PARAM}", dict(model.named_parameters())[PARAM].detach())
    fresh = sharded_mlp(seed=2)
    before = local_values(fresh)
    with pytest.raises(ValueError, match=rf"load: {re.escape(file)} fails its checksum \(crc32 \w+, saved \w+\).*"
                                         rf"it holds .*'model\.{re.escape(PARAM)}'.*nothing was loaded"):
        checkpoint.load(path, fresh)
    assert_values(fresh, before)
    checkpoint.load(path, fresh, verify=False)  # the damage was real, and silent without checksums
    loaded = dict(fresh.named_parameters())[PARAM].detach()
    saved = dict(model.named_parameters())[PARAM].detach()
    assert not torch.equal(loaded, saved)
    assert_values(fresh, {**local_values(model), PARAM: loaded})  # every other parameter is intact


def test_checkpoints_without_checksums_load_with_a_warning(tmp_path):
    path, model = _saved(tmp_path, optimizer=True)
    _edit_marker(path, lambda marker: marker.update(version=1) or marker.pop("checksums"))
    fresh = sharded_mlp(seed=2)
    with pytest.warns(UserWarning, match=f"checkpoint {path} has no checksums .*loaded unverified"):
        assert checkpoint.load(path, fresh, torch.optim.SGD(fresh.parameters(), lr=1.0, momentum=0.9))["step"] == 4
    assert_values(fresh, local_values(model))
    _edit_marker(path, lambda marker: marker.update(checksums={"extra.pt": 1}))
    with pytest.raises(ValueError, match=f"checkpoint {path} has no checksum for .metadata: the marker does not"):
        checkpoint.load(path, fresh)
    _edit_marker(path, lambda marker: marker.update(checksums="crc"))
    with pytest.raises(ValueError, match="is corrupt: its checksums are not a map"):
        checkpoint.load(path, fresh)
    with pytest.raises(TypeError, match="load: verify must be a bool, got str"):
        checkpoint.load(path, fresh, verify="no")


class _Payload:
    """Unpickling it calls ``call(*args)``: what a crafted checkpoint would run."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def _payloads(tmp_path) -> list[tuple[_Payload, str]]:
    """Payloads that would create a file in ``tmp_path`` (with the name of the global each uses)."""
    return [(_Payload(os.system, f"touch {tmp_path}/ran_system"), f"{os.system.__module__}.system"),
            (_Payload(builtins.exec, f"open({str(tmp_path)!r} + '/ran_exec', 'w').close()"), "builtins.exec")]


def _ran(tmp_path) -> list[str]:
    return sorted(name for name in os.listdir(tmp_path) if name.startswith("ran_"))


@pytest.mark.parametrize("verify", [True, False])
def test_metadata_naming_a_disallowed_global_is_refused_unrun(tmp_path, verify):
    path, _ = _saved(tmp_path)
    metadata_file = os.path.join(path, ".metadata")
    with open(metadata_file, "rb") as f:
        genuine = load_metadata(f.read())
    for payload, name in _payloads(tmp_path):
        for crafted in (payload, _with_planner_data(genuine, payload)):  # alone, or hidden inside DCP's own
            data = pickle.dumps(crafted)
            with open(metadata_file, "wb") as f:
                f.write(data)
            _edit_marker(path, lambda marker: marker["checksums"].update({".metadata": zlib.crc32(data)}))
            with pytest.raises(ValueError, match=f"checkpoint {path} has a DCP metadata file {metadata_file} that "
                                                 f"holds a disallowed global '{re.escape(name)}'"):
                checkpoint.load(path, sharded_mlp(seed=2), verify=verify)
            with pytest.raises(DisallowedGlobal, match=re.escape(name)):  # what dcp.load reads it with
                SafeFileSystemReader(path).read_metadata()
    assert _ran(tmp_path) == []


def _with_planner_data(metadata, payload):
    metadata.planner_data = payload
    return metadata


def test_a_crafted_non_tensor_entry_is_refused_unrun(tmp_path):
    model = sharded_mlp(seed=1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    payload, _ = _payloads(tmp_path)[0]
    opt.param_groups[0]["note"] = payload  # saved as a pickled (non-tensor) entry
    path = checkpoint.save(tmp_path / "ckpt", model, opt, step=1)
    fresh = sharded_mlp(seed=2)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1)
    fresh_opt.param_groups[0]["note"] = "a string"
    with pytest.raises(RuntimeError, match=r"the non-tensor entry 'optim\.param_groups\.0\.note' holds what "
                                           r"torch\.load\(weights_only=True\) refuses"):
        checkpoint.load(path, fresh, fresh_opt)
    assert _ran(tmp_path) == []


def test_genuine_metadata_reads_back_whole(tmp_path):
    """The allowed globals cover what DCP writes: bfloat16 and float64 buffers, tensor and tuple
    hyperparameters, optimizer state."""
    model = sharded_mlp(seed=1)
    model.shift.register_buffer("scale_bf16", torch.ones(3, dtype=torch.bfloat16))
    model.shift.register_buffer("scale_f64", torch.ones(2, dtype=torch.float64))
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01), betas=(0.8, 0.9))
    model(torch.randn(2, 7)).sum().backward()
    opt.step()
    path = checkpoint.save(tmp_path / "ckpt", model, opt, step=1)
    with open(os.path.join(path, ".metadata"), "rb") as f:
        data = f.read()
    assert pickle.loads(data).state_dict_metadata == load_metadata(data).state_dict_metadata
    fresh = sharded_mlp(seed=2)
    fresh.shift.register_buffer("scale_bf16", torch.zeros(3, dtype=torch.bfloat16))
    fresh.shift.register_buffer("scale_f64", torch.zeros(2, dtype=torch.float64))
    fresh_opt = torch.optim.Adam(fresh.parameters(), lr=torch.tensor(1.0), betas=(0.1, 0.2))
    checkpoint.load(path, fresh, fresh_opt)
    assert fresh_opt.param_groups[0]["betas"] == (0.8, 0.9)
    assert torch.equal(fresh_opt.param_groups[0]["lr"], torch.tensor(0.01))
    assert_values(fresh, local_values(model))
    assert torch.equal(fresh.shift.scale_bf16, torch.ones(3, dtype=torch.bfloat16))
