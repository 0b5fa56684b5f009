"""Backward all-gather elision at W = 2: bit-identical training with and without it, the units it
skips (an embedding wrapped on its own, a linear layer whose input needs no gradient), and those it
must not (a hook saving the weight for backward, activation recomputation, a step whose forward
saves the weight)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.utils.checkpoint import checkpoint

import flashfsdp
from flashfsdp.bindings.elision import ELIDED_COUNTER, ENV_VAR, default_enabled
from flashfsdp.models.llama import Llama, LlamaConfig
from tests.harness import run_distributed

STEPS = 3


def _profiled_step(model, opt, batch, loss_fn) -> dict:
    """One training step under a profile; its counters (bytes)."""
    with flashfsdp.profile() as prof:
        loss_fn(model, batch).backward()
    opt.step()
    opt.zero_grad()
    return prof.summary()["counters"]


def _train(build, batches, loss_fn, elide: bool) -> dict:
    model = build()
    model.set_backward_all_gather_elision(elide)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    counters = [_profiled_step(model, opt, batch, loss_fn) for batch in batches]
    params = {n: p.detach().to_local().clone() for n, p in model.named_parameters()}  # this rank's chunks
    return {"params": params, "counters": counters}


def _on_and_off(build, batches, loss_fn) -> dict:
    return {elide: _train(build, batches, loss_fn, elide) for elide in (True, False)}


# ----------------------------------------------------------------------------- Llama
def _llama(param_dtype):
    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim=32, n_layers=2, n_heads=2, max_seq_len=16, tie_embeddings=False))
    model.init_weights(0)
    policy = flashfsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    flashfsdp.fully_shard(model.tok_embeddings, mp_policy=policy)
    for layer in model.layers:
        flashfsdp.fully_shard(layer, mp_policy=policy)
    return flashfsdp.fully_shard(model, mp_policy=policy)


def _llama_loss(model, tokens):
    logits = model(tokens[:, :-1]).float()
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def _llama_runs(rank, world_size):
    gen = torch.Generator().manual_seed(rank)
    batches = [torch.randint(0, 256, (2, 17), generator=gen) for _ in range(STEPS)]
    return {str(dtype): _on_and_off(lambda: _llama(dtype), batches, _llama_loss)
            for dtype in (torch.float32, torch.bfloat16)}


# ----------------------------------------------------------------------------- small cases
class _SaveWeight(torch.autograd.Function):
    """Scales by a weight's mean, reading the saved weight in backward (not differentiated)."""

    @staticmethod
    def forward(ctx, h, weight):
        ctx.save_for_backward(weight)
        return h * weight.detach().mean()

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad * weight.mean(), None


def _mlp(variant: str):
    """``in_proj`` (a unit of its own) sees inputs that need no gradient: it elides unless the variant
    makes its backward read the weight."""
    torch.manual_seed(0)
    in_proj = nn.Sequential(nn.Linear(8, 16))
    model = nn.Sequential(in_proj, nn.Tanh(), nn.Linear(16, 4))
    if variant == "hook":  # a user hook on a module of the unit saves the weight for backward
        in_proj[0].register_forward_hook(lambda mod, args, out: _SaveWeight.apply(out, mod.weight))
    if variant == "checkpoint_wrapper":
        model[0] = in_proj = checkpoint_wrapper(in_proj)
    flashfsdp.fully_shard(in_proj)
    flashfsdp.fully_shard(model[2])
    flashfsdp.fully_shard(model)
    return model


def _mlp_loss(variant):
    def loss(model, batch):
        x, step = batch
        if variant == "outer_checkpoint":
            h = checkpoint(model[0], x, use_reentrant=False)
            return model[2](model[1](h)).square().mean()
        if variant == "second_step_input_grad" and step == 1:
            x = x.clone().requires_grad_()  # this step's linear saves its weight for dL/dx
        return model(x).square().mean()
    return loss


MLP_VARIANTS = ("plain", "hook", "checkpoint_wrapper", "outer_checkpoint", "second_step_input_grad")


def _mlp_runs(rank, world_size):
    gen = torch.Generator().manual_seed(rank)
    batches = [(torch.randn(4, 8, generator=gen), step) for step in range(STEPS)]
    return {v: _on_and_off(lambda: _mlp(v), batches, _mlp_loss(v)) for v in MLP_VARIANTS}


# ----------------------------------------------------------------------------- checks
def _assert_bit_identical(runs: dict) -> None:
    on, off = runs[True]["params"], runs[False]["params"]
    assert on.keys() == off.keys()
    for name in on:
        assert torch.equal(on[name], off[name]), f"{name} differs with elision"


def _elided(runs: dict, elide: bool = True) -> list[int]:
    return [c.get(ELIDED_COUNTER, 0) for c in runs[elide]["counters"]]


def _backward_bytes(runs: dict, elide: bool) -> list[int]:
    return [c.get("all_gather_bytes_backward", 0) for c in runs[elide]["counters"]]


def _all_runs(rank, world_size):
    return {"llama": _llama_runs(rank, world_size), "mlp": _mlp_runs(rank, world_size)}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_all_runs, 2)  # one spawn for every case


@pytest.fixture(scope="module")
def llama_results(results):
    return [r["llama"] for r in results]


@pytest.fixture(scope="module")
def mlp_results(results):
    return [r["mlp"] for r in results]


@pytest.mark.parametrize("dtype, itemsize", [("torch.float32", 4), ("torch.bfloat16", 2)])
def test_llama_embedding_unit_elides_bit_identically(llama_results, dtype, itemsize):
    embedding_bytes = 256 * 32 * itemsize  # vocab x dim in param_dtype (divisible by W)
    for result in llama_results:
        runs = result[dtype]
        _assert_bit_identical(runs)
        assert _elided(runs) == [embedding_bytes] * STEPS
        assert _elided(runs, elide=False) == [0] * STEPS
        saved = [off - on for on, off in zip(_backward_bytes(runs, True), _backward_bytes(runs, False))]
        assert saved == [embedding_bytes] * STEPS


