"""Every private PyTorch API flashfsdp uses, imported here and nowhere else, after the torch version check.

PyTorch may rename or drop anything whose name starts with an underscore in any release. So the
rest of flashfsdp reaches such names only through this module: a torch that lacks one fails at
``import flashfsdp`` with an ImportError naming the API and the torch version, instead of an
AttributeError deep inside a training step, and ``tests/test_torch_private.py`` checks that each
name below still exists with the signature and behaviour flashfsdp relies on (it fails on the
torch release that changes one).

The minimum torch (:data:`MIN_TORCH`, the floor in ``setup.py``) is 2.6: the public FSDP2 names
flashfsdp mirrors and accepts as they are (``torch.distributed.fsdp.fully_shard``, ``FSDPModule``,
``MixedPrecisionPolicy``, ``CPUOffloadPolicy``, ``OffloadPolicy``; in torch 2.4-2.5 they lived in
the private ``torch.distributed._composable.fsdp``) first shipped in ``torch.distributed.fsdp`` in
torch 2.6. :func:`check_torch_version` runs when this module is imported, which
``flashfsdp/__init__.py`` does first.
"""

from __future__ import annotations

import datetime
import importlib
import re
from typing import Any

import torch

MIN_TORCH = (2, 6)
MIN_TORCH_REASON = ("torch.distributed.fsdp.fully_shard / FSDPModule / MixedPrecisionPolicy / CPUOffloadPolicy, "
                    "which flashfsdp mirrors and accepts, are public from torch 2.6 on")


def parse_torch_version(version: str) -> tuple[int, int]:
    """``"2.13.0+cpu"`` -> ``(2, 13)``; local and pre-release suffixes (``a0+git...``) are ignored.

    Raises:
        ValueError: a version that does not start with ``MAJOR.MINOR``.
    """
    match = re.match(r"\s*(\d+)\.(\d+)", str(version))
    if match is None:
        raise ValueError(f"torch.__version__ {version!r} does not start with MAJOR.MINOR")
    return int(match.group(1)), int(match.group(2))


def check_torch_version(version: str | None = None) -> None:
    """Refuse a torch older than :data:`MIN_TORCH` (``version`` defaults to ``torch.__version__``).

    Raises:
        ImportError: the version is older, or unreadable; the message names the version found, the
            minimum, why, and the command that installs a suitable torch.
    """
    version = str(torch.__version__ if version is None else version)
    try:
        found = parse_torch_version(version)
    except ValueError as error:
        raise ImportError(f"flashfsdp cannot read the torch version: {error}") from error
    if found < MIN_TORCH:
        minimum = ".".join(map(str, MIN_TORCH))
        raise ImportError(f"flashfsdp needs torch >= {minimum}, found torch {version} ({MIN_TORCH_REASON}): "
                          f"pip install 'torch>={minimum}'")


check_torch_version()


def private(module: str, attribute: str) -> Any:
    """``module.attribute`` (``attribute`` may be dotted: ``"_C._autograd._profiler_enabled"``).

    Raises:
        ImportError: the module or attribute is missing from this torch; the message names the
            private API, the torch version, and the versions flashfsdp is tested with.
    """
    try:
        value = importlib.import_module(module)
        for part in attribute.split("."):
            value = getattr(value, part)
    except (ImportError, AttributeError) as error:
        raise ImportError(
            f"flashfsdp uses the private PyTorch API {module}.{attribute}, which torch {torch.__version__} does not "
            f"have ({type(error).__name__}: {error}). flashfsdp is tested with torch 2.13 (setup.py's floor: "
            f">= {'.'.join(map(str, MIN_TORCH))}): install a tested torch, or see flashfsdp/_torch_private.py for "
            f"what it is used for") from error
    return value


def optional_private(module: str, attribute: str) -> Any:
    """:func:`private`, or None where this torch lacks the API: for the ones flashfsdp can do
    without (its caller has a slower public fallback, and ``tests/test_torch_private.py`` checks
    that the tested torch has it)."""
    try:
        return private(module, attribute)
    except ImportError:
        return None


# ------------------------------------------------------------------------------ custom collectives
# runtime/custom_collectives.py: FSDP2's AllGather / ReduceScatter protocols, the types
# set_custom_all_gather / set_custom_reduce_scatter accept (torch 2.9+).
_FSDP_API = "torch.distributed.fsdp._fully_shard._fsdp_api"


def custom_collective_types() -> tuple[type, type]:
    """``(AllGather, ReduceScatter)``, FSDP2's custom-collective protocols.

    Raises:
        ImportError: this torch has none (named, as :func:`private` names it).
    """
    return private(_FSDP_API, "AllGather"), private(_FSDP_API, "ReduceScatter")


