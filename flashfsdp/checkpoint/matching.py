"""Does a checkpoint fit the model and optimizer it is loaded into? Every entry, named in words."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


def describe(key: str, kinds: dict[str, str]) -> str:
    """What the flattened DCP key ``key`` is, in words (``kinds``: model key -> "parameter"/"buffer")."""
    if key.startswith("model."):
        name = key[len("model."):]
        return f"{kinds.get(name, 'model entry')} '{name}'"
    if key.startswith("optim.state."):
        name, _, entry = key[len("optim.state."):].rpartition(".")
        return f"optimizer state '{entry}' of parameter '{name}'"
    if key.startswith("optim.param_groups."):
        group, _, hyper = key[len("optim.param_groups."):].partition(".")
        return f"optimizer hyperparameter '{hyper}' of param group {group}"
    return f"entry '{key}'"


def _why_missing(key: str, saved) -> str:
    if key.startswith("model."):
        return "it was saved from another model"
    if key.startswith("optim.param_groups."):
        groups = {k.split(".")[2] for k in saved if k.startswith("optim.param_groups.")}
        return (f"it was saved with another optimizer type or another number of param groups (the checkpoint "
                f"has {len(groups)})")
    return "it was saved with another optimizer type or from another model"


def check_against(path: str, metadata, state: dict[str, Any], model: nn.Module) -> None:
    """Every tensor the model/optimizer expects is in the checkpoint with the same shape, and back."""
    from flashfsdp._torch_private import flatten_state_dict  # noqa: PLC0415
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: PLC0415

    kinds = {name: "buffer" for name, _ in model.named_buffers(remove_duplicate=False)}
    kinds.update((name, "parameter") for name, _ in model.named_parameters(remove_duplicate=False))
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(state)
    for key, value in flat.items():
        what = describe(key, kinds)
        if key not in saved:
            raise ValueError(f"load: checkpoint {path} has no entry for {what}; {_why_missing(key, saved)}")
        md = saved[key]
        if isinstance(value, torch.Tensor) and isinstance(md, TensorStorageMetadata) and md.size != value.shape:
            raise ValueError(f"load: {what} has shape {tuple(md.size)} in checkpoint {path} but "
                             f"{tuple(value.shape)} in the model; load it into the model it was saved from")
    extra_keys = sorted(k[len("model."):] for k in saved if k.startswith("model.") and k not in flat)
    if extra_keys:
        raise ValueError(f"load: checkpoint {path} has model key(s) {extra_keys[:5]}"
                         f"{' ...' if len(extra_keys) > 5 else ''} (parameters or buffers) that the model does "
                         f"not have; load it into the model it was saved from")


def check_shards(path: str, state: dict[str, Any], model: nn.Module) -> None:
    """Every DTensor DCP is to read into is one this process can fill: its local tensor is the
    chunk its placements give this rank (the chunk DCP reads into it: DCP would otherwise fail
    partway through the read, the model half loaded).

    Raises:
        ValueError: naming the entry, its mesh and what to do.
    """
    from flashfsdp._torch_private import flatten_state_dict  # noqa: PLC0415
    from flashfsdp.runtime.sharding_spec import is_dtensor  # noqa: PLC0415

    kinds = {name: "parameter" for name, _ in model.named_parameters(remove_duplicate=False)}
    for key, value in flatten_state_dict(state)[0].items():
        if not is_dtensor(value):
            continue
        what, ranks = describe(key, kinds), value.device_mesh.mesh.flatten().tolist()
        chunks = value.__create_chunk_list__()
        local = tuple(value.to_local().shape)
        planned = tuple(chunks[0].sizes) if chunks else local
        if planned != local:
            raise ValueError(f"load: {what}: this rank holds a local chunk of shape {local}, but its placements "
                             f"{tuple(value.placements)} on the device mesh of ranks {ranks} give it a chunk of shape "
                             f"{planned} (e.g. a mesh whose order of ranks is not its process group's): DCP cannot "
                             f"reshard checkpoint {path} into it; shard the model on a mesh built with "
                             f"init_device_mesh (ranks in order), or load a full state dict "
                             f"(flashfsdp.set_full_state_dict)")
