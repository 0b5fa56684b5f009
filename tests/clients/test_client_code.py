"""Training-script code (no extra library) that runs on FSDP2 as written: nanoGPT's optimizer groups,
torchtitan's clipping and ``FSDPModule`` gates, a ``torch.save`` of ``state_dict()`` read back by a
process that never imports flashfsdp, ``checkpoint_wrapper`` units and the full state dict of
``torch.distributed.checkpoint.state_dict``, stock AdamW (foreach and fused).

Each case runs with torch's FSDP2 and, for ``flashfsdp``, again with only the import swapped
(:func:`tests.clients.common.against_torch`); see ``common.py`` for the contract checked.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
from torch.distributed.tensor import DTensor

from tests.clients.common import (
    IMPLS,
    against_torch,
    assert_close_tree,
    assert_grads_contract,
    assert_params_contract,
    assert_same,
    assert_shards_of,
    average_grads,
    batches,
    describe,
    fsdp2_contract,
    fsdp_api,
    local,
    local_chunk,
    local_grads,
    local_params,
    replicate,
    run,
    same_on_all_ranks,
    shard_gpt,
    state_dict_summary,
    tiny_gpt,
)


# ------------------------------------------------------------------ nanoGPT's configure_optimizers + AdamW
def configure_optimizers(model: nn.Module, weight_decay: float, learning_rate: float, **adamw_kwargs):
    """nanoGPT's ``GPT.configure_optimizers`` as written (the fused switch is a parameter here):
    2-D and larger parameters decay, biases and norms do not. Returns the optimizer and, per group,
    the count of tensors, of their elements (nanoGPT prints both) and their names."""
    param_dict = {pn: p for pn, p in model.named_parameters()}
    param_dict = {pn: p for pn, p in param_dict.items() if p.requires_grad}
    decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
    nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
    optim_groups = [
        {"params": decay_params, "weight_decay": weight_decay},
        {"params": nodecay_params, "weight_decay": 0.0},
    ]
    num_decay_params = sum(p.numel() for p in decay_params)
    num_nodecay_params = sum(p.numel() for p in nodecay_params)
    optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate, betas=(0.9, 0.95), **adamw_kwargs)
    groups = {
        "decay": (len(decay_params), num_decay_params, [n for n, p in param_dict.items() if p.dim() >= 2]),
        "nodecay": (len(nodecay_params), num_nodecay_params, [n for n, p in param_dict.items() if p.dim() < 2]),
    }
    return optimizer, groups


def _nanogpt_training(api, rank, variant, steps=3):
    model = tiny_gpt()
    ref = replicate(model)
    shard_gpt(model, api)
    assert_params_contract(model, ref, rank)
    opt, groups = configure_optimizers(model, 0.1, 1e-2, **{variant: True})
    ref_opt, ref_groups = configure_optimizers(ref, 0.1, 1e-2, **{variant: True})
    assert groups == ref_groups, f"parameter groups {groups} differ from the unsharded model's {ref_groups}"
    assert groups["decay"][1] + groups["nodecay"][1] == sum(p.numel() for p in ref.parameters())
    losses = []
    for idx, targets in batches(model, rank, steps):
        loss, ref_loss = model(idx, targets), ref(idx, targets)
        loss.backward()
        ref_loss.backward()
        average_grads(ref)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert_grads_contract(model, ref, rank)
        assert_shards_of(local_grads(model), ref, rank, "gradients", grads=True)
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad()
        losses.append(loss.detach())
    assert_shards_of(local_params(model), ref, rank, f"parameters after {steps} AdamW({variant}) steps")
    exp_avg = {n: describe(opt.state[p]["exp_avg"]) for n, p in model.named_parameters()}
    assert_same(exp_avg, fsdp2_contract(ref.named_parameters(), rank, parameter=False), "AdamW exp_avg state")
    return {"groups": groups, "losses": losses, "params": local_params(model), "exp_avg": exp_avg}


def _nanogpt_case(rank, world_size, impl, variant):
    against_torch(impl, _nanogpt_training, rank, variant)


@pytest.mark.parametrize("variant", ["foreach", "fused"])
@pytest.mark.parametrize("impl", IMPLS)
def test_nanogpt_param_groups_and_stock_adamw(impl, variant):
    """nanoGPT splits parameters into weight-decay groups by ``p.dim() >= 2`` and prints
    ``sum(p.numel())`` per group: on sharded parameters both must read the global shapes (a flat
    1-D shard would put every matrix in the no-decay group). Three steps of stock
    ``torch.optim.AdamW`` (foreach, fused) on those groups must then match the unsharded model
    (gradients averaged over the ranks) and torch's FSDP2, and the optimizer state must be DTensors."""
    run(_nanogpt_case, impl, variant)


# ------------------------------------------------------------------ gradient clipping
MAX_NORM = 0.05


