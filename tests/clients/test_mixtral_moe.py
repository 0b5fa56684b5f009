"""A transformers Mixtral (sparse MoE: a top-2 router over stacked expert weights) sharded per
decoder layer with ``shard_placement_fn`` placing the experts off dim 0, then at the root, and
trained with the router's load-balancing loss.

Mixtral's ``MixtralExperts`` holds all experts of a layer in two 3-D parameters,
``gate_up_proj`` ``[experts, 2·intermediate, hidden]`` and ``down_proj`` ``[experts, hidden,
intermediate]``. Under expert parallelism, once its EP mesh has split dim 0 (the experts) and the
FSDP degree times the EP degree exceeds the number of experts, torchtitan has FSDP shard them along
dim 1 instead (``fully_shard(experts, shard_placement_fn=lambda p: Shard(1))``);
here the expert weights go on ``Shard(1)`` (or ``Shard(-1)``) both ways a client writes it — through
the decoder layer's ``shard_placement_fn`` (layer 0), and as torchtitan does, the experts a unit of
their own inside the layer's (layer 1) — every other parameter on FSDP2's default ``Shard(0)``.

1. ``Shard(1)``: three AdamW steps (the language-model loss plus ``router_aux_loss_coef`` times the
   load-balancing loss) against the unsharded model with gradients averaged over the ranks and,
   for flashfsdp, against torch's FSDP2 in the same ranks: losses, parameter, gradient and
   ``state_dict()`` types, placements, global and local shapes, gradient and parameter values,
   ``clip_grad_norm_``'s norm, and the full state dict from ``get_model_state_dict`` (its slices
   the local shards bit for bit), loaded back into a fresh sharded model with
   ``set_model_state_dict(..., broadcast_from_rank0=True)``.
2. ``Shard(-1)`` with an odd intermediate size: ``down_proj``'s last dim does not divide by W. torch's
   FSDP2 refuses uneven chunks off dim 0 (``NotImplementedError``; its case checks that it still
   does); flashfsdp shards them as ``torch.chunk`` does and runs the same training against the
   unsharded model.
3. DCP across implementations: a checkpoint torch's FSDP2 wrote (experts on ``Shard(1)``) loads into
   flashfsdp's sharding, and one flashfsdp wrote with uneven ``Shard(-1)`` experts loads resharded
   onto ``Shard(1)``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.tensor import DTensor, Shard

from tests.clients.common import (
    IMPLS,
    against_torch,
    assert_close_tree,
    assert_grads_contract,
    assert_params_contract,
    assert_same,
    assert_shards_of,
    assert_sharded_by,
    average_grads,
    describe,
    fsdp2_contract,
    fsdp_api,
    grads_summary,
    local_chunk,
    local_grads,
    local_params,
    params_summary,
    replicate,
    run,
    same_on_all_ranks,
    state_dict_summary,
)

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, MAX_NORM = 64, 8, 2, 0.5
# The Shard(1) case runs transformers' default experts kernel on CPU, ``grouped_mm``, which needs
# 16-byte-aligned weight strides (intermediate 12). The uneven case needs an odd dim, so an odd
# intermediate size (13: down_proj's dim 2 does not divide by W = 2; gate_up_proj's 2·13 and 16 do),
# run through the ``eager`` experts (a loop over the hit experts indexing the stacked weights).
EVEN, ODD = dict(intermediate=12, experts="grouped_mm"), dict(intermediate=13, experts="eager")


def tiny_mixtral(intermediate: int, experts: str):
    """A two-layer Mixtral: 4 experts, top-2 routing, router logits (and the aux loss) on;
    ``experts``: transformers' experts implementation."""
    torch.manual_seed(0)
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=16, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, num_local_experts=4, num_experts_per_tok=2,
        max_position_embeddings=32, output_router_logits=True, router_aux_loss_coef=0.02,
        tie_word_embeddings=False, experts_implementation=experts)
    model = transformers.MixtralForCausalLM(config)
    assert model.model.layers[0].mlp.experts.config._experts_implementation == experts
    return model


def expert_dims(model, dim: int) -> dict:
    """The shard dim (normalised) of each stacked expert weight, by name: what FSDP2 places them on."""
    return {n: dim % p.ndim for n, p in model.named_parameters() if ".mlp.experts." in n}


