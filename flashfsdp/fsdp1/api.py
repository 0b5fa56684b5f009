"""FSDP1's enums and configs, and what each means for the units ``fully_shard`` builds.

The names FSDP1 users import (``ShardingStrategy``, ``BackwardPrefetch``, ``MixedPrecision``,
``CPUOffload``, ``StateDictType`` and the state-dict configs) are torch's own objects
(``torch.distributed.fsdp.api``), re-exported: code that imports them from torch passes them to
:class:`~flashfsdp.fsdp1.wrapper.FullyShardedDataParallel` unchanged, and ``is`` comparisons hold.

[Note: FSDP1 mixed precision]
``MixedPrecision(param_dtype, reduce_dtype, buffer_dtype, ...)`` becomes a per-unit
``MixedPrecisionPolicy(param_dtype, reduce_dtype)`` (reduce_dtype None: param_dtype, as in FSDP1).
The inputs are cast by the wrapper (not by the unit): the root's when ``cast_root_forward_inputs``
(default True), a nested wrapper's when ``cast_forward_inputs`` (default False), as FSDP1 does.
``buffer_dtype`` casts the buffers of the wrapped module once, at wrapping; state dicts give them
back in their original dtype. ``keep_low_precision_grads=True`` is refused: a unit's gradients are
accumulated into its master shard in the parameters' own dtype.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp.api import (  # noqa: F401  (re-exported)
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)

from flashfsdp.bindings import CPUOffloadPolicy, MixedPrecisionPolicy

__all__ = [
    "ShardingStrategy", "BackwardPrefetch", "MixedPrecision", "CPUOffload", "StateDictType", "StateDictConfig",
    "FullStateDictConfig", "ShardedStateDictConfig", "LocalStateDictConfig", "OptimStateDictConfig",
    "FullOptimStateDictConfig", "ShardedOptimStateDictConfig", "LocalOptimStateDictConfig", "StateDictSettings",
]

HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)
# reshard_after_forward of each strategy's units (NO_SHARD has nothing to reshard)
RESHARD_AFTER_FORWARD = {
    ShardingStrategy.FULL_SHARD: True,
    ShardingStrategy.SHARD_GRAD_OP: False,
    ShardingStrategy.NO_SHARD: False,
    ShardingStrategy.HYBRID_SHARD: True,
    ShardingStrategy._HYBRID_SHARD_ZERO2: False,
}


def check_sharding_strategy(value) -> ShardingStrategy:
    """``value`` as a ShardingStrategy (None: FULL_SHARD, FSDP1's default).

    Raises:
        TypeError: not a ``ShardingStrategy``.
    """
    if value is None:
        return ShardingStrategy.FULL_SHARD
    if not isinstance(value, ShardingStrategy):
        raise TypeError(f"FullyShardedDataParallel: sharding_strategy must be a ShardingStrategy or None, "
                        f"got {value!r}")
    return value


def check_backward_prefetch(value) -> BackwardPrefetch | None:
    """``value`` if it is a BackwardPrefetch or None.

    Raises:
        TypeError: anything else.
    """
    if value is not None and not isinstance(value, BackwardPrefetch):
        raise TypeError(f"FullyShardedDataParallel: backward_prefetch must be a BackwardPrefetch or None, "
                        f"got {value!r}")
    return value


def mp_policy_of(mixed_precision) -> MixedPrecisionPolicy:
    """The unit's ``MixedPrecisionPolicy`` for FSDP1's ``mixed_precision`` (see
    [Note: FSDP1 mixed precision]); the inputs are cast by the wrapper, so not by the policy.

    Raises:
        TypeError: not a ``MixedPrecision`` (e.g. FSDP2's ``MixedPrecisionPolicy``) or None.
        NotImplementedError: ``keep_low_precision_grads=True``.
    """
    if mixed_precision is None:
        return MixedPrecisionPolicy(cast_forward_inputs=False)
    if not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"FullyShardedDataParallel: mixed_precision must be a MixedPrecision (FSDP1's config, "
            f"torch.distributed.fsdp.MixedPrecision) or None, got {type(mixed_precision).__name__}; FSDP2's "
            f"MixedPrecisionPolicy goes to flashfsdp.fully_shard(mp_policy=...)")
    if mixed_precision.keep_low_precision_grads:
        raise NotImplementedError(
            "FullyShardedDataParallel: MixedPrecision(keep_low_precision_grads=True) is not supported: flashfsdp "
            "accumulates each unit's gradients into its master shard in the parameters' own dtype (more accurate, "
            "same memory as the sharded parameters); pass keep_low_precision_grads=False")
    return MixedPrecisionPolicy(mixed_precision.param_dtype, mixed_precision.reduce_dtype, None, False)


def input_dtype(mixed_precision, is_root: bool) -> torch.dtype | None:
    """The dtype a wrapper casts its floating-point forward inputs to (None: no cast), as FSDP1:
    ``param_dtype`` for the root if ``cast_root_forward_inputs``, for others if
    ``cast_forward_inputs``."""
    if mixed_precision is None or mixed_precision.param_dtype is None:
        return None
    cast = mixed_precision.cast_root_forward_inputs if is_root else mixed_precision.cast_forward_inputs
    return mixed_precision.param_dtype if cast else None


def offload_policy_of(cpu_offload) -> CPUOffloadPolicy | None:
    """``CPUOffload(offload_params=True)`` as a ``CPUOffloadPolicy`` (pinned where CUDA exists).

    Raises:
        TypeError: not a ``CPUOffload`` or None.
    """
    if cpu_offload is None:
        return None
    if not isinstance(cpu_offload, CPUOffload):
        raise TypeError(
            f"FullyShardedDataParallel: cpu_offload must be a CPUOffload (torch.distributed.fsdp.CPUOffload) or "
            f"None, got {type(cpu_offload).__name__}; FSDP2's CPUOffloadPolicy goes to flashfsdp.fully_shard")
    return CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if cpu_offload.offload_params else None
