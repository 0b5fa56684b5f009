"""PEFT LoRA on a transformers Llama, sharded per decoder layer and at the root as FSDP2 users do,
trained, then merged with ``merge_and_unload()`` both ways that work on torch's FSDP2.

1. In place on the sharded model: LoRA's merge is DTensor arithmetic on the sharded base weight
   and the sharded A/B factors; the merged weights stay ``(Shard(0),)`` DTensors, a forward through
   the still-sharded root gives the merged model's logits, and ``get_model_state_dict(merged,
   full_state_dict=True)`` the merged full weights.
2. Gathered first: ``get_model_state_dict(peft_model, full_state_dict=True)`` loaded into a fresh
   unsharded PEFT model, merged there (what an export script on one process does).

Both are compared with the unsharded PEFT model trained on the same data (gradients averaged over
the ranks) and merged, and, for flashfsdp, with torch's FSDP2 in the same ranks.
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

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
    fsdp2_contract,
    local_grads,
    local_params,
    params_summary,
    replicate,
    run,
)

peft = pytest.importorskip("peft", reason="peft: pip install -e .[clients]")
transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 8


def lora_llama():
    """A two-layer Llama (odd sizes: W = 2 shards uneven) with LoRA on q_proj and v_proj."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=36, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                                      tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, lora)


def _lora_training(api, rank, steps=3):
    model = lora_llama()
    ref = replicate(model)
    for layer in model.base_model.model.model.layers:
        api.fully_shard(layer)
    api.fully_shard(model)
    assert_sharded_by(model, api)
    assert_params_contract(model, ref, rank)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [n for n, p in ref.named_parameters() if p.requires_grad] and trainable, trainable
    assert all("lora_" in n for n in trainable), trainable
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (model, ref)]
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        idx = torch.randint(VOCAB, (2, SEQ), generator=gen)
        loss, ref_loss = (m(input_ids=idx, labels=idx).loss for m in (model, ref))
        loss.backward()
        ref_loss.backward()
        average_grads(ref)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
        assert_grads_contract(model, ref, rank)  # LoRA factors only: frozen weights get none
        assert_shards_of(local_grads(model), ref, rank, "LoRA gradients", grads=True)
        for o in opts:
            o.step()
            o.zero_grad()
        losses.append(loss.detach())
    assert_shards_of(local_params(model), ref, rank, f"parameters after {steps} steps")

    # Gathered first, merged on one process.
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    fresh = lora_llama()
    fresh.load_state_dict(full)
    gathered_merged = fresh.merge_and_unload()

    # Merged in place on the sharded model.
    ref_merged = ref.merge_and_unload()
    merged = model.merge_and_unload()
    assert_same(params_summary(merged), fsdp2_contract(ref_merged.named_parameters(), rank),
                "parameters after merge_and_unload on the sharded model")
    merged_shards = local_params(merged)
    assert_shards_of(merged_shards, ref_merged, rank, "merged weights")
    merged_full = get_model_state_dict(merged, options=StateDictOptions(full_state_dict=True))
    assert_close_tree(dict(merged_full), dict(ref_merged.state_dict()), "merged full state dict")
    assert_close_tree(dict(gathered_merged.state_dict()), dict(ref_merged.state_dict()),
                      "merged after gathering the full state dict")
    idx = torch.randint(VOCAB, (2, SEQ), generator=gen)
    with torch.no_grad():
        # Through the sharded root, now holding the merged model (the root stays unsharded after it).
        logits = model(input_ids=idx).logits
        want = ref_merged(input_ids=idx).logits
        torch.testing.assert_close(logits, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gathered_merged(input_ids=idx).logits, want, rtol=1e-5, atol=1e-5)
    return {"losses": losses, "merged": merged_shards, "logits": logits}


def _lora_case(rank, world_size, impl):
    against_torch(impl, _lora_training, rank)


@pytest.mark.parametrize("impl", IMPLS)
def test_lora_trains_and_merges(impl):
    """PEFT LoRA under ``fully_shard`` (per decoder layer, then the PeftModel root): frozen base
    weights and trainable LoRA factors are all ``(Shard(0),)`` DTensors, only the factors get
    (DTensor) gradients, three AdamW steps match the unsharded model, and ``merge_and_unload()``
    works in place on the sharded model and on a gathered full state dict, with the unsharded
    merged model's weights and logits."""
    run(_lora_case, impl)
