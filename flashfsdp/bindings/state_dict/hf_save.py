"""``flashfsdp.save_pretrained``: a Hugging Face model sharded with ``fully_shard``, saved as a folder
that ``from_pretrained`` loads, with rank 0 holding one unit at a time.

transformers' own ``model.save_pretrained(path)`` sees ``model.state_dict()``'s DTensors, as on a
model sharded by hand with FSDP2; even where it gathers them, its write loop runs on rank 0 alone
after the whole state dict is built, so it cannot gather lazily (an all-gather needs every rank),
and safetensors writes a file from a dict in memory. So :func:`save_pretrained` does the gathering
and writing itself, unit by unit, and leaves the rest to transformers and safetensors:

1. every rank: the units (in module order) and the state-dict keys each one saves — tied weights and
   ``_keys_to_ignore_on_save`` dropped by transformers' own ``remove_tied_weights_from_state_dict``
   on a meta-device copy of the state dict — packed into files of at most ``max_shard_size`` bytes
   (None: one file per unit); rank 0 writes ``config.json`` (and ``generation_config.json``) the
   way ``save_pretrained`` does and removes shard files a previous save left; the ranks agree;
2. file by file, unit by unit: the unit's flat groups are all-gathered in the parameters' original
   dtype (``full.full_unit_params``: one unit on the device), rank 0 keeps the values on the CPU,
   applies transformers' ``revert_weight_conversion`` (its own per-shard path for offloaded models)
   and writes the file with ``safetensors.torch.save_file``, then drops them;
3. rank 0 writes ``model.safetensors.index.json`` when there is more than one file; the ranks agree
   on any error (raised on every rank, naming the rank).

So the host memory of rank 0 holds one file's tensors (one unit by default), the other ranks none.
transformers and safetensors are imported only when this is called (``pip install flashfsdp[hf]``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any

import torch
import torch.nn as nn

from flashfsdp.runtime.agreement import agree, global_rank
from flashfsdp.runtime.extensions import refuse_subclass_params
from flashfsdp.runtime.sharding_spec import is_dtensor

from ..concurrency import refuse_reader_thread
from ..state import FSDPState
from ..structure import check_same_structure
from .full import full_unit_params, param_owners, units_of

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


@dataclasses.dataclass
class _File:
    """One safetensors file: its name and the (unit state or None for entries outside units, keys)
    chunks it holds."""

    name: str
    chunks: list[tuple[FSDPState | None, list[str]]]


@dataclasses.dataclass
class _Plan:
    directory: str
    files: list[_File]
    template: dict[str, Any]
    owners: dict[str, tuple[FSDPState, int]]
    states: list[FSDPState]


def _hf():
    """(transformers.modeling_utils, transformers.core_model_loading, safetensors.torch), imported now."""
    try:
        import safetensors.torch as st  # noqa: PLC0415
        import transformers.core_model_loading as conversion  # noqa: PLC0415
        import transformers.modeling_utils as modeling  # noqa: PLC0415
    except ImportError as exc:
        raise ImportError(f"flashfsdp.save_pretrained needs transformers >= 5 and safetensors ({exc}); "
                          f"pip install 'flashfsdp[hf]'") from exc
    return modeling, conversion, st


def shard_limit(max_shard_size: Any) -> int | None:
    """``max_shard_size`` in bytes: None (one file per unit), a positive int, or a size string
    as transformers takes it ("5GB", "500MB", "2GiB"; huggingface_hub's parser).

    Raises:
        TypeError / ValueError: anything else (naming ``max_shard_size``).
    """
    if max_shard_size is None:
        return None
    if isinstance(max_shard_size, str):
        from huggingface_hub.serialization._base import parse_size_to_int  # noqa: PLC0415

        try:
            return parse_size_to_int(max_shard_size)
        except ValueError as exc:
            raise ValueError(f"save_pretrained: max_shard_size {max_shard_size!r} is not a size: {exc}") from None
    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, int) or max_shard_size <= 0:
        raise TypeError(f"save_pretrained: max_shard_size must be None, a positive number of bytes or a size "
                        f"string such as '5GB', got {max_shard_size!r}")
    return max_shard_size


def saved_keys(model: nn.Module, template: dict[str, Any], modeling) -> list[str]:
    """The state-dict keys ``save_pretrained`` writes, in order: without ``_keys_to_ignore_on_save``
    and with one name per tied weight, chosen by transformers' ``remove_tied_weights_from_state_dict``
    (given meta-device stand-ins, it ties names by the model's parameter objects)."""
    ignored = getattr(model, "_keys_to_ignore_on_save", None) or []
    stand_ins = {key: torch.empty(value.shape, dtype=value.dtype, device="meta")
                 if isinstance(value, torch.Tensor) else value
                 for key, value in template.items() if key not in ignored}
    kept = modeling.remove_tied_weights_from_state_dict(stand_ins, model)
    return [key for key in template if key in kept]


def _nbytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def _pack(chunks: list[tuple[FSDPState | None, list[str]]], template: dict, limit: int | None) -> list[_File]:
    """Consecutive chunks into files of at most ``limit`` bytes (a larger chunk alone; None: one
    file per chunk), named as transformers names them."""
    groups: list[list] = []
    size = 0
    for chunk in chunks:
        n = sum(_nbytes(template[key]) for key in chunk[1])
        if not groups or limit is None or size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(chunk)
        size += n
    if len(groups) == 1:
        return [_File(SINGLE_FILE, groups[0])]
    return [_File(f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors", g) for i, g in enumerate(groups)]


def _plan(model: Any, save_directory: Any, max_shard_size: Any) -> _Plan:
    """Every rank's checks and the files to write (before the ranks agree)."""
    modeling, _, _ = _hf()
    if "_fsdp_wrapped_module" in getattr(model, "_modules", {}):
        raise TypeError("save_pretrained: model is an FSDP1 FullyShardedDataParallel wrapper, whose state dict "
                        "names are not its units'; call model.module.save_pretrained(path) on every rank (FSDP1's "
                        "full state dict), or shard the model with flashfsdp.fully_shard")
    if not isinstance(model, modeling.PreTrainedModel):
        raise TypeError(f"save_pretrained: model must be a transformers PreTrainedModel, got "
                        f"{type(model).__name__}; for other models use flashfsdp.get_full_state_dict")
    states = [state for _, state in units_of(model, "save_pretrained")]
    refuse_subclass_params([g for state in states for g in state.unit.groups], "save_pretrained",
                           "safetensors holds plain tensors: save a sharded state dict (DCP) instead")
    if not isinstance(save_directory, (str, os.PathLike)):
        raise TypeError(f"save_pretrained: save_directory must be a path, got {type(save_directory).__name__}")
    directory = os.fspath(save_directory)
    if os.path.isfile(directory):
        raise ValueError(f"save_pretrained: save_directory {directory} is a file; pass a directory")
    limit = shard_limit(max_shard_size)
    template, owners = model.state_dict(), param_owners(model)
    keys = saved_keys(model, template, modeling)
    by_state: dict[int, list[str]] = {}
    plain = []
    for key in keys:
        if key in owners:
            by_state.setdefault(id(owners[key][0]), []).append(key)
        elif is_dtensor(template[key]):
            raise RuntimeError(f"save_pretrained: '{key}' is a DTensor but belongs to no unit of the model")
        else:
            plain.append(key)
    chunks = [(state, by_state[id(state)]) for state in states if id(state) in by_state]
    chunks += [(None, plain)] if plain else []
    return _Plan(directory, _pack(chunks, template, limit), template, owners, states)


def remove_stale_weights(directory: str, names: set[str]) -> None:
    """Remove the weight files (``model.safetensors``, ``model-0000i-of-0000N.safetensors``) and the
    index an earlier save left in ``directory`` that are not among ``names`` (the files a new save
    writes), so that ``from_pretrained`` reads only the new weights."""
    for name in os.listdir(directory):
        stale = _SHARD_FILE.match(name) or name in (SINGLE_FILE, INDEX_FILE)
        if stale and name not in names and os.path.isfile(os.path.join(directory, name)):
            os.remove(os.path.join(directory, name))


def _prepare_directory(model, plan: _Plan) -> None:
    """Rank 0: create the directory, remove weight files of an earlier save (``remove_stale_weights``)
    and write the configuration as ``PreTrainedModel.save_pretrained`` does."""
    os.makedirs(plan.directory, exist_ok=True)
    remove_stale_weights(plan.directory, {f.name for f in plan.files})
    model.config.dtype = str(model.dtype).split(".")[1]
    model.config.architectures = [type(model).__name__.removeprefix("FSDP")]
    model.config.save_pretrained(plan.directory)
    if model.can_generate():
        model.generation_config.save_pretrained(plan.directory)


def _gather_chunk(plan: _Plan, state: FSDPState | None, keys: list[str], keep: bool) -> dict[str, torch.Tensor]:
    """The chunk's full values on the CPU (collective over the unit's ranks; {} unless ``keep``)."""
    if state is None:
        return {key: plan.template[key].detach().to("cpu").clone() for key in keys} if keep else {}
    fulls = full_unit_params(state, torch.device("cpu"), keep=keep)
    return {key: fulls[plan.owners[key][1]] for key in keys} if keep else {}


def _write_file(model, directory: str, name: str, tensors: dict[str, torch.Tensor], conversion, st) -> list[str]:
    """Rank 0: transformers' reverse weight conversion, then one safetensors file (written beside and
    renamed into place). Returns the names written."""
    tensors = conversion.revert_weight_conversion(model, tensors)
    tensors = {key: value.contiguous() for key, value in tensors.items()}
    path = os.path.join(directory, name)
    st.save_file(tensors, path + ".tmp", metadata={"format": "pt"})
    os.replace(path + ".tmp", path)
    return list(tensors)


def _write_files(model, plan: _Plan) -> tuple[BaseException | None, dict[str, str]]:
    """Every rank: gather file by file, unit by unit; rank 0 writes. A failure on rank 0 does not stop
    it taking part in the remaining all-gathers (it keeps nothing more). Returns (error, weight map)."""
    _, conversion, st = _hf()
    keep, error, weight_map = global_rank() == 0, None, {}
    for file in plan.files:
        tensors: dict[str, torch.Tensor] = {}
        for state, keys in file.chunks:
            tensors.update(_gather_chunk(plan, state, keys, keep and error is None))
        if keep and error is None:
            try:
                weight_map.update(dict.fromkeys(_write_file(model, plan.directory, file.name, tensors, conversion, st),
                                                file.name))
            except Exception as exc:  # noqa: BLE001 - agreed by the caller
                error = exc
        del tensors
    return error, weight_map


def _write_index(plan: _Plan, weight_map: dict[str, str]) -> None:
    """Rank 0: ``model.safetensors.index.json`` (the tensors' total bytes and the weight map, as transformers
    writes it)."""
    total = sum(_nbytes(plan.template[key]) for f in plan.files for _, keys in f.chunks for key in keys)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(plan.directory, INDEX_FILE), "w", encoding="utf-8") as fh:
        fh.write(json.dumps(index, indent=2, sort_keys=True) + "\n")


def save_pretrained(model: nn.Module, save_directory: str | os.PathLike, *,
                    max_shard_size: int | str | None = None) -> list[str]:
    """Save a fully_shard'ed Hugging Face model as ``model.save_pretrained`` would save it unsharded.

    Collective: every rank calls it. Writes ``config.json`` (and ``generation_config.json`` for a
    generative model) and the weights as safetensors from rank 0 — ``model.safetensors``, or
    ``model-0000i-of-0000N.safetensors`` and ``model.safetensors.index.json`` when there are several
    files — in the parameters' original dtype (not ``param_dtype``), so that
    ``AutoModelForCausalLM.from_pretrained(save_directory)`` on one process gives the same model.
    Gathering and writing go unit by unit (see the module docstring): the device holds one unit
    extra at a time; rank 0's host memory one file (one unit with the default ``max_shard_size``).

    Args:
        model: a transformers ``PreTrainedModel`` with fully_shard'ed modules (e.g. each decoder
            layer and the root), on any world size.
        save_directory: the folder to write (created; shard files of an earlier save that this one
            does not overwrite are removed, as transformers does).
        max_shard_size: None (one file per unit: the least memory), or the most bytes per file, an
            int or a string such as "5GB" (units are not split: a larger unit gets a file alone).

    Returns:
        The names of the weight files written (on every rank).

    Raises:
        ImportError: transformers or safetensors is not installed.
        TypeError: ``model`` is not a PreTrainedModel (or is an FSDP1 wrapper), ``save_directory``
            not a path, or ``max_shard_size`` of another kind.
        ValueError: no fully_shard'ed module; ``save_directory`` is a file; a bad size string.
        NotImplementedError: a tensor-subclass parameter with FSDP2's all-gather extensions.
        RuntimeError: called during forward/backward, or from a thread other than the training
            thread (refused there, before any collective).
        Any error of one rank (e.g. writing on rank 0), on every rank, naming the rank.
    """
    refuse_reader_thread(model)  # (a thread's request: refused before any collective)
    plan, error = None, None
    try:
        plan = _plan(model, save_directory, max_shard_size)
        if global_rank() == 0:
            _prepare_directory(model, plan)
    except Exception as exc:  # noqa: BLE001 - agreed below: raised on every rank
        error = exc
    agree(error)
    check_same_structure(plan.states)
    error, weight_map = _write_files(model, plan)
    if error is None and global_rank() == 0 and len(plan.files) > 1:
        try:
            _write_index(plan, weight_map)
        except Exception as exc:  # noqa: BLE001 - agreed below
            error = exc
    agree(error)
    return [f.name for f in plan.files]
