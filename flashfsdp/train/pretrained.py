"""--init-from: a transformers `LlamaForCausalLM` folder's weights loaded into the sharded model,
one unit at a time.

Every rank reads, for each block and then for the root's own parameters (embeddings, final norm,
untied output), only that unit's tensors from the safetensors files (`safe_open`, tensor by
tensor; one file or a `model.safetensors.index.json` of several), and hands them to the unit's
module as full tensors: `module.load_state_dict(tensors, strict=False)` on a `fully_shard`ed
module copies this rank's elements into its shards. A rank therefore holds at most one unit's full
tensors besides its shards, never the whole model. The tensors are cast to the parameters' dtype
(a bfloat16 checkpoint into fp32 master weights), and renamed by `flashfsdp.train.hf_names`.

Before any worker starts, `check_weights` opens every file (its header only) and checks that each
tensor of the model is there with its shape, so a truncated or garbled file, a missing tensor or a
wrong shape is one line naming it (exit code 2). Tied embeddings follow transformers: where
config.json ties them but the weights hold an lm_head.weight of other values, both are kept,
untied, with a warning (`lm_head_differs`); where they hold only lm_head.weight, it is the tied
matrix.
"""

from __future__ import annotations

import functools
import json
import os

import torch

from flashfsdp.bindings.state_dict import INDEX_FILE, SINGLE_FILE
from flashfsdp.log import get_logger
from flashfsdp.models import Llama, LlamaConfig
from flashfsdp.train.errors import UsageError
from flashfsdp.train.hf_names import block_names, hf_names, root_names

_log = get_logger(__name__)


EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"
# Rows of the embedding and lm_head compared at a time (`lm_head_differs`).
_COMPARE_ROWS = 4096


def _open(file: str, folder: str):
    """`safe_open(file)` (a context manager); a file safetensors cannot read is a `UsageError`
    naming it."""
    from safetensors import safe_open  # noqa: PLC0415 - the hf extra

    try:
        return safe_open(file, framework="pt")
    except Exception as err:  # noqa: BLE001 - SafetensorError (truncated, garbled), OSError, ...
        raise UsageError(f"--init-from {folder}: {file} is not a readable safetensors file ({err}); it is "
                         "truncated or damaged: save or download it again") from None


