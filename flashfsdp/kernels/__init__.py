"""flashfsdp's kernels: pure functions over tensors that move a unit's bytes (docs/architecture.md, Kernels).

- :func:`flatten` - many tensors -> one flat buffer (copy-in, gradient packing for reduce-scatter)
- :func:`unflatten` - one flat buffer -> many tensors (write-back, copy-out)
- :func:`accumulate_grad_shard` - reduced gradient shard -> master gradient, with norm and flag
  (:func:`accumulate_grad_shards`: several pairs at once, a bucket's)
- :func:`quantize_int8` / :func:`dequantize_int8` - block-wise int8 all-gather payloads (ZeRO++ qwZ)
- :func:`quantize_grad` / :func:`dequantize_reduce` - int4 / int8 gradients in the order of a
  hierarchical all-to-all, and the fused dequantise-sum(-requantise) between its hops (ZeRO++ qgZ)
- :class:`FlattenPlan` / :class:`UnflattenPlan` - ``flatten`` / ``unflatten`` over a fixed list of
  tensors called again and again (a unit's copy-out): validation and segment table kept from the
  first call, later calls check the flat buffer and the tensors' addresses only

Each runs a Triton kernel (CUDA, or CPU under ``TRITON_INTERPRET=1``) or the plain-torch reference
in :mod:`flashfsdp.kernels.reference`; :mod:`flashfsdp.kernels.dispatch` picks and can force one.
The op modules share these names (``flashfsdp.kernels.flatten`` is the function once this package
is imported); reach a module's contents with ``from flashfsdp.kernels.flatten import ...``.
This package imports nothing from ``flashfsdp.runtime`` or ``flashfsdp.bindings``.
"""

# dispatch imports the op modules (flashfsdp.kernels.flatten, ...) before the names below rebind
# the package attributes to the functions; importing an op module again later does not undo that.
from flashfsdp.kernels.dispatch import (accumulate_grad_shard, accumulate_grad_shards, dequantize_int8,
                                       dequantize_reduce, flatten, quantize_grad, quantize_int8, unflatten)
from flashfsdp.kernels.plans import FlattenPlan, UnflattenPlan

__all__ = ["flatten", "unflatten", "accumulate_grad_shard", "accumulate_grad_shards", "quantize_int8", "dequantize_int8",
           "quantize_grad", "dequantize_reduce", "FlattenPlan", "UnflattenPlan"]
