"""flashfsdp.checkpoint: save at W = 2, resume at W = 1, 2, 4; atomic saves; clear errors on bad input.

One W = 2 run trains 3 steps and saves, has one rank's writer fail half-way through a second save
(to a new path, then over the saved checkpoint itself), resumes from the surviving checkpoint, and
saves Adam and SGD (momentum) runs whose learning rate a scheduler changed; one W = 4 run resumes
from the first checkpoint and reloads the Adam and SGD ones; the W = 1 resume and reloads and the
error cases run in the test process itself, without torch.distributed.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

import flashfsdp
from flashfsdp import checkpoint
from flashfsdp.models.llama import Llama, LlamaConfig
from tests.checkpoint.common import sharded_mlp
from tests.harness import run_distributed
from tests.models import llama_units, loss_fn, make_batch
from tests.training import (gather_full_optimizer_state, gather_full_params, local_rows, make_model, train_flashfsdp,
                            train_reference)

FP32 = dict(rtol=1e-5, atol=1e-6)
FP32_PARAMS = dict(rtol=1e-5, atol=1e-5)
GLOBAL_BATCH = 4  # rows per step at every W, so that W = 1, 2, 4 train on the same batches


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The W = 2 run: 3 steps, save step_3, a failed save of step_4, resume from step_3 for 3 steps."""
    out = str(tmp_path_factory.mktemp("ckpt"))
    results = run_distributed(_train_save_crash_resume, 2, out)
    return out, results


def _train_save_crash_resume(rank, world_size, out):
    first = train_flashfsdp("llama", rank, world_size, steps=3, global_batch=GLOBAL_BATCH,
                            save_to=os.path.join(out, "step_3"))
    # A save that dies half-way: rank 1's writer raises while writing its shard file.
    from torch.distributed.checkpoint import FileSystemWriter  # noqa: PLC0415

    model = make_model("llama")
    for unit in llama_units(model):
        flashfsdp.fully_shard(unit)
    opt = torch.optim.AdamW(model.parameters(), lr=1.0)
    original = FileSystemWriter.write_data

    def crash(self, plan, planner):
        raise OSError("simulated crash while writing")

    FileSystemWriter.write_data = crash if rank == 1 else original
    crashed = []
    try:
        for path, step in ((os.path.join(out, "step_4"), 4), (os.path.join(out, "step_3"), 5)):
            try:
                checkpoint.save(path, model, opt, step=step)
                crashed.append(None)
            except RuntimeError as exc:
                crashed.append(f"{type(exc).__name__}: {exc}")
    finally:
        FileSystemWriter.write_data = original
    newest = checkpoint.latest(out)
    resumed = train_flashfsdp("llama", rank, world_size, steps=3, global_batch=GLOBAL_BATCH, load_from=newest)
    return {"first": first, "crashed": crashed, "step_4_exists": os.path.exists(os.path.join(out, "step_4")),
            "latest": newest, "resumed": resumed, "scheduled": _save_scheduled(rank, world_size, out)}


