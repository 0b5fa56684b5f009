"""fully_shard's argument checks and parameter collection (FSDP2's ``_fsdp_init``).

Everything here runs once per ``fully_shard`` call, before the unit exists: which modules, which
parameters (and every place each is registered), on which device, over which process group, and
the one resolved meaning of ``reshard_after_forward``.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from flashfsdp.kernels.validation import SUPPORTED_DTYPES
from flashfsdp.runtime.comm_factory import KINDS, default_group, register_siblings
from flashfsdp.runtime.communicator import Communicator
from flashfsdp.runtime.sharding_spec import ShardingSpec, is_dtensor
from flashfsdp.runtime.param_tags import tag_of
from flashfsdp.runtime.step import ReshardAfterForward, resolve_reshard_after_forward  # noqa: F401 - fully_shard's

from .mixed_precision import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy


def check_modules(module) -> list[nn.Module]:
    """The modules of one fully_shard call: one module, or a non-empty list/tuple of them.

    Raises:
        TypeError: not an ``nn.Module`` or a list/tuple of them.
        ValueError: an empty list, a module twice, a module already fully_shard'ed, or a
            ``ModuleList``/``ModuleDict`` (no forward to hook).
    """
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard: got an empty list of modules; pass a module or a non-empty list of modules")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard: module must be an nn.Module or a list of them, got {type(m).__name__}")
        if isinstance(m, (nn.ModuleList, nn.ModuleDict)) and type(m).forward is nn.Module.forward:
            raise ValueError(
                f"fully_shard does not support containers that do not implement forward: {type(m).__name__}; "
                f"fully_shard its modules (each, or as one unit: fully_shard(list(container)))")
        if m.__dict__.get("_flashfsdp_state") is not None:
            raise ValueError(f"fully_shard: {type(m).__name__} is already fully_shard'ed; call fully_shard once per module")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard: the same module appears twice in the list; pass each module once")
    return modules


def check_mp_policy(mp_policy) -> MixedPrecisionPolicy:
    """flashfsdp's policy as it is; torch's ``MixedPrecisionPolicy`` converted field by field.

    Raises:
        TypeError: anything else.
    """
    if isinstance(mp_policy, MixedPrecisionPolicy):
        return mp_policy
    try:
        from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy  # noqa: PLC0415
    except ImportError:  # torch built without distributed
        TorchPolicy = None
    if TorchPolicy is not None and isinstance(mp_policy, TorchPolicy):
        return MixedPrecisionPolicy(mp_policy.param_dtype, mp_policy.reduce_dtype, mp_policy.output_dtype,
                                    mp_policy.cast_forward_inputs)
    raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")


def check_offload_policy(offload_policy) -> tuple[bool, bool]:
    """``(offload, pin_memory)`` of an offload policy: None or either package's ``OffloadPolicy()``
    base (no offloading), or either package's ``CPUOffloadPolicy(pin_memory)``.

    Raises:
        TypeError: anything else.
    """
    accepted, cpu = [OffloadPolicy], [CPUOffloadPolicy]
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPU, OffloadPolicy as TorchBase  # noqa: PLC0415

        accepted.append(TorchBase)
        cpu.append(TorchCPU)
    except ImportError:  # torch built without distributed
        pass
    if offload_policy is None or type(offload_policy) in accepted:
        return False, False
    if isinstance(offload_policy, tuple(cpu)):
        return True, bool(offload_policy.pin_memory)
    raise TypeError(
        f"fully_shard: offload_policy must be None, OffloadPolicy() or CPUOffloadPolicy() (flashfsdp's or "
        f"torch.distributed.fsdp's), got {offload_policy!r}"
    )


def check_communicator_kind(communicator) -> None:
    """Raises ValueError unless ``communicator`` is a known kind name or a Communicator."""
    if communicator not in KINDS and not isinstance(communicator, Communicator):
        raise ValueError(f"fully_shard: communicator must be one of {KINDS} or a Communicator, got {communicator!r}")


@dataclass
class CollectedParams:
    """The parameters of one unit.

    Attributes:
        params: each parameter once (the originals, identical on every rank).
        fqns: each one's name relative to the module it was found under.
        registrations: per parameter, every ``(submodule, attribute name)`` holding it.
        owners: per parameter, the module of the fully_shard call it was found under.
        nested: ``(path, child)`` of every fully_shard'ed module met below, per calling module.
    """

    params: list[nn.Parameter]
    fqns: list[str]
    registrations: list[list[tuple[nn.Module, str]]]
    owners: list[nn.Module]
    nested: list[tuple[nn.Module, str, nn.Module]]


def collect_params(modules: list[nn.Module], ignored: set[int]) -> CollectedParams:
    """The parameters the unit takes over: those of ``modules`` not owned by a nested unit, not in
    ``ignored``, each once (a shared parameter keeps all its registrations).

    Raises:
        ValueError: a parameter that another unit already took over (shared with a separately
            wrapped module, e.g. tied weights); a 0-dim parameter (as FSDP2).
        TypeError: a non-floating-point parameter that requires grad (one that does not is left
            replicated, see :func:`_left_replicated`).
    """
    out = CollectedParams([], [], [], [], [])
    index: dict[int, int] = {}
    for top in modules:
        stack = [("", top)]
        while stack:
            prefix, mod = stack.pop()
            for name, param in mod._parameters.items():
                if param is None or id(param) in ignored or _left_replicated(param):
                    continue
                fqn = f"{prefix}{name}"
                _check_param(param, fqn, top)
                if id(param) in index:
                    out.registrations[index[id(param)]].append((mod, name))
                    continue
                index[id(param)] = len(out.params)
                out.params.append(param)
                out.fqns.append(fqn)
                out.registrations.append([(mod, name)])
                out.owners.append(top)
            for name, child in reversed(list(mod._modules.items())):
                if child is None:
                    continue
                if child.__dict__.get("_flashfsdp_state") is not None:
                    out.nested.append((top, f"{prefix}{name}", child))
                    continue
                if _managed_by_another_api(child):
                    continue  # e.g. torch's composable replicate: its parameters are not ours
                stack.append((f"{prefix}{name}.", child))
    return out


def _check_param(param: nn.Parameter, fqn: str, top: nn.Module) -> None:
    tag = tag_of(param)
    if tag is not None:  # a sharded parameter: its module was wrapped by an enclosing call already
        raise ValueError(
            f"fully_shard: parameter '{fqn}' of {type(top).__name__} already belongs to the unit of an earlier "
            f"fully_shard call (unit '{tag.unit.name}', where it is '{tag.fqn}'); call fully_shard "
            f"bottom-up: inner modules first, then their parents"
        )
    taken = getattr(param, "_flashfsdp_taken_by", None)
    if taken is not None:  # the original of a parameter another unit took over: shared
        raise ValueError(
            f"fully_shard: parameter '{fqn}' of {type(top).__name__} is shared with {taken}, wrapped by an "
            f"earlier fully_shard call (e.g. tied embedding and output weights). A parameter must live in one "
            f"unit: pass the modules that share it to one call, fully_shard([module_a, module_b]), or "
            f"fully_shard only a module that contains all its users"
        )
    if param.dim() == 0:
        raise ValueError(
            f"fully_shard doesn't support scalar parameters. Change {fqn} to a 1D tensor with numel equal to 1. "
            f"(FSDP2 shards every parameter along dim 0, so a 0-dim parameter has nothing to shard; pass it in "
            f"ignored_params to leave it replicated)")
    if param.dtype not in SUPPORTED_DTYPES:
        raise TypeError(
            f"fully_shard: parameter '{fqn}' has dtype {param.dtype} and requires grad; only float32, bfloat16, "
            f"float16 and float64 parameters are sharded: pass it in ignored_params or register it as a buffer"
        )


def check_no_tensor_parallel(collected: CollectedParams, feature: str, instead: str) -> None:
    """Raises NotImplementedError naming the first tensor-parallel (DTensor) parameter, for a
    ``feature`` that does not support them (``instead``: what to do)."""
    for param, fqn in zip(collected.params, collected.fqns):
        if is_dtensor(param):
            raise NotImplementedError(
                f"fully_shard: parameter '{fqn}' is a tensor-parallel DTensor (placements {tuple(param.placements)}), "
                f"and {feature} is not supported with tensor parallelism; {instead}")


def _managed_by_another_api(module: nn.Module) -> bool:
    """Whether torch's ``replicate`` or torch's own ``fully_shard`` manages ``module`` (then its
    parameters are not this unit's; composable ``checkpoint`` does not own parameters)."""
    try:
        from flashfsdp._torch_private import get_registry as _get_registry  # noqa: PLC0415
    except ImportError:  # torch built without distributed
        return False
    registry = _get_registry(module) or {}
    return "replicate" in registry or "fully_shard" in registry


def register_composable(modules: list[nn.Module]) -> None:
    """Enter ``fully_shard`` in torch's composable-API registry of each module, as torch's own
    ``fully_shard`` does: torch's ``replicate`` then leaves the unit's parameters alone (it would
    otherwise take the sharded pieces for replicated parameters and broadcast rank 0's over the
    others') and refuses to be applied to the same module."""
    try:
        from flashfsdp._torch_private import REGISTRY_KEY, RegistryItem  # noqa: PLC0415
    except ImportError:  # torch built without distributed
        return
    for m in modules:
        registry = getattr(m, REGISTRY_KEY, None)
        if registry is None:
            registry = OrderedDict()
            setattr(m, REGISTRY_KEY, registry)
        registry["fully_shard"] = RegistryItem()


def _left_replicated(param: nn.Parameter) -> bool:
    """A frozen parameter of a dtype the flat kernels do not move (integers, fp8): it has no
    gradient to reduce, so it stays a plain, replicated parameter of its module, as if in
    ``ignored_params`` (FSDP2 shards it and never reduces it)."""
    return param.dtype not in SUPPORTED_DTYPES and not param.requires_grad


def mark_taken(params: Iterable[nn.Parameter], owner: str) -> None:
    """Remember on each original parameter which unit took it over (for :func:`_check_param`)."""
    for p in params:
        p._flashfsdp_taken_by = owner


def unit_device(modules: list[nn.Module], params: list[nn.Parameter], mesh) -> torch.device:
    """The device of the unit's parameters (``meta`` allowed: they are materialised by to_empty);
    for a unit without parameters of its own, the mesh's device type, or without a mesh the
    device of its submodules' parameters and buffers (not meta), or :func:`default_device_type`.

    Raises:
        ValueError: parameters on several devices.
    """
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(
            f"fully_shard: {type(modules[0]).__name__} has parameters on several devices "
            f"({sorted(map(str, devices))}); move the module to one device first (module.to(device))"
        )
    if devices:
        device = devices.pop()
    elif mesh is not None:  # a unit with no parameters of its own (a root over its blocks' units)
        device = torch.device(mesh.device_type)
    else:  # ... computes where its submodules' tensors are (meta ones are materialised later), else
        # on FSDP2's default mesh's device
        device = next((t.device for m in modules for t in (*m.parameters(), *m.buffers()) if not t.is_meta), None)
        device = device or torch.device(default_device_type())
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def target_device(device: torch.device, mesh, offload: bool = False) -> torch.device:
    """Where a unit computes once materialised: ``device``, or for the meta device (and with CPU
    offload, whose parameters live on the CPU) the mesh's device type, or without a mesh
    :func:`default_device_type` (FSDP2's default mesh: the accelerator, else the CPU)."""
    if device.type != "meta" and not (offload and device.type == "cpu"):
        return device
    kind = mesh.device_type if mesh is not None else default_device_type()
    return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)