def shard_mixtral(model, api, dim: int):
    """Each decoder layer with its experts on ``Shard(dim)`` (the rest default), then the root.
    Layer 0 places them through the layer's own ``shard_placement_fn`` (one unit per layer); layer 1
    as torchtitan does, ``fully_shard(experts, shard_placement_fn=lambda p: Shard(dim))`` as a unit of
    its own, then the layer."""
    layer0, layer1 = model.model.layers
    experts = {id(p) for p in layer0.mlp.experts.parameters()}
    api.fully_shard(layer0, shard_placement_fn=lambda p: Shard(dim) if id(p) in experts else None)
    api.fully_shard(layer1.mlp.experts, shard_placement_fn=lambda p: Shard(dim))
    api.fully_shard(layer1)
    api.fully_shard(model)
    assert_sharded_by(model, api)
    return model


def _train_step(model, ref, idx, dims, rank):
    """One forward/backward/clip on the sharded and the unsharded model; the sharded model's
    loss, aux loss and norm (checked against the reference's)."""
    outs = [m(input_ids=idx, labels=idx) for m in (model, ref)]
    for o in outs:
        assert o.aux_loss is not None and o.aux_loss.item() > 0, "no router load-balancing loss"
        o.loss.backward()
    average_grads(ref)
    torch.testing.assert_close(outs[0].loss, outs[1].loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(outs[0].aux_loss, outs[1].aux_loss, rtol=1e-5, atol=1e-6)
    assert_grads_contract(model, ref, rank, dims)
    assert_shards_of(local_grads(model), ref, rank, "gradients", grads=True, dims=dims)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
    assert isinstance(norm, DTensor), type(norm)
    full_norm = norm.full_tensor()
    torch.testing.assert_close(full_norm, ref_norm, rtol=1e-5, atol=1e-6)
    assert full_norm > MAX_NORM and same_on_all_ranks(full_norm), full_norm  # the clip scales the gradients
    assert_shards_of(local_grads(model), ref, rank, "clipped gradients", grads=True, dims=dims)
    return outs[0].loss.detach(), outs[0].aux_loss.detach(), norm


def _moe_training(api, rank, dim, config, steps=3):
    """Shard a tiny Mixtral with ``api`` (experts on ``Shard(dim)``), train it ``steps`` AdamW steps
    next to the unsharded reference, check both state-dict round trips; what torch's FSDP2 and
    flashfsdp must agree on (types and values), by name."""
    model = tiny_mixtral(**config)
    ref = replicate(model)
    dims = expert_dims(model, dim)
    shard_mixtral(model, api, dim)
    assert_params_contract(model, ref, rank, dims)
    sd_contract = fsdp2_contract(ref.state_dict().items(), rank, parameter=False, dims=dims)
    assert_same(state_dict_summary(model.state_dict()), sd_contract, "state_dict() after fully_shard")
    out = {"params": params_summary(model), "losses": [], "aux": [], "norms": [], "grads": []}
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        idx = torch.randint(VOCAB, (BATCH, SEQ), generator=gen)
        loss, aux, norm = _train_step(model, ref, idx, dims, rank)
        out["grads"].append({"types": grads_summary(model), "values": local_grads(model)})
        out["losses"].append(loss)
        out["aux"].append(aux)
        out["norms"].append({"type": describe(norm), "value": norm.full_tensor()})
        for o in opts:
            o.step()
            o.zero_grad()
    assert_shards_of(local_params(model), ref, rank, f"parameters after {steps} steps", dims=dims)
    out["values"] = local_params(model)
    state_dict = model.state_dict()
    assert_same(state_dict_summary(state_dict), sd_contract, f"state_dict() after {steps} steps")
    out["state_dict"] = state_dict_summary(state_dict)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    assert_close_tree(dict(full), dict(ref.state_dict()), "full state dict")
    # Exactly the gathered shards: this rank's slice of each full value is its local shard, bit for bit.
    slices = {n: local_chunk(v, rank, dim=dims.get(n, 0)) for n, v in full.items()}
    assert_close_tree(slices, out["values"], "full state dict against the local shards", rtol=0, atol=0)
    # Loaded back into a fresh sharded model from rank 0's copy: the same shards, bit for bit.
    fresh = shard_mixtral(tiny_mixtral(**config), api, dim)
    set_model_state_dict(fresh, dict(full) if rank == 0 else {},
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    assert_same(params_summary(fresh), out["params"], "parameters after set_model_state_dict")
    assert_close_tree(local_params(fresh), out["values"], "shards loaded from the full state dict", rtol=0, atol=0)
    return out


def _shard_dim1_case(rank, world_size, impl):
    against_torch(impl, _moe_training, rank, 1, EVEN)


def _uneven_case(rank, world_size, impl):
    if impl == "torch":
        model = tiny_mixtral(**ODD)
        with pytest.raises(NotImplementedError, match="uneven sharding on dim 2"):
            shard_mixtral(model, fsdp_api("torch"), -1)
    else:
        _moe_training(fsdp_api(impl), rank, -1, ODD)


def _perturbed(model, scale: float):
    """``model`` with every parameter scaled in place (values no fresh model has)."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model


def _dcp_case(rank, world_size, path):
    torch_api, flash = fsdp_api("torch"), fsdp_api("flashfsdp")
    # Written by torch's FSDP2 (experts on Shard(1)), read by flashfsdp with the same placements.
    src = _perturbed(shard_mixtral(tiny_mixtral(**EVEN), torch_api, 1), 3.0)
    dcp.save(src.state_dict(), checkpoint_id=f"{path}/torch")
    dst = shard_mixtral(tiny_mixtral(**EVEN), flash, 1)
    state_dict = dst.state_dict()
    dcp.load(state_dict, checkpoint_id=f"{path}/torch")
    dst.load_state_dict(state_dict)
    assert_same(params_summary(dst), params_summary(src), "parameters loaded from torch's checkpoint")
    assert_close_tree(local_params(dst), local_params(src), "shards loaded from torch's checkpoint", rtol=0, atol=0)
    # Written by flashfsdp with uneven Shard(-1) experts, read back resharded on Shard(1).
    uneven = _perturbed(shard_mixtral(tiny_mixtral(**ODD), flash, -1), 3.0)
    dcp.save(uneven.state_dict(), checkpoint_id=f"{path}/uneven")
    resharded = shard_mixtral(tiny_mixtral(**ODD), flash, 1)
    state_dict = resharded.state_dict()
    dcp.load(state_dict, checkpoint_id=f"{path}/uneven")
    resharded.load_state_dict(state_dict)
    for (name, p), q in zip(uneven.named_parameters(), resharded.parameters()):
        assert q.placements == (Shard(1 if ".mlp.experts." in name else 0),), (name, q.placements)
        torch.testing.assert_close(q.full_tensor(), p.full_tensor(), rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("impl", IMPLS)
def test_mixtral_experts_on_shard_dim1(impl):
    """Mixtral's stacked expert weights on ``Shard(1)`` (torchtitan's FSDP placement under expert
    parallelism), the rest on ``Shard(0)``: types, placements and shapes of parameters, gradients
    and ``state_dict()`` values as FSDP2 gives them; three AdamW steps with the router aux loss and
    ``clip_grad_norm_`` give the unsharded model's losses, norms, gradients and parameters (and,
    for flashfsdp, torch's FSDP2's); the full state dict is the unsharded model's."""
    run(_shard_dim1_case, impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_mixtral_experts_on_uneven_last_dim(impl):
    """Expert weights on ``Shard(-1)``, ``down_proj``'s last dim (13) uneven over W = 2: torch's
    FSDP2 raises ``NotImplementedError``; flashfsdp shards it as ``torch.chunk`` does (7 and 6
    columns) and trains it as the unsharded model, with FSDP2's types for the rest."""
    run(_uneven_case, impl)


def test_mixtral_dcp_checkpoint_across_implementations(tmp_path):
    """A DCP checkpoint of the Mixtral with experts on ``Shard(1)`` written by torch's FSDP2 loads
    into flashfsdp's sharding of it shard for shard; one flashfsdp wrote with uneven ``Shard(-1)``
    experts loads resharded onto ``Shard(1)`` with the same full values."""
    run(_dcp_case, str(tmp_path))
