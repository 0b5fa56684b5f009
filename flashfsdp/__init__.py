"""flashfsdp: Fully Sharded Data Parallel (ZeRO-3) for PyTorch with Triton kernels and NCCL via CuPy.

Drop-in names follow PyTorch FSDP2: ``from flashfsdp import fully_shard, MixedPrecisionPolicy``.
A single process (W = 1) needs no process group: without ``torch.distributed`` initialised,
``fully_shard`` makes single-rank units and the model trains as usual.
"""

from flashfsdp import _torch_private  # noqa: F401 - first: the torch version check, then torch's private APIs
from flashfsdp.bindings.clip_grad import clip_grad_norm_
from flashfsdp.bindings.grad_scaler import ShardedGradScaler
from flashfsdp.bindings.fsdp_module import FSDPModule, UnshardHandle, register_fsdp_forward_method, share_comm_ctx
from flashfsdp.bindings.fully_shard import fully_shard
from flashfsdp.bindings.functional import all_gather_with_grad
from flashfsdp.bindings.mixed_precision import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from flashfsdp.bindings.full_state_dict import get_full_state_dict, set_full_state_dict
from flashfsdp.bindings.optim_state_dict import get_optimizer_state_dict, set_optimizer_state_dict
from flashfsdp.bindings.hf_save import save_pretrained  # transformers is imported when it is called
from flashfsdp import checkpoint  # flashfsdp.checkpoint.save / load / latest
from flashfsdp import optim  # flashfsdp.optim.AdamW / SGD: one fused step per unit's flat shard
from flashfsdp.fsdp1 import (  # FSDP1's wrapper API; the rest of its names: flashfsdp.fsdp1
    BackwardPrefetch,
    CPUOffload,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    FullyShardedDataParallel,
    MixedPrecision,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
)
from flashfsdp.runtime.trace import profile
from flashfsdp.runtime import trace_aggregate  # noqa: F401 - registers profile(aggregate=True)
from flashfsdp.estimate import estimate  # the function; its package stays importable as flashfsdp.estimate.*

__all__ = [
    "fully_shard",
    "FSDPModule",
    "UnshardHandle",
    "register_fsdp_forward_method",
    "share_comm_ctx",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "clip_grad_norm_",
    "ShardedGradScaler",
    "all_gather_with_grad",
    "get_full_state_dict",
    "set_full_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "save_pretrained",
    "checkpoint",
    "optim",
    "profile",
    "estimate",
    "FullyShardedDataParallel",
    "ShardingStrategy",
    "BackwardPrefetch",
    "MixedPrecision",
    "CPUOffload",
    "StateDictType",
    "FullStateDictConfig",
    "ShardedStateDictConfig",
    "FullOptimStateDictConfig",
    "ShardedOptimStateDictConfig",
]
