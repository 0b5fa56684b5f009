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


_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object",
               type(None): "null"}
_REQUIRED = object()


def _bad(key: str, value, wanted: str, where: str) -> UsageError:
    """The one-line error of config.json field `key` holding `value` where `wanted` belongs."""
    kind = _JSON_TYPES.get(type(value), type(value).__name__)
    return UsageError(f"--init-from {where}: {key} must be {wanted}, got {json.dumps(value)} (a JSON {kind}); "
                      "fix it in config.json")


def _positive_int(config: dict, key: str, where: str, default=_REQUIRED) -> int | None:
    """`config[key]` as a positive int (None where absent or null and `default` is None)."""
    if key not in config and default is _REQUIRED:
        raise UsageError(f"--init-from {where}: no {key!r}; is it a LlamaForCausalLM config?")
    value = config.get(key, default)
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise _bad(key, value, "a positive integer" + (" (or null)" if default is None else ""), where)
    return value


def _positive_number(value, key: str, where: str) -> float:
    """`value` (of `key`) as a positive, finite float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
        raise _bad(key, value, "a positive number", where)
    return float(value)


def _boolean(config: dict, key: str, where: str, default: bool) -> bool:
    """`config[key]` as a bool (`default` where absent)."""
    value = config.get(key, default)
    if not isinstance(value, bool):
        raise _bad(key, value, "true or false", where)
    return value


def _rope_theta(config: dict, where: str) -> float:
    """The rotary base of `config`, refusing scaled rotary variants."""
    rope = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling")
    kind = rope.get("rope_type", "default") if isinstance(rope, dict) else None
    if kind != "default" or scaling not in (None, {}):
        raise UsageError(f"--init-from {where}: rotary type {kind or scaling!r} is not supported "
                         "(only the default rotary embeddings); fine-tune it with transformers")
    key = "rope_parameters.rope_theta" if "rope_theta" in rope else "rope_theta"
    return _positive_number(rope.get("rope_theta", config.get("rope_theta", 10000.0)), key, where)


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
    heads, hidden = _positive_int(config, "num_attention_heads", where), _positive_int(config, "hidden_size", where)
    head_dim = _positive_int(config, "head_dim", where, default=None)
    if head_dim is not None and head_dim * heads != hidden:
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
            field); a field missing, of the wrong JSON type or sign (e.g. "intermediate_size":
            "5632", a negative hidden_size: named with its value), or making an invalid model.
    """
    config = read_hf_config(folder)
    where = os.path.join(folder, CONFIG_FILE)
    _check_llama(config, where)
    sizes = {key: _positive_int(config, key, where) for key in (
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
        "max_position_embeddings")}
    try:
        return LlamaConfig(
            vocab_size=sizes["vocab_size"], dim=sizes["hidden_size"], n_layers=sizes["num_hidden_layers"],
            n_heads=sizes["num_attention_heads"],
            n_kv_heads=_positive_int(config, "num_key_value_heads", where, default=None),
            ffn_dim=sizes["intermediate_size"], max_seq_len=seq_len or sizes["max_position_embeddings"],
            norm_eps=_positive_number(config.get("rms_norm_eps", 1e-6), "rms_norm_eps", where),
            rope_theta=_rope_theta(config, where),
            tie_embeddings=_boolean(config, "tie_word_embeddings", where, default=False))
    except ValueError as err:
        raise UsageError(f"--init-from {where}: {err}") from None
