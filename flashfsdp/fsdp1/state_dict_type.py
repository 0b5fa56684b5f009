"""FSDP1's ``state_dict_type``: which state dict ``model.state_dict()`` gives under the wrappers.

FSDP1 names keep the wrappers out: ``model.state_dict()`` has the keys of the unwrapped model,
with no ``_fsdp_wrapped_module.`` segment, in every mode. Each wrapper's state-dict post-hook
drops its own segment from the keys under it (nested wrappers run theirs first), and its load
pre-hook puts it back before the wrapped module's hooks see the keys.

============================  =======================================================================
FULL_STATE_DICT               full tensors (``flashfsdp.get_full_state_dict``: unit by unit, on rank 0
                              only with ``rank0_only``, on the CPU with ``offload_to_cpu``); loading
                              takes full tensors on every rank
SHARDED_STATE_DICT            DTensor values (each parameter's dim-0 chunks, as FSDP1 gives with
                              ``_use_dtensor=True``): what ``dcp.save`` saves and ``dcp.load``
                              reshards; loading takes them (or full tensors)
LOCAL_STATE_DICT              refused (FSDP1's flat-parameter shards; flat units have no such key)
============================  =======================================================================

Under NO_SHARD, SHARDED_STATE_DICT gives the full state dict, with FSDP1's warning. Buffers cast
to ``MixedPrecision.buffer_dtype`` come back in their original dtype.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import OrderedDict

import torch
import torch.nn as nn

from flashfsdp.bindings import get_full_state_dict
from flashfsdp.runtime.sharding_spec import is_dtensor

from .api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictSettings,
    StateDictType,
)

WRAPPED = "_fsdp_wrapped_module"
_SEGMENT = WRAPPED + "."
_CONFIGS = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
}
_raw_depth = 0  # > 0: state_dict() gives the raw (prefixed, sharded) keys, for get_full_state_dict


def clean_key(key: str) -> str:
    """``key`` without its ``_fsdp_wrapped_module.`` segments (FSDP1's ``clean_tensor_name``)."""
    return key.replace(_SEGMENT, "")


def default_settings() -> StateDictSettings:
    """FSDP1's default: FULL_STATE_DICT with default configs."""
    return StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())


def make_settings(state_dict_type, state_dict_config=None, optim_state_dict_config=None) -> StateDictSettings:
    """The settings of FSDP1's ``set_state_dict_type`` arguments (default configs filled in).

    Raises:
        NotImplementedError: LOCAL_STATE_DICT (flat units keep no flat-parameter shard to give).
        TypeError: not a StateDictType, or a config of another type than the state-dict type's.
    """
    if not isinstance(state_dict_type, StateDictType):
        raise TypeError(f"state_dict_type: expected a StateDictType, got {state_dict_type!r}")
    if state_dict_type not in _CONFIGS:
        raise NotImplementedError(
            f"state_dict_type: {state_dict_type} is not supported by flashfsdp's FullyShardedDataParallel: it is "
            f"FSDP1's flat-parameter shard per rank, and flat units have no flat-parameter key; use "
            f"SHARDED_STATE_DICT (sharded, for torch.distributed.checkpoint) or FULL_STATE_DICT")
    model_cls, optim_cls = _CONFIGS[state_dict_type]
    state_dict_config = model_cls() if state_dict_config is None else state_dict_config
    optim_state_dict_config = optim_cls() if optim_state_dict_config is None else optim_state_dict_config
    for config, cls in ((state_dict_config, model_cls), (optim_state_dict_config, optim_cls)):
        if type(config) is not cls:
            raise TypeError(f"state_dict_type: {state_dict_type} takes a {cls.__name__}, got {type(config).__name__}")
    return StateDictSettings(state_dict_type, state_dict_config, optim_state_dict_config)


def effective(wrapper) -> StateDictSettings:
    """The wrapper's settings, with SHARDED turned into FULL on all ranks under NO_SHARD (FSDP1)."""
    settings = wrapper._fsdp_state_dict_settings
    if (settings.state_dict_type is StateDictType.SHARDED_STATE_DICT
            and wrapper._fsdp_sharding_strategy is ShardingStrategy.NO_SHARD):
        warnings.warn("When using NO_SHARD for ShardingStrategy, full_state_dict will be returned.", stacklevel=4)
        config = FullStateDictConfig(offload_to_cpu=settings.state_dict_config.offload_to_cpu, rank0_only=False)
        return StateDictSettings(StateDictType.FULL_STATE_DICT, config, FullOptimStateDictConfig())
    return settings


@contextlib.contextmanager
def raw_state_dict():
    """Inside: ``state_dict()`` gives the wrapped modules' own keys and sharded values."""
    global _raw_depth
    _raw_depth += 1
    try:
        yield
    finally:
        _raw_depth -= 1


def in_raw() -> bool:
    return _raw_depth > 0


def full_state_dict(wrapper, destination, prefix: str) -> dict:
    """FULL_STATE_DICT of ``wrapper`` into ``destination`` under ``prefix`` (collective)."""
    config = effective(wrapper).state_dict_config
    with raw_state_dict():
        full = get_full_state_dict(wrapper, cpu_offload=config.offload_to_cpu, rank0_only=config.rank0_only)
    destination = OrderedDict() if destination is None else destination
    dtypes = buffer_dtypes(wrapper)
    for key, value in full.items():
        name = clean_key(key)
        if name in dtypes:
            value = value.to(dtypes[name])
        destination[prefix + name] = value
    return destination


def buffer_dtypes(wrapper) -> dict[str, torch.dtype]:
    """Clean name (relative to ``wrapper``) -> original dtype of every buffer that
    ``MixedPrecision.buffer_dtype`` cast, in ``wrapper`` and the wrappers below it."""
    out = {}
    for path, module in wrapper.named_modules():
        for rel, dtype in getattr(module, "_fsdp_buffer_dtypes", {}).items():
            out[clean_key(f"{path}.{rel}" if path else rel)] = dtype
    return out


def install_hooks(wrapper: nn.Module) -> None:
    """The wrapper's post-state-dict hook (drop its segment, restore buffer dtypes, offload
    sharded values) and load pre-hook (put the segment back)."""
    wrapper.register_state_dict_post_hook(_post_state_dict)
    wrapper.register_load_state_dict_pre_hook(_pre_load_state_dict)


def _post_state_dict(wrapper, state_dict, prefix: str, local_metadata) -> None:
    if in_raw():
        return
    own = prefix + _SEGMENT
    offload = effective(wrapper).state_dict_config.offload_to_cpu
    dtypes = {f"{prefix}{k}": d for k, d in wrapper._fsdp_buffer_dtypes.items()}
    items = list(state_dict.items())
    state_dict.clear()
    for key, value in items:
        if key.startswith(own):
            key = prefix + key[len(own):]
            if is_dtensor(value) and offload:
                value = value.cpu()
            elif key in dtypes and isinstance(value, torch.Tensor):
                value = value.to(dtypes[key])
        state_dict[key] = value


def _pre_load_state_dict(wrapper, state_dict, prefix: str, *args) -> None:
    own = prefix + _SEGMENT
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(own)]:
        state_dict[own + key[len(prefix):]] = state_dict.pop(key)
