"""MixedPrecisionPolicy and the offload policies, with FSDP2's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes of one unit's forward/backward compute and gradient reduction.

    The master weights (``sharded_flat``) and gradient shards always stay in the parameters'
    original dtype (normally fp32); only the unsharded copies and the reduction use these dtypes.

    Attributes:
        param_dtype: dtype of the unsharded parameters used in forward/backward (None: original).
        reduce_dtype: dtype of the gradient reduce-scatter (None: ``param_dtype``, else original).
        output_dtype: if set, floating-point forward outputs are cast to it.
        cast_forward_inputs: cast floating-point forward inputs to ``param_dtype`` (when set).

    Same fields and semantics as ``torch.distributed.fsdp.MixedPrecisionPolicy``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise TypeError(f"MixedPrecisionPolicy.{name} must be a floating torch.dtype or None, got {value!r}")


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (FSDP2's default ``offload_policy``)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients in CPU memory (FSDP2's name).

    Not implemented yet in flashfsdp: ``fully_shard`` rejects it with NotImplementedError.

    Attributes:
        pin_memory: pin the CPU shards for asynchronous host-device copies.
    """

    pin_memory: bool = True
