"""MixedPrecisionPolicy and the offload policies, with FSDP2's names and defaults."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashfsdp.runtime.quantized_reduce import QuantizedReduce


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
        all_gather_dtype: None (default: all-gather in ``param_dtype``), or ``torch.int8``: the
            forward and backward all-gathers send the weights block-wise quantised to int8, one
            fp32 scale per 256 values, and dequantise them into ``param_dtype`` (ZeRO++'s qwZ: Wang
            et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model
            Training", arXiv:2306.10209). 0.508x the bytes of a bf16 all-gather; each unsharded
            value is within half its block's scale (max |w| of the block / 254) of the master
            weight. Master weights, gradients and the reduce-scatter (``reduce_dtype``) are
            unchanged. Needs a floating ``param_dtype``, and gloo or NCCL (``fully_shard`` checks).
        reduce_quantization: None (default: reduce-scatter in ``reduce_dtype``), or
            ``QuantizedReduce(bits=4 or 8, local_size=L)``: the gradient reduction is ZeRO++'s qgZ
            (arXiv:2306.10209, §3.3) — block-quantised int4 / int8 gradients (one fp32 scale per
            256 values), an all-to-all inside each "node" of L consecutive ranks, a dequantise-
            sum-requantise, an all-to-all across the nodes and a dequantise-sum into the
            reduce-scatter's output in ``reduce_dtype`` (``runtime/quantized_reduce.py``; the
            flags saying which gradients are None are reduced unquantised). Each reduced value is
            within the sum of half its blocks' scales of the exact sum. Refused (ValueError, by
            ``fully_shard``) under HSDP, where L does not divide the unit's W, or with a
            communicator without an all-to-all; the unit then reduces alone (no bucket).

    Same fields and semantics as ``torch.distributed.fsdp.MixedPrecisionPolicy``, plus
    ``all_gather_dtype`` and ``reduce_quantization`` (flashfsdp's; torch's policy has none).

    Raises:
        TypeError: a dtype field that is not a torch.dtype (or None) of the right kind.
        ValueError: ``all_gather_dtype`` other than ``torch.int8`` or None, or ``torch.int8``
            without a floating ``param_dtype``.
        TypeError: ``reduce_quantization`` neither None nor a ``QuantizedReduce``.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True
    all_gather_dtype: torch.dtype | None = None
    reduce_quantization: QuantizedReduce | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise TypeError(f"MixedPrecisionPolicy.{name} must be a floating torch.dtype or None, got {value!r}")
        self._check_all_gather_dtype()
        if self.reduce_quantization is not None and not isinstance(self.reduce_quantization, QuantizedReduce):
            raise TypeError(f"MixedPrecisionPolicy.reduce_quantization must be a QuantizedReduce (e.g. "
                            f"QuantizedReduce(bits=4, local_size=8)) or None, got {self.reduce_quantization!r}")

    def _check_all_gather_dtype(self) -> None:
        value = self.all_gather_dtype
        if value is None:
            return
        if not isinstance(value, torch.dtype):
            raise TypeError(f"MixedPrecisionPolicy.all_gather_dtype must be torch.int8 or None, got {value!r}")
        if value != torch.int8:
            raise ValueError(
                f"MixedPrecisionPolicy.all_gather_dtype must be torch.int8 or None, got {value}; to all-gather "
                f"in a floating dtype set param_dtype={value} instead" if value.is_floating_point else
                f"MixedPrecisionPolicy.all_gather_dtype must be torch.int8 or None, got {value}")
        if self.param_dtype is None:
            raise ValueError(
                "MixedPrecisionPolicy.all_gather_dtype=torch.int8 needs a floating param_dtype to dequantise the "
                "gathered weights into, e.g. MixedPrecisionPolicy(param_dtype=torch.bfloat16, "
                "all_gather_dtype=torch.int8)")


try:  # torch 2.13's class, exported as FSDP2 exports it (fully_shard refuses dp_mesh_dims: fully_shard.py)
    from torch.distributed.fsdp import DataParallelMeshDims  # noqa: F401
except ImportError:  # an older torch, or one built without distributed
    DataParallelMeshDims = None


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (FSDP2's default ``offload_policy``)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients in CPU memory (FSDP2's name).

    ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` keeps each unit's shard and gradient
    shard on the CPU; the optimizer steps there and each all-gather copies the shard to the device
    first (``runtime/flat_param.py``).

    Attributes:
        pin_memory: pin the CPU shards for asynchronous host-device copies.
    """

    pin_memory: bool = True