# ---------------------------------------------------------------------------------------- autograd
# bindings/autograd.py: the post-backward gate asks the engine which nodes this backward runs.
current_graph_task_id = private("torch", "_C._current_graph_task_id")  # () -> int, -1 outside backward
will_engine_execute_node = private("torch", "_C._will_engine_execute_node")  # (node) -> bool; RuntimeError on leaves
are_functorch_transforms_active = private("torch", "_C._are_functorch_transforms_active")  # () -> bool
DisableFuncTorch = private("torch", "_C._DisableFuncTorch")  # context manager
# runtime/unit.py: unshard's in-place all-gather must not bump the views' version counters.
unsafe_set_version_counter = private("torch", "_C._autograd._unsafe_set_version_counter")  # (tensors, versions)
# runtime/trace.py: labels are formatted only while torch.profiler records.
profiler_enabled = private("torch", "_C._autograd._profiler_enabled")  # () -> bool
# runtime/elision.py: whether saved-tensor hooks are enabled, and the innermost pair pushed.
saved_tensors_hooks_is_enabled = private("torch", "_C._autograd._saved_tensors_hooks_is_enabled")  # () -> bool
top_saved_tensors_default_hooks = private("torch", "_C._autograd._top_saved_tensors_default_hooks")  # (ignore_is_tracing) -> (pack, unpack) | None

# ------------------------------------------------------------------------------- torch.compile
# bindings/compile_boundary.py: mark the units' hooks so Dynamo skips their frames (fallback:
# torch.compiler.disable, a wrapper with a cost per call).
_EVAL_FRAME = "torch._C._dynamo.eval_frame"
set_code_exec_strategy = optional_private(_EVAL_FRAME, "set_code_exec_strategy")  # (code, strategy)
FrameExecStrategy = optional_private(_EVAL_FRAME, "_FrameExecStrategy")  # (cur_action, recursive_action)
FrameAction = optional_private(_EVAL_FRAME, "_FrameAction")  # enum: DEFAULT, SKIP, RUN_ONLY

# ---------------------------------------------------------------------------- tensor subclasses
# runtime/sharding_spec.py (the DTensor wrappers) and runtime/init_window.py (full-shape stand-ins).
make_wrapper_subclass = private("torch", "Tensor._make_wrapper_subclass")
disabled_torch_function_impl = private("torch", "_C._disabled_torch_function_impl")
DisableTorchFunctionSubclass = private("torch", "_C.DisableTorchFunctionSubclass")
aten_to_copy = private("torch", "ops.aten._to_copy.default")
pytree = private("torch.utils", "_pytree")  # tree_flatten/unflatten/leaves/map/map_only, SUPPORTED_NODES

# ------------------------------------------------------------------------------ multi-tensor ops
# runtime/grad_shard.py: whether anything outside a unit's gradient views shares its gradient buffer.
storage_use_count = private("torch", "_C._storage_Use_Count")  # (storage._cdata) -> tensors + storage objects on it
foreach_copy_ = private("torch", "_foreach_copy_")  # kernels/reference.py
foreach_add_ = private("torch", "_foreach_add_")  # optim/adamw.py: step counters
foreach_sub_ = private("torch", "_foreach_sub_")
foreach_mul_ = private("torch", "_foreach_mul_")  # bindings/clip_grad.py
foreach_mul = private("torch", "_foreach_mul")  # kernels/reference.py: a bucket's accumulation
foreach_norm = private("torch", "_foreach_norm")
foreach_zero_ = private("torch", "_foreach_zero_")  # kernels/reference.py: flatten's gaps
assert_async = private("torch", "_assert_async")  # bindings/clip_grad.py: (tensor, message)

# ---------------------------------------------------------------------------- optimizers, scaler
get_scalar_dtype = private("torch.optim.optimizer", "_get_scalar_dtype")  # (is_fused=None) -> dtype
use_grad_for_differentiable = private("torch.optim.optimizer", "_use_grad_for_differentiable")  # decorator
refresh_per_optimizer_state = private("torch.distributed.fsdp.sharded_grad_scaler", "_refresh_per_optimizer_state")

# ------------------------------------------------------------------------------ torch.distributed
# runtime/sharding_spec.py: a unit's DTensor parameters and gradients built over views of its flat
# shard without DTensor.from_local's per-call argument handling (FSDP2's _from_local_no_grad).
_DTENSOR_SPEC = "torch.distributed.tensor._dtensor_spec"
DTensorSpec = private(_DTENSOR_SPEC, "DTensorSpec")  # (mesh, placements, tensor_meta=TensorMeta)
TensorMeta = private(_DTENSOR_SPEC, "TensorMeta")  # (shape, stride, dtype)
get_default_store = private("torch.distributed.distributed_c10d", "_get_default_store")  # runtime/nccl.py
# runtime/nccl.py: a process group is in c10d_world.pg_map ({ProcessGroup: (backend, store)}) from
# its creation until destroy_process_group removes it; an NcclCommunicator is destroyed with its group.
c10d_world = private("torch.distributed.distributed_c10d", "_world")
get_registry = private("torch.distributed._composable.contract", "_get_registry")  # bindings/_init.py
REGISTRY_KEY = private("torch.distributed._composable.contract", "REGISTRY_KEY")
RegistryItem = private("torch.distributed._composable.contract", "RegistryItem")
# bindings/torch_state.py: torch's own code (pipelining's PipelineStage.perform_reduce_grad) reads a
# unit's state through torch's fully_shard.state(module), the @contract API's per-module state: a
# dict in module.__dict__ under contract's STATE_KEY, keyed by the undecorated function.
COMPOSABLE_STATE_KEY = private("torch.distributed._composable.contract", "STATE_KEY")
# What PipelineStage.perform_reduce_grad (torch 2.13) reads of that state, in order: the state's
# _state_ctx.all_states, each one's _fsdp_param_groups, each group's post_backward(), then the
# state's _root_post_backward_final_callback(). bindings/torch_state.py answers exactly these;
# tests/test_torch_private.py reads the installed torch's method and fails when the set changes.
PIPELINING_STATE_READS = frozenset({"_state_ctx", "all_states", "_fsdp_param_groups", "post_backward",
                                    "_root_post_backward_final_callback"})