def _clipping(api, rank, way):
    model = tiny_gpt()
    ref = replicate(model)
    shard_gpt(model, api)
    assert_params_contract(model, ref, rank)
    idx, targets = batches(model, rank, 1)[0]
    model(idx, targets).backward()
    ref(idx, targets).backward()
    average_grads(ref)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    assert ref_norm > MAX_NORM, "the case must clip"
    params = list(model.parameters())
    if way == "torchtitan":  # torchtitan.distributed.utils.clip_grad_norm_ (no pipeline parallelism)
        grads = [p.grad for p in params if p.grad is not None]
        total_norm = torch.nn.utils.get_total_norm(grads, 2.0, False, True)
        returned = describe(total_norm)
        if isinstance(total_norm, DTensor):
            total_norm = total_norm.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, total_norm, True)
    else:
        total_norm = torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
        returned = describe(total_norm)
        total_norm = total_norm.full_tensor() if isinstance(total_norm, DTensor) else total_norm
    # On DTensor gradients the norm comes back as a replicated 0-d DTensor: clients call full_tensor().
    assert_same(returned, {"type": "DTensor", "parameter": False, "dtensor": True, "placements": ("Replicate()",),
                           "mesh_shape": (2,), "shape": (), "local_shape": (), "dtype": "torch.float32"},
                "the returned total norm")
    torch.testing.assert_close(total_norm, ref_norm, rtol=1e-5, atol=1e-6)
    assert same_on_all_ranks(total_norm), "the total norm differs between ranks"
    assert_shards_of(local_grads(model), ref, rank, "clipped gradients", grads=True)
    return {"norm": total_norm, "grads": local_grads(model)}


def _clipping_case(rank, world_size, impl, way):
    against_torch(impl, _clipping, rank, way)


@pytest.mark.parametrize("way", ["torchtitan", "stock"])
@pytest.mark.parametrize("impl", IMPLS)
def test_grad_clipping_sees_the_global_norm(impl, way):
    """``torch.nn.utils.get_total_norm`` + ``clip_grads_with_norm_`` (torchtitan's clipping) and the
    stock ``clip_grad_norm_``: the norm is the unsharded model's (all ranks' gradients), the same on
    every rank, returned as FSDP2 returns it, and the clipped gradients are the unsharded model's
    clipped ones. On plain per-rank shards the stock functions would see only the local norm."""
    run(_clipping_case, impl, way)


# ------------------------------------------------------------------ isinstance(m, FSDPModule) gates
def _gated_accumulation(api, rank):
    model = tiny_gpt()
    ref = replicate(model)
    shard_gpt(model, api)
    units = [name for name, m in model.named_modules() if isinstance(m, TorchFSDPModule)]
    assert units == ["", "h.0", "h.1"], f"modules passing isinstance(m, torch's FSDPModule): {units}"
    gated = [m for m in model.modules() if isinstance(m, TorchFSDPModule)]
    for m in gated:  # torchtitan: disable_fsdp_gradient_division (it scales the loss itself)
        m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM: a plain sum, divided after
        m.set_gradient_divide_factor(1.0)
    micro = batches(model, rank, 2)
    for i, (idx, targets) in enumerate(micro):
        last = i == len(micro) - 1
        for m in gated:  # gradient accumulation: no reduce-scatter before the last micro-batch
            m.set_requires_gradient_sync(last, recurse=False)
            m.set_is_last_backward(last)
        model(idx, targets).backward()
        ref(idx, targets).backward()
        if not last:  # resharded after backward, with the unreduced gradients kept aside
            assert_params_contract(model, ref, rank)
            assert all(p.grad is None for p in model.parameters()), \
                "a gradient was reduced into the sharded parameters while gradient sync was off"
    average_grads(ref, divide=False)  # divide factor 1: the sum over ranks
    assert_grads_contract(model, ref, rank)
    assert_shards_of(local_grads(model), ref, rank, "accumulated gradients (summed over ranks)", grads=True)
    return {"units": units, "grads": local_grads(model)}


def _gates_case(rank, world_size, impl):
    against_torch(impl, _gated_accumulation, rank)


@pytest.mark.parametrize("impl", IMPLS)
def test_fsdp_module_isinstance_gates(impl):
    """torchtitan and accelerate find the units with ``isinstance(m, torch.distributed.fsdp.FSDPModule)``
    and call FSDP2's methods on each: ``set_force_sum_reduction_for_comms(True)`` and
    ``set_gradient_divide_factor(1.0)`` (gradients summed, not averaged), then per micro-batch ``set_requires_gradient_sync`` and ``set_is_last_backward``. The same modules must pass the check, no gradient may reach the
    sharded parameters while sync is off, and after the last micro-batch the gradients are the sum
    over micro-batches and ranks."""
    run(_gates_case, impl)


# ------------------------------------------------------------------ torch.save(state_dict()) read without flashfsdp
# Run by a fresh interpreter: torch.distributed.tensor is what torch.load(weights_only=True) needs for DTensors.
_FRESH_LOAD = r"""
import sys
import torch
import torch.distributed.tensor
out, paths = sys.argv[1], sys.argv[2:]
loaded = {}
for path in paths:
    sd = torch.load(path, weights_only=True)
    loaded[path] = {k: (type(v).__name__, tuple(repr(p) for p in getattr(v, "placements", ())), tuple(v.shape),
                        v.to_local() if hasattr(v, "to_local") else v) for k, v in sd.items()}
assert "flashfsdp" not in sys.modules, "the fresh process imported flashfsdp"
torch.save(loaded, out)
"""


