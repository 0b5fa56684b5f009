"""The run's dtypes: the names of its `[sharding]` section parsed into torch dtypes, here and only
here, and the one `MixedPrecisionPolicy` every unit of the model is sharded with.

The configuration keeps dtypes as names ("bf16", "fp16", "fp32"; "int8" for the all-gather,
"int8" / "int4" for ZeRO++ qgZ's gradient reduction) so that it loads without torch
(`flashfsdp_cli.train_sections`); the job parses them once, into a
`Precision` (`TrainConfig.precision`), when it builds its runtime objects: the policy of
`fully_shard`, the gradient scaler, the memory estimates.
"""

from __future__ import annotations

import dataclasses

import torch

from flashfsdp import MixedPrecisionPolicy, QuantizedReduce

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ALL_GATHER_DTYPES = {"int8": torch.int8}
# --reduce-quantization's names: the bits of ZeRO++ qgZ's quantised gradients.
REDUCE_QUANTIZATION_BITS = {"int8": 8, "int4": 4}


@dataclasses.dataclass(frozen=True)
class Precision:
    """The run's dtypes as torch dtypes.

    Attributes:
        param_dtype: compute dtype of the unsharded parameters (--param-dtype).
        reduce_dtype: dtype of the gradient reduce-scatter (--reduce-dtype).
        all_gather_dtype: torch.int8 for quantised all-gathers (--all-gather-dtype), or None.
        reduce_quantization: ZeRO++ qgZ's `QuantizedReduce(bits, local_size)` for the gradient
            reduction (--reduce-quantization, --ranks-per-node), or None: reduce-scatter.
    """

    param_dtype: torch.dtype
    reduce_dtype: torch.dtype
    all_gather_dtype: torch.dtype | None = None
    reduce_quantization: QuantizedReduce | None = None

    @classmethod
    def from_names(cls, param_dtype: str, reduce_dtype: str, all_gather_dtype: str | None = None,
                   reduce_quantization: str | None = None, ranks_per_node: int | None = None) -> Precision:
        """Parse the dtype names of a `[sharding]` section.

        Raises:
            ValueError: a name that is not one of `DTYPES` (or of `ALL_GATHER_DTYPES` for the
                all-gather, `REDUCE_QUANTIZATION_BITS` for the reduction); the message names the
                field and the names allowed; a reduce_quantization without ranks_per_node.
        """
        for name, value, table in (("param_dtype", param_dtype, DTYPES), ("reduce_dtype", reduce_dtype, DTYPES),
                                   ("all_gather_dtype", all_gather_dtype, {None: None, **ALL_GATHER_DTYPES}),
                                   ("reduce_quantization", reduce_quantization,
                                    {None: None, **REDUCE_QUANTIZATION_BITS})):
            if value not in table:
                raise ValueError(f"{name} must be one of {sorted(k for k in table if k)}, got {value!r}")
        gather = None if all_gather_dtype is None else ALL_GATHER_DTYPES[all_gather_dtype]
        quantized = None
        if reduce_quantization is not None:
            if ranks_per_node is None:
                raise ValueError(f"reduce_quantization {reduce_quantization!r} needs ranks_per_node")
            quantized = QuantizedReduce(bits=REDUCE_QUANTIZATION_BITS[reduce_quantization], local_size=ranks_per_node)
        return cls(DTYPES[param_dtype], DTYPES[reduce_dtype], gather, quantized)

    @property
    def policy(self) -> MixedPrecisionPolicy:
        """The `MixedPrecisionPolicy` of every unit: parameters in `param_dtype`, gradients reduced
        in `reduce_dtype` (by qgZ's quantised all-to-all with `reduce_quantization`), all-gathers in
        `all_gather_dtype` (None: in `param_dtype`), forward inputs cast to `param_dtype`, outputs
        left in it (the loss casts the logits to fp32)."""
        return MixedPrecisionPolicy(param_dtype=self.param_dtype, reduce_dtype=self.reduce_dtype,
                                    output_dtype=None, cast_forward_inputs=True,
                                    all_gather_dtype=self.all_gather_dtype,
                                    reduce_quantization=self.reduce_quantization)

    @property
    def loss_scaling(self) -> bool:
        """Whether the run trains with dynamic loss scaling: float16 computes or reduces."""
        return torch.float16 in (self.param_dtype, self.reduce_dtype)

    @property
    def compute_bytes(self) -> int:
        """Bytes per element of the compute dtype (2 for bf16 and fp16, 4 for fp32)."""
        return self.param_dtype.itemsize