OPTIMIZERS = {"adam": lambda params: torch.optim.Adam(params, lr=0.1),
              "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)}
SCHEDULED_LR = 0.1 * 0.5**2  # StepLR(gamma=0.5) after 2 steps


def _optimizer_result(model, opt) -> dict:
    return {"state": gather_full_optimizer_state(model, opt), "lr": opt.param_groups[0]["lr"],
            "params": gather_full_params(model)}


def _save_scheduled(rank, world_size, out) -> dict:
    """Adam and SGD (momentum) on the MLP, 2 steps with StepLR halving lr each step; saved to out/<name>."""
    saved = {}
    for name, make in OPTIMIZERS.items():
        model = sharded_mlp()
        opt = make(model.parameters())
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for step in range(2):
            x, y = make_batch("mlp", step, GLOBAL_BATCH)
            loss_fn("mlp", model(local_rows(x, rank, world_size)), local_rows(y, rank, world_size)).backward()
            opt.step()
            opt.zero_grad()
            schedule.step()
        checkpoint.save(os.path.join(out, name), model, opt, step=2)
        saved[name] = _optimizer_result(model, opt)
    return saved


def _reload_scheduled(out) -> dict:
    """Each of out/<name> loaded into a fresh model and optimizer (other seed, lr 1.0)."""
    loaded = {}
    for name, make in OPTIMIZERS.items():
        model = sharded_mlp(seed=5)
        opt = make(model.parameters())
        for group in opt.param_groups:
            group["lr"] = 1.0
        checkpoint.load(os.path.join(out, name), model, opt)
        loaded[name] = _optimizer_result(model, opt)
    return loaded


def _resume(rank, world_size, path):
    return train_flashfsdp("llama", rank, world_size, steps=3, global_batch=GLOBAL_BATCH, load_from=path)


def _resume_and_reload(rank, world_size, path, out):
    return {"resumed": _resume(rank, world_size, path), "reloaded": _reload_scheduled(out)}


def _assert_reloaded(loaded: dict, saved: dict) -> None:
    """Optimizer state, learning rate (the scheduler's) and parameters as saved, exactly."""
    for name in OPTIMIZERS:
        got, want = loaded[name], saved[name]
        assert got["lr"] == want["lr"] == SCHEDULED_LR, name
        assert got["state"].keys() == want["state"].keys()
        for param, entries in want["state"].items():
            assert got["state"][param].keys() == entries.keys(), (name, param)
            for key, value in entries.items():
                torch.testing.assert_close(got["state"][param][key], value, rtol=0, atol=0, msg=f"{name} {param}.{key}")
        for param, value in want["params"].items():
            torch.testing.assert_close(got["params"][param], value, rtol=0, atol=0, msg=f"{name} {param}")


def _assert_resumed(result, ref):
    torch.testing.assert_close(result["losses"], ref["losses"][3:], **FP32)
    assert result["loaded"]["step"] == 3
    for name, want in ref["params"].items():
        torch.testing.assert_close(result["params"][name], want, msg=lambda m: f"{name}: {m}", **FP32_PARAMS)


@pytest.fixture(scope="module")
def reference():
    return train_reference("llama", 2, steps=6)  # global batch MICRO_BATCH·2 = GLOBAL_BATCH rows


def test_save_at_2_crash_and_resume_at_1_2_4(saved, reference):
    out, results = saved
    path = os.path.join(out, "step_3")
    for r in results:
        torch.testing.assert_close(r["first"]["losses"], reference["losses"][:3], **FP32)
        # the failed saves raised on every rank and left no step_4; step_3 survived being saved over
        # (the resume loaded its step 3, not 5) and is still the newest
        assert len(r["crashed"]) == 2 and all(c is not None and "simulated crash" in c for c in r["crashed"])
        assert not r["step_4_exists"]
        assert r["latest"] == path
        _assert_resumed(r["resumed"], reference)
        assert r["resumed"]["loaded"]["extra"] == {"losses": r["first"]["losses"]}
    assert set(os.listdir(path)) == {".metadata", "__0_0.distcp", "__1_0.distcp", checkpoint.MARKER, "extra.pt"}
    for r in run_distributed(_resume_and_reload, 4, path, out):
        _assert_resumed(r["resumed"], reference)
        _assert_reloaded(r["reloaded"], results[0]["scheduled"])
    # W = 1 in this process, torch.distributed not initialised
    _assert_resumed(_resume(0, 1, path), reference)
    _assert_reloaded(_reload_scheduled(out), results[0]["scheduled"])
    plain = make_model("llama")  # an unwrapped model loads the sharded checkpoint too
    assert checkpoint.load(path, plain)["step"] == 3
    for name, p in plain.named_parameters():
        torch.testing.assert_close(p.detach(), results[0]["first"]["params"][name], rtol=0, atol=0, msg=name)


def _sharded_llama(config: LlamaConfig | None = None):
    model = Llama(config) if config is not None else make_model("llama")
    for unit in llama_units(model):
        flashfsdp.fully_shard(unit)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_damaged_checkpoints_fail_naming_the_problem(saved, tmp_path):
    out, _ = saved
    good = os.path.join(out, "step_3")
    model, opt = _sharded_llama()
    with pytest.raises(FileNotFoundError, match="does_not_exist.*does not exist"):
        checkpoint.load(str(tmp_path / "does_not_exist"), model, opt)
    missing_shard = str(tmp_path / "missing_shard")
    shutil.copytree(good, missing_shard)
    os.remove(os.path.join(missing_shard, "__1_0.distcp"))
    with pytest.raises(FileNotFoundError, match="missing_shard is missing the shard file __1_0.distcp"):
        checkpoint.load(missing_shard, model, opt)
    partial = str(tmp_path / "partial")
    shutil.copytree(good, partial)
    os.remove(os.path.join(partial, checkpoint.MARKER))
    with pytest.raises(ValueError, match=f"partial is not a complete flashfsdp checkpoint: {checkpoint.MARKER}"):
        checkpoint.load(partial, model, opt)
    assert checkpoint.latest(tmp_path) == missing_shard  # the partial one is not complete
    wider = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, ffn_dim=48, max_seq_len=16)
    other, other_opt = _sharded_llama(wider)
    with pytest.raises(ValueError, match=r"parameter 'layers\.0\.feed_forward\.w1\.weight' has shape \(40, 32\) "
                                         r"in checkpoint .* but \(48, 32\) in the model"):
        checkpoint.load(good, other, other_opt)
    deeper, deeper_opt = _sharded_llama(LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, ffn_dim=40,
                                                    max_seq_len=16))
    with pytest.raises(ValueError, match=r"no entry for parameter 'layers\.2\."):
        checkpoint.load(good, deeper, deeper_opt)