def test_frozen_input_linear_elides(mlp_results):
    for result in mlp_results:
        runs = result["plain"]
        _assert_bit_identical(runs)
        assert _elided(runs) == [8 * 16 * 4 + 16 * 4] * STEPS  # in_proj's weight and bias, fp32


@pytest.mark.parametrize("variant", ["hook", "checkpoint_wrapper", "outer_checkpoint"])
def test_not_elided_when_backward_reads_or_recomputes(mlp_results, variant):
    for result in mlp_results:
        runs = result[variant]
        _assert_bit_identical(runs)
        assert _elided(runs) == [0] * STEPS
        assert _backward_bytes(runs, True) == _backward_bytes(runs, False)


def test_a_step_whose_forward_saves_the_weight_falls_back(mlp_results):
    for result in mlp_results:
        runs = result["second_step_input_grad"]
        _assert_bit_identical(runs)
        in_proj_bytes = 8 * 16 * 4 + 16 * 4
        assert _elided(runs) == [in_proj_bytes, 0, in_proj_bytes]


# ----------------------------------------------------------------------------- single process
def test_switch_errors(monkeypatch):
    model = flashfsdp.fully_shard(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="enabled must be a bool"):
        model.set_backward_all_gather_elision(1)
    with pytest.raises(ValueError, match="not a fully_shard'ed module"):
        flashfsdp.FSDPModule.set_backward_all_gather_elision(nn.Linear(2, 2), True)
    monkeypatch.setenv(ENV_VAR, "maybe")
    with pytest.raises(ValueError, match=ENV_VAR):
        default_enabled()
    monkeypatch.setenv(ENV_VAR, "0")
    assert not default_enabled()
    assert not flashfsdp.fully_shard(nn.Linear(2, 2))._flashfsdp_state.elision.enabled


def test_a_forward_that_raises_leaves_no_hooks():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    flashfsdp.fully_shard(model[0])
    flashfsdp.fully_shard(model)
    model[0].register_forward_hook(lambda *a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model(torch.randn(2, 4))
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


@pytest.mark.parametrize("keep", [False, True])
def test_a_unit_kept_after_backward_is_gathered_for_it(keep):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    flashfsdp.fully_shard(model[0])
    flashfsdp.fully_shard(model)
    model[0].set_reshard_after_backward(not keep)
    with flashfsdp.profile() as prof:
        model(torch.randn(2, 4)).sum().backward()
    state = model[0]._flashfsdp_state
    assert state.holds_unsharded is keep
    assert prof.summary()["counters"].get(ELIDED_COUNTER, 0) == (0 if keep else (16 + 4) * 4)


class _Projection(nn.Linear):
    def project(self, x):
        return nn.functional.linear(x, self.weight, self.bias) * 2


def _projection_grads(elide: bool) -> tuple:
    torch.manual_seed(0)
    model = nn.Sequential(_Projection(4, 4), nn.Linear(4, 4))
    flashfsdp.fully_shard(model[0])
    flashfsdp.fully_shard(model)
    flashfsdp.register_fsdp_forward_method(model[0], "project")
    model.set_backward_all_gather_elision(elide)
    model(torch.randn(2, 4))  # makes model the root
    with flashfsdp.profile() as prof:
        out = model[0].project(torch.randn(2, 4))
        assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
        out.sum().backward()
    return [p.grad.clone() for p in model[0].parameters()], prof.summary()["counters"].get(ELIDED_COUNTER, 0)


def test_a_registered_forward_method_is_watched_and_leaves_no_hooks():
    (grads, elided), (want, none) = _projection_grads(True), _projection_grads(False)
    assert elided == (16 + 4) * 4 and none == 0
    for got, ref in zip(grads, want):
        assert torch.equal(got, ref)


def test_a_unit_found_reading_its_parameters_is_not_watched_again_for_a_while():
    """A unit whose watched forward saved a parameter all-gathers for its backward without a watch
    for the next RECHECK_AFTER forwards whose inputs need gradients as that one's did (the watch's
    saved-tensor hooks cost nothing there), then is watched again; a unit that elides is watched
    at every forward; inputs that start needing gradients are watched at once."""
    from flashfsdp.bindings.elision import RECHECK_AFTER  # noqa: PLC0415

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    for layer in (model[0], model[2]):
        flashfsdp.fully_shard(layer, reshard_after_forward=True)
    flashfsdp.fully_shard(model)
    first, second = model[0]._flashfsdp_state, model[2]._flashfsdp_state

    def forward(x) -> tuple[bool, bool]:
        """One step; whether each layer's forward ran under a watch."""
        out = model(x)
        watched = (first.elision.needs.watched, second.elision.needs.watched)
        out.sum().backward()
        return watched

    seen = [forward(torch.randn(2, 4)) for _ in range(RECHECK_AFTER + 2)]
    # the first layer's input needs no gradient (its backward reads no weight, it elides): watched
    # at every forward; the second's does (its backward reads its weight): watched, then not for
    # RECHECK_AFTER forwards, then again
    assert [w for w, _ in seen] == [True] * (RECHECK_AFTER + 2)
    assert [w for _, w in seen] == [True] + [False] * RECHECK_AFTER + [True]
    # an input that needs a gradient: the first layer is watched (and found reading its weight)
    assert forward(torch.randn(2, 4, requires_grad=True)) == (True, False)
    assert forward(torch.randn(2, 4, requires_grad=True)) == (False, False)
    assert forward(torch.randn(2, 4)) == (True, False)  # no longer: watched again at once
