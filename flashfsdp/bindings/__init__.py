"""The PyTorch layer: ``fully_shard``, ``FSDPModule``, the hooks, gradient clipping, state dicts.

Its public names are the ones below, all of them in ``flashfsdp.__all__``; the rest of the library
(``flashfsdp.checkpoint``, ``flashfsdp.fsdp1``, ``flashfsdp.optim``, ``flashfsdp.estimate``, the
training job) imports the bindings only through these names and the public state-dict package
``flashfsdp.bindings.state_dict``, never a module of the bindings (``tests/test_architecture.py``).
"""

from .clip_grad import clip_grad_norm_
from .fsdp_module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from .fully_shard import fully_shard
from .functional import all_gather_with_grad
from .grad_scaler import ShardedGradScaler
from .mixed_precision import (CPUOffloadPolicy, DataParallelMeshDims, MixedPrecisionPolicy, OffloadPolicy,
                              QuantizedReduce)
from .state_dict import (get_full_state_dict, get_optimizer_state_dict, save_pretrained, set_full_state_dict,
                         set_optimizer_state_dict)

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "MixedPrecisionPolicy",
    "QuantizedReduce",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "clip_grad_norm_",
    "ShardedGradScaler",
    "all_gather_with_grad",
    "get_full_state_dict",
    "set_full_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "save_pretrained",
]