def default_device_type() -> str:
    """The device type of FSDP2's default mesh (``mesh=None``): the current accelerator's
    (``"cuda"`` on a GPU machine, whatever the process group's backend), else ``"cpu"``."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None and accelerator.is_available():
        return accelerator.current_accelerator().type
    return "cpu"


_default_meshes: dict[str, object] = {}


def sharding_spec(mesh, comm: Communicator, device: torch.device) -> ShardingSpec:
    """How the unit's parameters are shown: DTensors on ``mesh`` with FSDP2's placements —
    ``(Shard(0),)`` on a 1-D mesh, ``(Replicate(), Shard(0))`` on an HSDP mesh. Without a mesh,
    on the 1-D mesh of the communicator's process group (the default group's, built once per
    device type, as FSDP2's default mesh); a single process without ``torch.distributed``
    gets plain tensors (``ShardingSpec(None)``).

    Raises:
        ValueError: a communicator over several ranks with no process group to build a mesh on.
    """
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415
    from torch.distributed.tensor import Replicate, Shard  # noqa: PLC0415

    if mesh is not None:
        return ShardingSpec(mesh, (Shard(0),) if mesh.ndim == 1 else (Replicate(), Shard(0)))
    if not (dist.is_available() and dist.is_initialized()):
        if comm.world_size > 1:
            raise ValueError(f"fully_shard: communicator {type(comm).__name__} spans {comm.world_size} ranks but "
                             f"torch.distributed is not initialised: call dist.init_process_group first")
        return ShardingSpec(None)
    kind = "cpu" if device.type == "meta" else device.type
    group = getattr(comm, "group", None)
    if group is not None and group is not dist.group.WORLD:
        return ShardingSpec(DeviceMesh.from_group(group, kind), (Shard(0),))
    if comm.world_size != dist.get_world_size():
        raise ValueError(
            f"fully_shard: communicator {type(comm).__name__} spans {comm.world_size} ranks, the default process "
            f"group {dist.get_world_size()}, and it has no process group to build the parameters' DeviceMesh on; "
            f"pass mesh=DeviceMesh.from_group(<its group>, device_type) as well")
    world, mesh = _default_meshes.get(kind, (None, None))
    if world is not dist.group.WORLD:  # (a new default group since: a new mesh)
        world, mesh = dist.group.WORLD, DeviceMesh.from_group(dist.group.WORLD, kind)
        _default_meshes[kind] = (world, mesh)
    return ShardingSpec(mesh, (Shard(0),))


@dataclass(frozen=True)
class MeshGroups:
    """The process groups of ``fully_shard``'s mesh (FSDP2's ``FSDPMeshInfo`` / ``HSDPMeshInfo``).

    Attributes:
        shard: the group the unit is sharded over (all-gather and reduce-scatter): a 1-D mesh's
            group, or dim 1 of a 2-D mesh; None for a single process without torch.distributed.
        replicate: dim 0 of a 2-D (HSDP) mesh, across which the reduce-scattered shards are
            all-reduced; None for a 1-D mesh.
    """

    shard: object
    replicate: object = None


def mesh_groups(mesh, device: torch.device) -> MeshGroups:
    """The shard and replicate groups of a 1-D or 2-D (HSDP) ``DeviceMesh`` of ``device``'s type
    (no mesh: the default group). As in FSDP2 (``_fsdp_init._get_mesh_info``), dim 0 of a 2-D
    mesh replicates and dim 1 shards, and a 2-D mesh must name its dims.

    Raises:
        TypeError: ``mesh`` is not a DeviceMesh.
        ValueError: a mesh of more than 2 dims; a 2-D mesh without ``mesh_dim_names``, or whose
            names say the dims are the other way round (dim 0 "shard" or dim 1 "replicate"); a
            mesh of another device type than the parameters; a mesh that does not hold this rank.
    """
    if mesh is None:
        return MeshGroups(default_group())
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a torch.distributed DeviceMesh or None, got {type(mesh).__name__}")
    _check_mesh_dims(mesh)
    if mesh.device_type != device.type:
        raise ValueError(
            f"fully_shard: mesh is of device type '{mesh.device_type}' but the module's parameters are on "
            f"{device}; build the mesh with init_device_mesh('{device.type}', ...) or move the module"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(
            f"fully_shard: this process (rank {dist.get_rank()}) is not in the mesh {mesh.mesh.tolist()}; call "
            f"fully_shard only on the ranks of its mesh, or build the mesh over this rank's group"
        )
    if mesh.ndim == 1:
        return MeshGroups(mesh.get_group())
    shard = mesh.get_group(1)
    register_siblings(shard, [list(map(int, row)) for row in mesh.mesh.tolist()])  # every replica's shard group
    return MeshGroups(shard, mesh.get_group(0))


def _check_mesh_dims(mesh) -> None:
    """Raises ValueError unless ``mesh`` is 1-D, or 2-D with dim names in FSDP2's order."""
    if mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard: mesh must be a 1-D DeviceMesh (FSDP) or a 2-D one (HSDP: dims (replicate, shard)), "
            f"got {mesh.ndim} dimensions {mesh.mesh_dim_names or ''}; pass the data-parallel dims only, e.g. "
            f"mesh['dp'] or mesh['dp_replicate', 'dp_shard'] (the tensor-parallel dim is the one "
            f"parallelize_module was given)"
        )
    if mesh.ndim == 1:
        return
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            "fully_shard: Please init the 2D mesh for HSDP with mesh_dim_names specified, e.g. "
            "init_device_mesh(device_type, (replicas, shard_size), mesh_dim_names=('replicate', 'shard'))"
        )
    if names[0] == "shard" or names[1] == "replicate":
        raise ValueError(
            f"fully_shard: the 2-D mesh's dims are named {names}, but HSDP replicates across dim 0 and shards "
            f"across dim 1 (as FSDP2); build it as init_device_mesh(..., (replicas, shard_size), "
            f"mesh_dim_names=('replicate', 'shard'))"
        )


