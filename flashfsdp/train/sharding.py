"""Everything `flashfsdp.train` asks of the flashfsdp runtime to build and step the model.

The model is built on the meta device, sharded (one flashfsdp unit per `Block`, then the root),
materialised with `to_empty` (each rank allocates only its shards) and initialised in flashfsdp's
init window, where `Llama.init_weights` acts on the full parameters and gives exactly the values
of an unsharded model with the same seed. The calls are those of PyTorch FSDP2 (`fully_shard`,
`MixedPrecisionPolicy`, `FSDPModule.set_requires_gradient_sync`) imported from `flashfsdp`, plus
`flashfsdp.clip_grad_norm_`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from flashfsdp import MixedPrecisionPolicy, clip_grad_norm_, fully_shard
from flashfsdp.models import Attention, Llama, LlamaConfig
from flashfsdp.models.tp_plan import parallelize_llama_tp
from flashfsdp.train.activation_checkpointing import checkpoint_blocks
from flashfsdp.train.errors import UsageError


def build_mesh(device_type: str, world_size: int, tp: int) -> DeviceMesh | None:
    """The (dp, tp) device mesh of --tp `tp` > 1 over the `world_size` ranks (row-major: the TP
    groups are consecutive ranks, rank = dp_rank * tp + tp_rank), or None for plain FSDP (tp 1).

    Raises:
        ValueError: `tp` does not divide `world_size` (`flashfsdp.train.checks.check_tp` says it
            first, naming --tp).
    """
    if tp == 1:
        return None
    if world_size % tp:
        raise ValueError(f"build_mesh: tp={tp} does not divide world_size={world_size}")
    return init_device_mesh(device_type, (world_size // tp, tp), mesh_dim_names=("dp", "tp"))


def data_parallel(mesh: DeviceMesh | None, rank: int, world_size: int) -> tuple[int, int]:
    """(this rank's data-parallel rank, the data-parallel size): its place in the mesh's "dp"
    dimension, or (rank, world_size) without a mesh. The ranks of one TP group share it, so they
    read the same rows of each batch."""
    if mesh is None:
        return rank, world_size
    return mesh["dp"].get_local_rank(), mesh["dp"].size()


def shard_model(model: Llama, policy: MixedPrecisionPolicy, reshard_after_forward: bool | int | None = None,
                mesh: DeviceMesh | None = None) -> Llama:
    """Shard `model` in place: one flashfsdp unit per `Block`, then the root unit (embeddings,
    final norm, tied output), all with `policy`; with a (dp, tp) `mesh`, over its "dp" ranks.

    Args:
        model: an unsharded `Llama` (on the meta device, or on this rank's device and identical
            on every rank).
        policy: the mixed-precision policy of every unit (`flashfsdp.train.precision`).
        reshard_after_forward: each block's `fully_shard(reshard_after_forward=...)`: None for
            fully_shard's default, True, False, or a number of ranks that divides the world size
            (--reshard-after-forward). The root keeps fully_shard's default: backward needs its
            parameters first.
        mesh: the (dp, tp) mesh of a tensor-parallel `model` (`build_mesh`), or None: all ranks.

    Returns:
        `model`, now also an `FSDPModule`.
    """
    dp = {} if mesh is None else {"mesh": mesh["dp"]}
    for block in model.layers:
        fully_shard(block, mp_policy=policy, reshard_after_forward=reshard_after_forward, **dp)
    fully_shard(model, mp_policy=policy, **dp)
    return model


def build_sharded_model(config: LlamaConfig, device: torch.device, policy: MixedPrecisionPolicy,
                        seed: int | None, activation_checkpointing: bool = False, compiled: bool = False,
                        reshard_after_forward: bool | int | None = None,
                        mesh: DeviceMesh | None = None) -> tuple[Llama, frozenset[str]]:
    """A sharded `Llama` of which this rank only ever materialises its shards.

    Built on the meta device, split over the TP ranks of `mesh` (`parallelize_llama_tp`, with
    sequence parallelism), sharded by `shard_model`, moved with `to_empty(device=device)`;
    then `init_weights(seed)`, or with `seed` None only the rotary tables (the parameters are
    left uninitialised for a checkpoint to be loaded into).

    Args:
        config: the model's shape.
        device: this rank's device.
        policy: the mixed-precision policy of every unit.
        seed: initialisation seed (same values as an unsharded `Llama(config).init_weights(seed)`
            at any world size), or None to skip the initialisation before a checkpoint load.
        activation_checkpointing: wrap each block for recomputation before sharding
            (`flashfsdp.train.activation_checkpointing.checkpoint_blocks`).
        compiled: compile each block once sharded (`compile_blocks`).
        reshard_after_forward: the blocks' setting (see `shard_model`).
        mesh: the (dp, tp) mesh of --tp > 1 (`build_mesh`), or None.

    Returns:
        (model, names of its vector parameters, ndim < 2, read before sharding: the RMSNorm
        weights, which take no weight decay).
    """
    with torch.device("meta"):
        model = Llama(config)
    if mesh is not None:
        parallelize_llama_tp(model, mesh["tp"])
    if activation_checkpointing:
        checkpoint_blocks(model)
    vectors = frozenset(n for n, p in model.named_parameters() if p.dim() < 2)
    shard_model(model, policy, reshard_after_forward, mesh)
    model.to_empty(device=device)
    if seed is None:
        for module in model.modules():
            if isinstance(module, Attention):
                module.reset_buffers()
    else:
        model.init_weights(seed)
    if compiled:
        compile_blocks(model)
    return model, vectors


def clip_grad_norm(model: nn.Module, max_norm: float, tensor_parallel: bool = False) -> float:
    """Clip the sharded gradients to a global 2-norm of `max_norm` (0: only measure it): with
    `flashfsdp.clip_grad_norm_`, or for a tensor-parallel model (--tp) with torch's
    `clip_grad_norm_`, whose DTensor norm sums over the data-parallel and the TP ranks.

    Returns:
        The global gradient norm before clipping, as a float.
    """
    limit = max_norm if max_norm > 0 else float("inf")
    if not tensor_parallel:
        return float(clip_grad_norm_(model, limit))
    norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], limit)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def compile_blocks(model: Llama) -> None:
    """`torch.compile` each block of the sharded `model` in place (`Module.compile`: the block's
    call with its hooks, the default backend; compiled at its first call). flashfsdp's hooks run
    eagerly between the compiled blocks ([Note: compiling sharded modules] in
    `flashfsdp.bindings.compile_boundary`); the root (embeddings, final norm, output) stays eager.
    """
    for block in model.layers:
        block.compile()


def _compile_probe(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x) * 2 + 1


def check_compile(device_type: str) -> None:
    """Check that `torch.compile` with the default backend compiles and runs on `device_type`
    ("cpu" or "cuda"), on a small function, before a --compile run starts: an unsupported
    Python, a missing C++ compiler or Triton would otherwise stop every worker at its first step.

    Raises:
        UsageError: torch.compile fails here; one line naming the error and the fix.
    """
    try:
        torch.compile(_compile_probe, fullgraph=True)(torch.ones(4, device=device_type))
    except Exception as error:  # noqa: BLE001 - any failure of the compiler stack means the same
        cause = _root_cause(error)
        reason = (str(cause).strip().splitlines() or [""])[0]
        raise UsageError(f"--compile: torch.compile does not work on this machine ({type(cause).__name__}: "
                         f"{reason}); run without --compile") from None


def _root_cause(error: BaseException) -> BaseException:
    """The innermost exception under `error` (Dynamo wraps a backend's error in
    `BackendCompilerFailed.inner_exception`, inductor's in `__cause__`)."""
    seen = {id(error)}
    while True:
        inner = getattr(error, "inner_exception", None) or error.__cause__
        if inner is None or id(inner) in seen:
            return error
        seen.add(id(inner))
        error = inner