def test_model_only_and_sgd_momentum_round_trip_at_w1(tmp_path):
    torch.manual_seed(0)
    x = torch.randn(8, 7)
    model = sharded_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
    path = checkpoint.save(tmp_path / "sgd", model, opt, step=1, extra={"note": "sgd", "t": torch.ones(2)})
    model_only = checkpoint.save(tmp_path / "model_only", model, step=1)
    fresh = sharded_mlp(seed=5)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.5, momentum=0.9)
    with pytest.raises(ValueError, match="has no optimizer state; pass optimizer=None"):
        checkpoint.load(model_only, fresh, fresh_opt)
    info = checkpoint.load(path, fresh, fresh_opt)
    assert info["step"] == 1 and info["extra"]["note"] == "sgd" and torch.equal(info["extra"]["t"], torch.ones(2))
    assert fresh_opt.param_groups[0]["lr"] == 0.1
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        torch.testing.assert_close(q, p, rtol=0, atol=0, msg=name)
        torch.testing.assert_close(fresh_opt.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"],
                                   rtol=0, atol=0, msg=name)
    # re-saving a step replaces it atomically
    assert checkpoint.save(path, fresh, fresh_opt, step=2) == path
    assert checkpoint.load(path, model, opt)["step"] == 2
    assert sorted(os.listdir(tmp_path)) == ["model_only", "sgd"]


def test_bad_arguments_are_named(tmp_path):
    model, opt = _sharded_llama()
    where = str(tmp_path / "c")
    with pytest.raises(TypeError, match="save: path must be a str"):
        checkpoint.save(3, model, opt, step=0)
    with pytest.raises(TypeError, match="save: model must be an nn.Module"):
        checkpoint.save(where, opt, step=0)
    with pytest.raises(TypeError, match="save: optimizer must be a torch.optim.Optimizer"):
        checkpoint.save(where, model, "adam", step=0)
    for step in (-1, True, 1.5):
        with pytest.raises(TypeError, match="save: step must be an int >= 0"):
            checkpoint.save(where, model, opt, step=step)
    with pytest.raises(TypeError, match="save: extra must be a dict"):
        checkpoint.save(where, model, opt, step=0, extra=[1])
    with pytest.raises(ValueError, match=r"save: extra must hold only what torch.load\(weights_only=True\)"):
        checkpoint.save(where, model, opt, step=0, extra={"bad": object()})
    assert not os.path.exists(where) and checkpoint.latest(tmp_path) is None
    with pytest.raises(TypeError, match="load: optimizer must be"):
        checkpoint.load(where, model, optimizer=model)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a checkpoint directory"):
        checkpoint.load(tmp_path / "file", model)
    with pytest.raises(TypeError, match="latest: out_dir must be a str"):
        checkpoint.latest(None)
    with pytest.raises(NotADirectoryError, match="latest: out_dir .* is a file"):
        checkpoint.latest(tmp_path / "file")
    assert checkpoint.latest(tmp_path / "nowhere") is None
