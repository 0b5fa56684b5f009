"""--init-from: a transformers `LlamaForCausalLM` folder's weights loaded into the sharded model,
one unit at a time.

Every rank reads, for each block and then for the root's own parameters (embeddings, final norm,
untied output), only that unit's tensors from the safetensors files (`safe_open`, tensor by
tensor; one file or a `model.safetensors.index.json` of several), and hands them to the unit's
module as full tensors: `module.load_state_dict(tensors, strict=False)` on a `fully_shard`ed
module copies this rank's elements into its shards. A rank therefore holds at most one unit's full
tensors besides its shards, never the whole model. The tensors are cast to the parameters' dtype
(a bfloat16 checkpoint into fp32 master weights), and renamed by `flashfsdp.train.hf_names`.
"""

from __future__ import annotations

import json
import os

import torch
from flashfsdp.bindings.state_dict import INDEX_FILE, SINGLE_FILE
from flashfsdp.log import get_logger
from flashfsdp.models import Llama, LlamaConfig
from flashfsdp.train.errors import UsageError
from flashfsdp.train.hf_names import block_names, root_names

_log = get_logger(__name__)


def weight_files(folder: str) -> dict[str, str]:
    """Which safetensors file of `folder` holds each tensor: {transformers name: file path}.

    Raises:
        UsageError: neither model.safetensors nor model.safetensors.index.json is in `folder`
            (e.g. a PyTorch .bin checkpoint), or the index is not readable (names --init-from).
    """
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as fh:
                weight_map = json.load(fh)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UsageError(f"--init-from {index}: not a safetensors index ({err})") from None
        return {name: os.path.join(folder, file) for name, file in weight_map.items()}
    single = os.path.join(folder, SINGLE_FILE)
    if not os.path.isfile(single):
        raise UsageError(f"--init-from {folder}: no {SINGLE_FILE} or {INDEX_FILE}; save the model with "
                         "save_pretrained (safetensors, the default) or flashfsdp-train export")
    from safetensors import safe_open  # noqa: PLC0415 - the hf extra

    with safe_open(single, framework="pt") as fh:
        return {name: single for name in fh.keys()}


def _read(files: dict[str, str], names: dict[str, str], folder: str) -> dict[str, torch.Tensor]:
    """{our name: tensor} of `names` ({our name: transformers name}), each read on its own."""
    from safetensors import safe_open  # noqa: PLC0415

    missing = [theirs for theirs in names.values() if theirs not in files]
    if missing:
        raise UsageError(f"--init-from {folder}: the weights have no {missing[0]} (and {len(missing) - 1} "
                         "more missing); the folder does not hold this config's model")
    out = {}
    for ours, theirs in names.items():
        with safe_open(files[theirs], framework="pt") as fh:
            out[ours] = fh.get_tensor(theirs)
    return out


def _full_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Each parameter's full shape in `Llama(config)` (built on the meta device)."""
    with torch.device("meta"):
        return {name: tuple(p.shape) for name, p in Llama(config).named_parameters()}


def _check_shapes(tensors: dict[str, torch.Tensor], prefix: str, shapes: dict[str, tuple[int, ...]],
                  where: str) -> None:
    """Each tensor's shape must be its parameter's (`prefix` + name) in the config's model."""
    for name, tensor in tensors.items():
        expected = shapes.get(prefix + name)
        if expected is not None and tuple(tensor.shape) != expected:
            raise UsageError(f"--init-from {where}: {prefix + name} has shape {tuple(tensor.shape)}, the "
                             f"model of its config.json has {expected}")


def load_pretrained(model: Llama, folder: str, config: LlamaConfig) -> int:
    """Load the transformers Llama weights of `folder` into the sharded `model`, unit by unit.

    Every rank calls it (it communicates nothing: each rank copies its own elements).

    Args:
        model: the sharded `Llama` of `config`, materialised (`to_empty`), before its first forward.
        folder: the --init-from directory (its config.json gave `config`).
        config: the model's shape.

    Returns:
        The number of parameter elements loaded.

    Raises:
        UsageError: no safetensors weights in `folder`, a tensor missing, or a shape that is not
            the config's (the message names the tensor).
    """
    files, shapes = weight_files(folder), _full_shapes(config)
    loaded = 0
    for i, block in enumerate(model.layers):
        tensors = _read(files, block_names(i), folder)
        _check_shapes(tensors, f"layers.{i}.", shapes, folder)
        block.load_state_dict(tensors, strict=False)
        loaded += sum(t.numel() for t in tensors.values())
    tensors = _read(files, root_names(config), folder)
    _check_shapes(tensors, "", shapes, folder)
    if config.tie_embeddings:
        tensors["output.weight"] = tensors["tok_embeddings.weight"]
    model.load_state_dict(tensors, strict=False)
    loaded += sum(t.numel() for name, t in tensors.items() if not (config.tie_embeddings and name == "output.weight"))
    _log.info("initialised from %s: %d tensors, %.2fM parameters, one unit at a time",
              folder, len(files), loaded / 1e6)
    return loaded
