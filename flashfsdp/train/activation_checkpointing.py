"""--activation-checkpointing: each transformer block recomputes its activations in backward.

Through torch's own `apply_activation_checkpointing` with a non-reentrant `checkpoint_wrapper`
around every `Block`, applied to the unsharded (meta-device) model before `fully_shard`, as the
FSDP2 recipes do (e.g. torchtitan: activation checkpointing, then sharding each wrapped block).
Each wrapper becomes one flashfsdp unit; in backward the runtime unshards the unit's parameters
for the recomputed forward (see [Note: recomputation] in `flashfsdp.bindings.state`). Results
equal the run without: only memory and time change.
"""

from __future__ import annotations

import functools

from torch import nn

from flashfsdp._torch_private import CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper

from flashfsdp.models import Block


def checkpoint_blocks(model: nn.Module) -> int:
    """Wrap every `Block` of `model` in place in a non-reentrant `checkpoint_wrapper`.

    Args:
        model: the model, not yet sharded (on any device, the meta device included).

    Returns:
        The number of blocks wrapped.

    Raises:
        ValueError: `model` holds no `Block` (nothing would be recomputed).
    """
    blocks = sum(isinstance(m, Block) for m in model.modules())
    if blocks == 0:
        raise ValueError(f"activation checkpointing: {type(model).__name__} holds no Block to wrap")
    wrapper = functools.partial(checkpoint_wrapper, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper,
                                   check_fn=lambda m: isinstance(m, Block))
    return blocks
