"""flashfsdp.checkpoint at W = 1 (no torch.distributed): what save refuses, corrupt files, all-or-nothing loads.

Every case names the path or the entry at fault; a load that fails on a small file or a check leaves
the model and the optimizer exactly as they were.
"""

from __future__ import annotations

import os

import pytest
import torch

import flashfsdp
from flashfsdp import checkpoint
from tests.models import llama_units, loss_fn, make_batch, make_llama


def _sharded(seed: int = 0, buffer: bool = False, optimizer=torch.optim.AdamW):
    model = make_llama(seed)
    if buffer:
        model.norm.register_buffer("calibration", torch.arange(4.0) + seed)
    for unit in llama_units(model):
        flashfsdp.fully_shard(unit)
    return model, optimizer(model.parameters(), lr=1e-2)


def _trained(seed: int = 0, **kwargs):
    model, opt = _sharded(seed, **kwargs)
    x, y = make_batch("llama", seed, 2)
    loss_fn("llama", model(x), y).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def _snapshot(model, opt) -> dict:
    """Every parameter, buffer and optimizer state tensor / hyperparameter, cloned."""
    return {
        "params": [p.detach().clone() for p in model.parameters()],
        "buffers": [b.clone() for b in model.buffers()],
        "state": {i: {k: v.clone() for k, v in opt.state[p].items()} for i, p in enumerate(model.parameters())
                  if p in opt.state},
        "groups": [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups],
    }


def _assert_unchanged(before: dict, model, opt) -> None:
    after = _snapshot(model, opt)
    assert after["groups"] == before["groups"]
    assert after["state"].keys() == before["state"].keys()
    for i, entries in before["state"].items():
        for key, value in entries.items():
            assert torch.equal(after["state"][i][key], value), (i, key)
    for a, b in zip(after["params"] + after["buffers"], before["params"] + before["buffers"]):
        assert torch.equal(a, b)


@pytest.fixture
def saved(tmp_path):
    model, opt = _trained(seed=0)
    return checkpoint.save(tmp_path / "ckpt", model, opt, step=5, extra={"note": "x"})


def test_save_refuses_anything_but_a_checkpoint_at_path(tmp_path, saved):
    model, opt = _trained(seed=1)
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    (run / "logs" / "train.log").write_text("precious")
    (run / "config.yaml").write_text("precious")
    with pytest.raises(FileExistsError, match=f"save: {run} exists and is a directory that is not a flashfsdp "
                                              f"checkpoint .it has no {checkpoint.MARKER}."):
        checkpoint.save(run, model, opt, step=1)
    assert sorted(os.listdir(run)) == ["config.yaml", "logs"] and (run / "logs" / "train.log").read_text() == "precious"
    a_file = tmp_path / "a_file"
    a_file.write_text("precious")
    with pytest.raises(FileExistsError, match=f"save: {a_file} exists and is a file"):
        checkpoint.save(a_file, model, opt, step=1)
    assert a_file.read_text() == "precious"
    link = tmp_path / "link"
    link.symlink_to(saved)
    with pytest.raises(FileExistsError, match=f"save: {link} exists and is a symbolic link"):
        checkpoint.save(link, model, opt, step=1)
    assert not any(name.startswith(".") for name in os.listdir(tmp_path))  # nothing was written
    # an empty directory and an existing checkpoint are replaced
    empty = tmp_path / "empty"
    empty.mkdir()
    assert checkpoint.save(empty, model, opt, step=1) == str(empty)
    assert checkpoint.load(empty, *_sharded(seed=2))["step"] == 1
    assert checkpoint.save(saved, model, opt, step=6) == saved
    assert checkpoint.load(saved, *_sharded(seed=2))["step"] == 6


@pytest.mark.parametrize("content", [b"", b"garbage", b"\x80\x04K\x01."], ids=["empty", "garbage", "an int"])
def test_corrupt_metadata_is_named(saved, content):
    with open(os.path.join(saved, ".metadata"), "wb") as f:
        f.write(content)
    model, opt = _trained(seed=1)
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=f"load: {saved}/.metadata fails its checksum .*it holds DCP's metadata"):
        checkpoint.load(saved, model, opt)
    with pytest.raises(ValueError, match=f"checkpoint {saved} has a corrupt DCP metadata file {saved}/.metadata"):
        checkpoint.load(saved, model, opt, verify=False)
    _assert_unchanged(before, model, opt)


@pytest.mark.parametrize("content", [b"xx", None], ids=["garbage", "not save's dict"])
def test_corrupt_extra_leaves_model_and_optimizer_unchanged(saved, content):
    extra = os.path.join(saved, "extra.pt")
    if content is None:
        torch.save([1, 2], extra)
    else:
        with open(extra, "wb") as f:
            f.write(content)
    for model, opt in (_trained(seed=1), _sharded(seed=2)):  # with optimizer state, and a fresh one
        before = _snapshot(model, opt)
        with pytest.raises(ValueError, match=f"load: {extra} fails its checksum .*it holds the extra dict"):
            checkpoint.load(saved, model, opt)
        with pytest.raises(ValueError, match=f"checkpoint {saved} has a corrupt extra.pt .{extra}"):
            checkpoint.load(saved, model, opt, verify=False)
        _assert_unchanged(before, model, opt)


def test_failed_checks_leave_a_fresh_optimizer_without_state(saved, tmp_path):
    model, opt = _sharded(seed=1, optimizer=lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9))
    before = _snapshot(model, opt)
    with pytest.raises(ValueError, match=f"checkpoint {saved} has no entry for optimizer state 'momentum_buffer' "
                                         f"of parameter 'tok_embeddings.weight'; it was saved with another optimizer"):
        checkpoint.load(saved, model, opt)
    assert not opt.state
    _assert_unchanged(before, model, opt)


def test_mismatches_name_buffers_keys_and_hyperparameters(saved, tmp_path):
    with_buffer = checkpoint.save(tmp_path / "with_buffer", *_sharded(seed=0, buffer=True), step=1)
    with pytest.raises(ValueError, match=r"has model key\(s\) \['norm.calibration'\] \(parameters or buffers\) "
                                         r"that the model does not have"):
        checkpoint.load(with_buffer, *_sharded(seed=1))
    with pytest.raises(ValueError, match=f"checkpoint {saved} has no entry for buffer 'norm.calibration'; it was "
                                         f"saved from another model"):
        checkpoint.load(saved, *_sharded(seed=1, buffer=True))
    model, _ = _sharded(seed=1)
    params = list(model.parameters())
    two_groups = torch.optim.AdamW([{"params": params[:3]}, {"params": params[3:], "weight_decay": 0.0}], lr=1e-2)
    with pytest.raises(ValueError, match=r"has no entry for optimizer hyperparameter '\w+' of param group 1; it "
                                         r"was saved with another optimizer type or another number of param groups "
                                         r"\(the checkpoint has 1\)"):
        checkpoint.load(saved, model, two_groups)
    stateless_sgd = torch.optim.SGD(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="has no entry for optimizer hyperparameter 'momentum' of param group 0"):
        checkpoint.load(saved, model, stateless_sgd)