def check_communicator_matches(comm: Communicator, group) -> None:
    """Raise ValueError unless ``comm`` has the world size and rank of the mesh's ``group``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if comm.world_size != world or comm.rank != rank:
        raise ValueError(
            f"fully_shard: communicator {type(comm).__name__} has world size {comm.world_size} and rank "
            f"{comm.rank}, but the mesh's group has world size {world} and this process is its rank {rank}; "
            f"pass a communicator over the mesh's group, or communicator='auto' to build one"
        )


def check_shard_placement_fn(fn: Callable | None, params: list[nn.Parameter], fqns: list[str]) -> list[int] | None:
    """FSDP2's ``shard_placement_fn``: each parameter's shard dim, normalised to ``0 <= k < ndim``.

    ``fn`` is called once per parameter (the full, unsharded ``nn.Parameter``) and returns
    ``Shard(k)`` or None (``Shard(0)``), as FSDP2's.

    [Note: shard placements]
    A parameter placed ``Shard(k)`` is sharded as FSDP2 shards it: its sharded parameter is a
    DTensor of the full shape placed ``(Shard(k),)`` on the unit's mesh (HSDP
    ``(Replicate(), Shard(k))``), whose local tensor is this rank's chunk
    ``torch.chunk(p, W, dim=k)[r]`` (contiguous; empty past the end); its gradient is a DTensor of
    the same placement. In the unit's flat shard the chunk is padded to ceil(d_k / W) rows like a
    dim-0 chunk (``runtime/layout.py``, [Note: Shard(k) parameters]). The all-gather and
    reduce-scatter are the unit's one collective each; only the moves between the flat buffers
    and the full parameter or gradient differ: a dim-0 chunk is one run of the full tensor (the
    ``flatten``/``unflatten`` kernels move all of them in one launch), a chunk along k != 0 is
    not, so those parameters are copied along k with torch ops (``runtime/dim_chunks.py``: one
    extra copy per parameter and direction, as FSDP2's ``torch.cat``/``torch.chunk`` for them).
    Unlike FSDP2, a dim k != 0 whose size W does not divide is accepted (chunks as
    ``torch.chunk``'s, as DTensor's ``distribute_tensor`` cuts them), since the local chunk is
    contiguous here.

    Returns:
        None when ``fn`` is None or every placement is ``Shard(0)``/None, else one dim per parameter.

    Raises:
        TypeError: ``fn`` is not callable.
        ValueError: ``fn`` returns something other than a ``Shard`` or None (e.g. ``Replicate()``),
            or a dim out of range for the parameter (``-ndim <= k < ndim``); the parameter is named.
        NotImplementedError: ``fn`` returns a ``ShardPlacementResult`` (a mesh of its own for one
            parameter) or a ``_StridedShard``.
    """
    if fn is None:
        return None
    if not callable(fn):
        raise TypeError(f"fully_shard: shard_placement_fn must be callable or None, got {type(fn).__name__}")
    dims = [_placement_dim(fn(param), param, fqn) for param, fqn in zip(params, fqns)]
    return dims if any(dims) else None


def _placement_dim(placement, param: nn.Parameter, fqn: str) -> int:
    """The dim ``placement`` (one result of ``shard_placement_fn``) shards ``param`` along."""
    from torch.distributed.tensor import Shard  # noqa: PLC0415

    if placement is None:
        return 0
    if type(placement).__name__ == "ShardPlacementResult" or (isinstance(placement, Shard) and type(placement) is not Shard):
        raise NotImplementedError(
            f"fully_shard: shard_placement_fn returned {placement!r} for parameter '{fqn}': only Shard(dim) on the "
            f"unit's mesh (or None) is supported; return Shard(dim) for it")
    if not isinstance(placement, Shard):
        raise ValueError(
            f"fully_shard: shard_placement_fn returned {placement!r} for parameter '{fqn}': it must return "
            f"Shard(dim) or None (Shard(0)); FSDP shards every parameter, so leave a parameter replicated "
            f"by passing it in ignored_params instead")
    ndim = param.dim()
    if not -ndim <= placement.dim < ndim:
        raise ValueError(
            f"fully_shard: shard_placement_fn returned Shard({placement.dim}) for parameter '{fqn}' of shape "
            f"{tuple(param.shape)}, but a {ndim}-D parameter has dims {-ndim}..{ndim - 1}; return a dim in that "
            f"range")
    return placement.dim % ndim
