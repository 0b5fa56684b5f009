"""The names of `flashfsdp.models.Llama`'s parameters in transformers' `LlamaForCausalLM`.

=====================================  ===========================================
flashfsdp.models.Llama                 transformers LlamaForCausalLM
=====================================  ===========================================
tok_embeddings                         model.embed_tokens
layers.i.attention_norm / ffn_norm     model.layers.i.input_layernorm / post_attention_layernorm
layers.i.attention.wq wk wv wo         model.layers.i.self_attn.q_proj k_proj v_proj o_proj
layers.i.feed_forward.w1 w3 w2         model.layers.i.mlp.gate_proj up_proj down_proj
norm, output                           model.norm, lm_head (left out when tied)
=====================================  ===========================================

Only the names differ: the tensors are the same, element for element (`flashfsdp-train export`
writes them as they are, `--init-from` reads them back).
"""

from __future__ import annotations

from flashfsdp.models import LlamaConfig

# A block's parameters: ours (relative to `layers.i`) -> transformers' (relative to `model.layers.i`).
LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
# The root's parameters (outside the blocks): ours -> transformers'.
ROOT_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}


def block_names(layer: int) -> dict[str, str]:
    """Block `layer`'s parameters: our name relative to the block -> transformers' full name."""
    return {ours: f"model.layers.{layer}.{theirs}" for ours, theirs in LAYER_NAMES.items()}


def root_names(config: LlamaConfig) -> dict[str, str]:
    """The root's parameters: our name -> transformers' (no `output` / `lm_head` when tied)."""
    return {ours: theirs for ours, theirs in ROOT_NAMES.items()
            if not (config.tie_embeddings and ours == "output.weight")}


def hf_names(config: LlamaConfig) -> dict[str, str]:
    """Every parameter of `Llama(config)`: our full name -> transformers' full name, in the order
    transformers' state dict has them (embeddings, blocks, final norm, lm_head)."""
    names = {"tok_embeddings.weight": ROOT_NAMES["tok_embeddings.weight"]}
    for i in range(config.n_layers):
        names.update({f"layers.{i}.{ours}": theirs for ours, theirs in block_names(i).items()})
    names.update({k: v for k, v in root_names(config).items() if k != "tok_embeddings.weight"})
    return names
