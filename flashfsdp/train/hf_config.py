"""A transformers `LlamaForCausalLM` folder's `config.json` as the job's `LlamaConfig` (--init-from).

Read as plain JSON (no transformers needed), so `TrainConfig.model` can describe the model on
every rank before anything is loaded. Only what `flashfsdp.models.Llama` computes exactly as
transformers' Llama is accepted: SiLU, no biases, default rotary embeddings (the `rope_theta` of
transformers < 5 or the `rope_parameters` of 5), head size hidden_size / heads. Anything else is
refused with the field named, rather than trained as a different model.
"""

from __future__ import annotations

import json
import os

from flashfsdp.models import LlamaConfig
from flashfsdp.train.errors import UsageError

CONFIG_FILE = "config.json"


def read_hf_config(folder: str) -> dict:
    """The JSON object of `<folder>/config.json`.

    Raises:
        UsageError: the folder or its config.json is missing, or is not a JSON object (names
            --init-from and the path).
    """
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isdir(folder):
        raise UsageError(f"--init-from {folder}: no such directory; give a transformers model folder "
                         "(config.json + model.safetensors)")
    try:
        with open(path, encoding="utf-8") as fh:
            config = json.load(fh)
    except FileNotFoundError:
        raise UsageError(f"--init-from {folder}: no {CONFIG_FILE}; give a folder saved by "
                         "save_pretrained or flashfsdp-train export") from None
    except (OSError, ValueError) as err:
        raise UsageError(f"--init-from {path}: not readable as JSON ({err})") from None
    if not isinstance(config, dict):
        raise UsageError(f"--init-from {path}: not a JSON object")
    return config


def _rope_theta(config: dict, where: str) -> float:
    """The rotary base of `config`, refusing scaled rotary variants."""
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling")
    kind = rope.get("rope_type", "default") if isinstance(rope, dict) else None
    if kind != "default" or scaling not in (None, {}):
        raise UsageError(f"--init-from {where}: rotary type {kind or scaling!r} is not supported "
                         "(only the default rotary embeddings); fine-tune it with transformers")
    theta = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    return float(theta)


def _check_llama(config: dict, where: str) -> None:
    """Refuse a config that is not a Llama `flashfsdp.models.Llama` computes exactly."""
    if config.get("model_type") != "llama":
        raise UsageError(f"--init-from {where}: model_type {config.get('model_type')!r}; only transformers' "
                         "Llama (model_type 'llama', LlamaForCausalLM) can be loaded")
    checks = (("hidden_act", "silu"), ("attention_bias", False), ("mlp_bias", False))
    for key, wanted in checks:
        if config.get(key, wanted) != wanted:
            raise UsageError(f"--init-from {where}: {key} = {config.get(key)!r} is not supported "
                             f"(only {wanted!r})")
    heads, hidden = config.get("num_attention_heads"), config.get("hidden_size")
    head_dim = config.get("head_dim")
    if head_dim is not None and isinstance(heads, int) and heads and head_dim * heads != hidden:
        raise UsageError(f"--init-from {where}: head_dim {head_dim} x {heads} heads != hidden_size "
                         f"{hidden}; only head_dim = hidden_size / heads is supported")


def llama_config(folder: str, seq_len: int | None = None) -> LlamaConfig:
    """The `LlamaConfig` of the transformers Llama in `folder`.

    Args:
        folder: the --init-from directory.
        seq_len: the training sequence length (--seq-len), or None for the model's
            max_position_embeddings.

    Raises:
        UsageError: see `read_hf_config`; a model that is not a plain Llama (the message names the
            field); a field missing or invalid.
    """
    config = read_hf_config(folder)
    where = os.path.join(folder, CONFIG_FILE)
    _check_llama(config, where)
    try:
        return LlamaConfig(
            vocab_size=config["vocab_size"], dim=config["hidden_size"], n_layers=config["num_hidden_layers"],
            n_heads=config["num_attention_heads"], n_kv_heads=config.get("num_key_value_heads"),
            ffn_dim=config["intermediate_size"], max_seq_len=seq_len or config["max_position_embeddings"],
            norm_eps=float(config.get("rms_norm_eps", 1e-6)), rope_theta=_rope_theta(config, where),
            tie_embeddings=bool(config.get("tie_word_embeddings", False)))
    except KeyError as err:
        raise UsageError(f"--init-from {where}: no {err.args[0]!r}; is it a LlamaForCausalLM config?") from None
    except ValueError as err:
        raise UsageError(f"--init-from {where}: {err}") from None