# bindings/elision.py (a checkpoint-wrapped unit recomputes, so it gathers in backward) and
# train/activation_checkpointing.py (--activation-checkpointing, as torch's recipes apply it).
_CHECKPOINT_WRAPPER = "torch.distributed.algorithms._checkpoint.checkpoint_wrapper"
ActivationWrapper = private(_CHECKPOINT_WRAPPER, "ActivationWrapper")
CheckpointImpl = private(_CHECKPOINT_WRAPPER, "CheckpointImpl")
apply_activation_checkpointing = private(_CHECKPOINT_WRAPPER, "apply_activation_checkpointing")
checkpoint_wrapper = private(_CHECKPOINT_WRAPPER, "checkpoint_wrapper")
# fsdp1/wrap.py: FSDP1's auto-wrap policies, run as torch runs them.
override_module_mixed_precision = private("torch.distributed.fsdp._common_utils", "_override_module_mixed_precision")
WrapPolicy = private("torch.distributed.fsdp.wrap", "_Policy")
module_wrap_policy = private("torch.distributed.fsdp.wrap", "_module_wrap_policy")
or_policy = private("torch.distributed.fsdp.wrap", "_or_policy")
post_order_apply = private("torch.distributed.fsdp.wrap", "_post_order_apply")
recursive_wrap = private("torch.distributed.fsdp.wrap", "_recursive_wrap")
run_mixed_precision_override_policy = private("torch.distributed.fsdp.wrap", "_run_mixed_precision_override_policy")
wrap_module_cls_individually = private("torch.distributed.fsdp.wrap", "_wrap_module_cls_individually")
sync_params_and_buffers = private("torch.distributed.utils", "_sync_params_and_buffers")  # fsdp1/module_init.py
set_element = private("torch.distributed.checkpoint._traverse", "set_element")  # checkpoint/safe_metadata.py
flatten_state_dict = private("torch.distributed.checkpoint._nested_dict", "flatten_state_dict")  # checkpoint/matching.py
# runtime/tensor_parallel.py: a tensor-parallel parameter's sharded DTensor lives on the DP mesh and its
# TP mesh joined (FSDP2's _spmd_mesh), placed _StridedShard along a dim TP shards too (FSDP2's placements).
concatenate_meshes = optional_private("torch.distributed.device_mesh", "DeviceMesh._concatenate")  # (device_mesh_list)
StridedShard = optional_private("torch.distributed.tensor.placement_types", "_StridedShard")  # (dim, *, split_factor)


# ------------------------------------------------------------------------------------- DTensor
# A DTensor's local tensor is its ``_local_tensor`` slot: read and re-pointed without the autograd
# function behind the public ``to_local()`` (per parameter, in every step's hooks), as FSDP2 does
# (``FSDPParam.reset_sharded_param``).
def dtensor_local(tensor: torch.Tensor) -> torch.Tensor:
    """The local tensor of a DTensor (no copy, no autograd node)."""
    return tensor._local_tensor


def set_dtensor_local(tensor: torch.Tensor, local: torch.Tensor) -> None:
    """Make ``local`` the local tensor of the DTensor ``tensor`` (same shape and dtype as before)."""
    tensor._local_tensor = local


# ------------------------------------------------------------------------- process-group options
# runtime/control.py: a control group gets the timeout of the group it serves. The backend's
# options are public in pybind, but torch.distributed has no accessor for a group's timeout.
def group_timeout(group) -> datetime.timedelta | None:
    """The collective timeout of process group ``group`` (its CPU backend's, else its CUDA
    backend's), None where torch does not tell it."""
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001, S112 - that device has no backend here: try the next
            continue
    return None


def set_composable_state(module, api, state) -> None:
    """Make ``api.state(module)`` return ``state``, where ``api`` is a ``@contract``-decorated
    composable API (torch's ``fully_shard``): its accessor reads ``module.__dict__[STATE_KEY][func]``,
    ``func`` being the function the decorator wrapped (``api.__wrapped__``, from ``functools.wraps``).

    Raises:
        TypeError: ``api`` is not a ``@contract`` API (it has no ``state`` accessor or wrapped function).
    """
    func = getattr(api, "__wrapped__", None)
    if func is None or not callable(getattr(api, "state", None)):
        raise TypeError(f"set_composable_state: api must be a torch @contract API, got {api!r}")
    module.__dict__.setdefault(COMPOSABLE_STATE_KEY, {})[func] = state