def weight_files(folder: str) -> dict[str, str]:
    """Which safetensors file of `folder` holds each tensor: {transformers name: file path}.

    Raises:
        UsageError: neither model.safetensors nor model.safetensors.index.json is in `folder`
            (e.g. a PyTorch .bin checkpoint), the index is not readable, or model.safetensors is
            not a readable safetensors file (truncated, garbled: the file is named).
    """
    index = os.path.join(folder, INDEX_FILE)
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as fh:
                weight_map = json.load(fh)["weight_map"]
            return {name: os.path.join(folder, file) for name, file in weight_map.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
            raise UsageError(f"--init-from {index}: not a safetensors index ({err})") from None
    single = os.path.join(folder, SINGLE_FILE)
    if not os.path.isfile(single):
        raise UsageError(f"--init-from {folder}: no {SINGLE_FILE} or {INDEX_FILE}; save the model with "
                         "save_pretrained (safetensors, the default) or flashfsdp-train export")
    with _open(single, folder) as fh:
        return {name: single for name in fh.keys()}


def _names(config: LlamaConfig, files: dict[str, str]) -> dict[str, str]:
    """Every parameter's transformers name, ours -> theirs; a tied model whose weights hold only
    lm_head.weight takes it as the embedding (as transformers ties to the weight that exists)."""
    names = hf_names(config)
    if config.tie_embeddings and EMBEDDING not in files and LM_HEAD in files:
        names["tok_embeddings.weight"] = LM_HEAD
    return names


def check_weights(folder: str, config: LlamaConfig) -> None:
    """Before any worker starts: every safetensors file of `folder` opens (its header), and holds
    each tensor of `config`'s model where the index says, of the model's shape.

    Raises:
        UsageError: a file missing, truncated or garbled (named), a tensor missing or of another
            shape (named, with the file).
    """
    files = weight_files(folder)
    shapes = _full_shapes(config)
    headers: dict[str, dict[str, tuple[int, ...]]] = {}
    for ours, theirs in _names(config, files).items():
        file = files.get(theirs)
        if file is None:
            raise UsageError(f"--init-from {folder}: the weights have no {theirs}; the folder does not hold "
                             "this config's model")
        if file not in headers:
            if not os.path.isfile(file):
                raise UsageError(f"--init-from {folder}: {file}, named in {INDEX_FILE}, is missing")
            with _open(file, folder) as fh:
                headers[file] = {name: tuple(fh.get_slice(name).get_shape()) for name in fh.keys()}
        if theirs not in headers[file]:
            raise UsageError(f"--init-from {folder}: {file} has no {theirs} ({INDEX_FILE} says it does)")
        if headers[file][theirs] != shapes[ours]:
            raise UsageError(f"--init-from {folder}: {theirs} has shape {headers[file][theirs]} in {file}, the "
                             f"model of its config.json has {shapes[ours]}")


@functools.lru_cache(maxsize=None)
def lm_head_differs(folder: str) -> bool:
    """Whether the weights of `folder` hold both model.embed_tokens.weight and lm_head.weight with
    different values (compared a few thousand rows at a time). Where config.json ties them,
    transformers then keeps both, untied, with a warning: so does the training job
    (`flashfsdp.train.config`). Cached per process.

    Raises:
        UsageError: see `weight_files`.
    """
    files = weight_files(folder)
    if EMBEDDING not in files or LM_HEAD not in files:
        return False
    with _open(files[EMBEDDING], folder) as fa, _open(files[LM_HEAD], folder) as fb:
        a, b = fa.get_slice(EMBEDDING), fb.get_slice(LM_HEAD)
        if a.get_shape() != b.get_shape():
            return True
        rows = a.get_shape()[0] if a.get_shape() else 0
        for start in range(0, rows, _COMPARE_ROWS):
            x, y = a[start:start + _COMPARE_ROWS], b[start:start + _COMPARE_ROWS]
            if x.dtype != y.dtype:
                x, y = x.float(), y.float()
            if not torch.equal(x, y):
                return True
    return False


def untied_warning(folder: str) -> str:
    """The warning of a tied config.json whose weights hold a different lm_head (`lm_head_differs`)."""
    return (f"--init-from {folder}: config.json ties the output projection to the embeddings "
            f"(tie_word_embeddings true), but the weights hold a {LM_HEAD} of other values than "
            f"{EMBEDDING}: both are kept, untied, as transformers does; set tie_word_embeddings to false in "
            "config.json to silence this warning")


def _read(files: dict[str, str], names: dict[str, str], folder: str) -> dict[str, torch.Tensor]:
    """{our name: tensor} of `names` ({our name: transformers name}), each read on its own."""
    missing = [theirs for theirs in names.values() if theirs not in files]
    if missing:
        raise UsageError(f"--init-from {folder}: the weights have no {missing[0]} (and {len(missing) - 1} "
                         "more missing); the folder does not hold this config's model")
    out = {}
    for ours, theirs in names.items():
        with _open(files[theirs], folder) as fh:
            try:
                out[ours] = fh.get_tensor(theirs)
            except Exception as err:  # noqa: BLE001 - a file changed or damaged since it was checked
                raise UsageError(f"--init-from {folder}: {theirs} cannot be read from {files[theirs]} ({err}); "
                                 "the file is damaged: save or download it again") from None
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
        UsageError: no safetensors weights in `folder`, a file that cannot be read, a tensor
            missing, or a shape that is not the config's (the message names the file or tensor).
    """
    files, shapes = weight_files(folder), _full_shapes(config)
    loaded = 0
    for i, block in enumerate(model.layers):
        tensors = _read(files, block_names(i), folder)
        _check_shapes(tensors, f"layers.{i}.", shapes, folder)
        block.load_state_dict(tensors, strict=False)
        loaded += sum(t.numel() for t in tensors.values())
    root = {ours: theirs for ours, theirs in _names(config, files).items() if ours in root_names(config)}
    tensors = _read(files, root, folder)
    _check_shapes(tensors, "", shapes, folder)
    if config.tie_embeddings:
        tensors["output.weight"] = tensors["tok_embeddings.weight"]
    model.load_state_dict(tensors, strict=False)
    loaded += sum(t.numel() for name, t in tensors.items() if not (config.tie_embeddings and name == "output.weight"))
    _log.info("initialised from %s: %d tensors, %.2fM parameters, one unit at a time",
              folder, len(files), loaded / 1e6)
    return loaded