def _train_one_step(model, ref, rank):
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    idx, targets = batches(model, rank, 1)[0]
    for m, o in zip((model, ref), opts):
        m(idx, targets).backward()
    average_grads(ref)
    for o in opts:
        o.step()


def _save_state_dict(rank, world_size, impls, out_dir):
    for impl in impls:
        model = tiny_gpt()
        ref = replicate(model)
        shard_gpt(model, fsdp_api(impl))
        _train_one_step(model, ref, rank)
        sd = model.state_dict()
        assert_same(state_dict_summary(sd), fsdp2_contract(ref.state_dict().items(), rank, parameter=False),
                    f"{impl}: state_dict() values")
        torch.save(sd, os.path.join(out_dir, f"{impl}_rank{rank}.pt"))
    return {k: v.clone() for k, v in ref.state_dict().items()}


@pytest.mark.parametrize("impl", IMPLS)
def test_saved_state_dict_loads_in_a_process_without_flashfsdp(impl, tmp_path):
    """``torch.save(model.state_dict(), path)`` on each rank, then ``torch.load(path,
    weights_only=True)`` in a fresh interpreter that never imports flashfsdp (a checkpoint read by
    an evaluation job or another framework): every value loads as a DTensor ``(Shard(0),)`` of the
    global shape, its local shard is the rank's rows of the unsharded model after the same step,
    and, for flashfsdp, the files read as torch's FSDP2's do."""
    impls = ["torch"] if impl == "torch" else ["torch", impl]
    ref_sd = run(_save_state_dict, impls, str(tmp_path))[0]
    paths = [str(tmp_path / f"{i}_rank{r}.pt") for i in impls for r in range(2)]
    out = tmp_path / "loaded.pt"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _FRESH_LOAD, str(out), *paths], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-4000:]
    loaded = torch.load(out, weights_only=False)
    for i in impls:
        for r in range(2):
            got = loaded[str(tmp_path / f"{i}_rank{r}.pt")]
            assert list(got) == list(ref_sd), f"{i} rank {r}: keys {list(got)} vs {list(ref_sd)}"
            for k, full in ref_sd.items():
                kind, placements, shape, value = got[k]
                assert (kind, placements, shape) == ("DTensor", ("Shard(dim=0)",), tuple(full.shape)), \
                    f"{i} rank {r} {k}: loaded as {kind} {placements} {shape}"
                torch.testing.assert_close(value, local_chunk(full, r), rtol=1e-5, atol=1e-6,
                                           msg=lambda m, i=i, r=r, k=k: f"{i} rank {r} {k}: {m}")
            if i != "torch":
                assert_close_tree({k: v[3] for k, v in got.items()},
                                  {k: v[3] for k, v in loaded[str(tmp_path / f"torch_rank{r}.pt")].items()},
                                  f"{i} rank {r} against torch's FSDP2")


# ------------------------------------------------------------------ checkpoint_wrapper units, full state dict
_WRAPPED = "_checkpoint_wrapped_module."


def _checkpointed_full_state_dict(api, rank, steps=2):
    model = tiny_gpt()
    ref = replicate(model)
    for i, block in enumerate(model.h):  # activation checkpointing first, then fully_shard (torchtitan's order)
        model.h[i] = checkpoint_wrapper(block)
    shard_gpt(model, api)
    summary = {n.replace(_WRAPPED, ""): describe(p) for n, p in model.named_parameters()}
    assert_same(summary, fsdp2_contract(ref.named_parameters(), rank), "parameters of checkpoint-wrapped units")
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    for idx, targets in batches(model, rank, steps):
        for m in (model, ref):
            m(idx, targets).backward()
        average_grads(ref)
        for o in opts:
            o.step()
            o.zero_grad()
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    want = ref.state_dict()
    assert list(full) == list(want), f"full state dict keys {list(full)} vs the unsharded model's {list(want)}"
    assert_same(state_dict_summary(full), state_dict_summary(want), "full state dict values")
    assert_close_tree(dict(full), dict(want), "full state dict against the unsharded model")
    sharded = get_model_state_dict(model)
    assert_same(state_dict_summary(sharded), fsdp2_contract(want.items(), rank, parameter=False),
                "sharded get_model_state_dict values")
    return {"full": {k: v.clone() for k, v in full.items()}, "sharded": {k: local(v) for k, v in sharded.items()}}


def _checkpointed_case(rank, world_size, impl):
    against_torch(impl, _checkpointed_full_state_dict, rank)


@pytest.mark.parametrize("impl", IMPLS)
def test_checkpoint_wrapper_units_full_state_dict(impl):
    """Blocks wrapped in torch's ``checkpoint_wrapper`` before ``fully_shard`` (torchtitan's and
    accelerate's order) train like the unsharded model, and
    ``get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))`` gives the
    unsharded model's keys (the wrapper's prefix removed), full shapes and values; the sharded
    ``get_model_state_dict`` gives DTensors."""
    run(_checkpointed_case, impl)
