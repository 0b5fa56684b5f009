"""flashfsdp: Fully Sharded Data Parallel (ZeRO-3) for PyTorch with Triton kernels and NCCL via CuPy.

Drop-in names follow PyTorch FSDP2: ``from flashfsdp import fully_shard, MixedPrecisionPolicy``.
A single process (W = 1) needs no process group: without ``torch.distributed`` initialised,
``fully_shard`` makes single-rank units and the model trains as usual.
"""

from flashfsdp.bindings.clip_grad import clip_grad_norm_
from flashfsdp.bindings.fully_shard import FSDPModule, UnshardHandle, fully_shard
from flashfsdp.bindings.functional import all_gather_with_grad
from flashfsdp.bindings.mixed_precision import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from flashfsdp.bindings.sharded_tensor import ShardedPiece
from flashfsdp.bindings.full_state_dict import get_full_state_dict, set_full_state_dict
from flashfsdp.bindings.optim_state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from flashfsdp import checkpoint  # flashfsdp.checkpoint.save / load / latest
from flashfsdp.runtime.trace import profile

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "clip_grad_norm_",
    "all_gather_with_grad",
    "ShardedPiece",
    "get_full_state_dict",
    "set_full_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "checkpoint",
    "profile",
]
