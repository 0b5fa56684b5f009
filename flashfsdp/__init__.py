"""flashfsdp: Fully Sharded Data Parallel (ZeRO-3) for PyTorch with Triton kernels and NCCL via CuPy.

Drop-in names follow PyTorch FSDP2: ``from flashfsdp import fully_shard, MixedPrecisionPolicy``.
A single process (W = 1) needs no process group: without ``torch.distributed`` initialised,
``fully_shard`` makes single-rank units and the model trains as usual.
"""

from flashfsdp import _torch_private  # noqa: F401 - first: the torch version check, then torch's private APIs
from flashfsdp.bindings import (  # the PyTorch layer (transformers: imported when save_pretrained is called)
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FSDPModule,
    MixedPrecisionPolicy,
    OffloadPolicy,
    QuantizedReduce,
    ShardedGradScaler,
    UnshardHandle,
    all_gather_with_grad,
    clip_grad_norm_,
    fully_shard,
    get_full_state_dict,
    get_optimizer_state_dict,
    register_fsdp_forward_method,
    save_pretrained,
    set_full_state_dict,
    set_optimizer_state_dict,
    share_comm_ctx,
)
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
    "QuantizedReduce",
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
