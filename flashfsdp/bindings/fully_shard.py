"""fully_shard(): the drop-in for ``torch.distributed.fsdp.fully_shard``.

``fully_shard(module)`` makes one unit of the module's parameters that no nested fully_shard'ed
module owns, shards it across the mesh's ranks at once (the module's parameters become this rank's
local pieces, so an optimizer can be built right after), and installs the forward hooks that
unshard and reshard it. Call it bottom-up: on the blocks first, then on the root. A list of modules
makes one unit of all of them (FSDP2's module grouping). Modules may live on the meta device:
``to_empty`` then materialises only this rank's shards, DTensors initialised by DTensor's ops as
FSDP2's (``set_unsharded_init``: as the unsharded model, ``runtime/init_window.py``). A single process
needs no process group: without ``torch.distributed`` initialised (and no ``WORLD_SIZE`` > 1 in
the environment) a unit has W = 1 and trains as a plain module.

[Note: reshard_after_forward]
True frees the unsharded parameters after forward and all-gathers them again in backward (ZeRO-3);
False keeps them until backward ends (ZeRO-2-like, more memory). An int k dividing W, as in FSDP2:
after forward keep 1/k of the parameters and all-gather in backward over k consecutive ranks only
(ZeRO++ hpZ, Wang et al. 2023); W means True, 1 means False. None (the default, as in FSDP2):
True, except for the root, which keeps its parameters for the backward that starts right after,
and for the unit whose forward ends last before the root's (the first the backward needs; see
``runtime/schedule.py``). An explicit value is followed exactly, the root's too.

[Note: CPU offload]
With ``CPUOffloadPolicy(pin_memory)`` the shards, their gradients and so the optimizer state live
in (pinned) CPU memory and the optimizer steps there; each unshard copies this rank's shard to the
compute device (the mesh's, or CUDA under an NCCL process group) before the all-gather, and each
reduced gradient shard is copied back to be accumulated on the host.

[Note: HSDP]
With a 2-D ``DeviceMesh`` of shape (R, S) and dims (replicate, shard) (FSDP2's hybrid sharding:
``init_device_mesh(device, (R, S), mesh_dim_names=("replicate", "shard"))``) a unit is sharded
over its shard group of S ranks only: its parameters are this rank's 1-D pieces of an S-way
flat layout, identical across the R replicas; all-gathers and reduce-scatters run within the
shard group, and each reduce-scattered shard is then all-reduced across the replicate group
(``runtime/reduce.py``), so that the gradients are divided by the whole world size R·S, as
FSDP2 does. ``set_requires_all_reduce(False)`` reduce-scatters but keeps the shards unsynced
across replicas (summed until the next all-reduce), ``set_requires_gradient_sync(False)`` skips
both. ``reshard_after_forward=<int>`` divides S.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch.nn as nn

from flashfsdp.runtime.comm_factory import (communicator_for, node_communicators, post_forward_communicator,
                                            resolve_kind)
from flashfsdp.runtime.quantized_reduce import QuantizedReducer, check_reduce_quantization
from flashfsdp.runtime.communicator import Communicator
from flashfsdp.runtime.unit import ShardedUnit

from . import _init
from .fsdp_module import FSDPModule
from .mixed_precision import MixedPrecisionPolicy, OffloadPolicy
from .state import FSDPState
from .optimizer_hooks import register_optimizer_hooks
from .state_dict.sharded import install_state_dict_hooks
from .torch_state import install_torch_state


def fully_shard(module: nn.Module | list[nn.Module], *, mesh=None, reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable | None = None, mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
                offload_policy: OffloadPolicy = OffloadPolicy(), ignored_params: Iterable[nn.Parameter] | None = None,
                dp_mesh_dims=None, communicator: str | Communicator = "auto"):
    """Shard ``module``'s parameters across ranks as one unit (FSDP / ZeRO-3).

    Args:
        module: one module, or a list of modules sharded as one unit (e.g. an embedding and an
            output layer sharing a weight): their floating-point parameters on one device (meta
            too) that no nested fully_shard'ed module owns and ``ignored_params`` leaves out.
        mesh: a 1-D ``DeviceMesh`` whose group shards the unit, or a 2-D one of dims
            (replicate, shard) for HSDP (see [Note: HSDP]). None: the default process group, or a
            single rank (W = 1) when torch.distributed is not initialised. With tensor parallelism:
            the DP dim(s) of the TP mesh's mesh, ``mesh["dp"]`` (``runtime/tensor_parallel.py``).
        reshard_after_forward: True, False, an int k dividing W (ZeRO++ hpZ) or None (the default); see
            [Note: reshard_after_forward].
        shard_placement_fn: FSDP2's per-parameter placement: called once per parameter with the
            full (unsharded) parameter, it returns ``Shard(k)`` (any dim of it, negative counted
            from the end) or None (``Shard(0)``); the sharded parameter is then a DTensor placed
            ``(Shard(k),)`` (HSDP ``(Replicate(), Shard(k))``) whose local tensor is this rank's
            chunk along k (see [Note: shard placements] in ``_init.py``).
        mp_policy: ``param_dtype`` for forward/backward, ``reduce_dtype`` for the reduce-scatter
            (flashfsdp's or torch's ``MixedPrecisionPolicy``).
        offload_policy: ``OffloadPolicy()`` (the default) or None: no offloading; ``CPUOffloadPolicy``
            (flashfsdp's or torch's): see [Note: CPU offload].
        ignored_params: parameters left as they are (not sharded, gradients not reduced).
        dp_mesh_dims: None only (torch 2.13's SPMD-mesh form is refused: :func:`_check_dp_mesh_dims`).
        communicator: "auto" (NCCL through CuPy for CUDA modules, else the process group), "nccl", "process_group",
            or a ``Communicator`` (over the mesh's group; HSDP: its shard group, the replicate one gets its kind).

    Returns ``module`` (or the list), whose classes now also derive from :class:`FSDPModule`.

    Raises:
        ValueError: a module already fully_shard'ed; an empty list; parameters on several devices; a
            0-dim parameter; a parameter already owned by another unit; a mesh of more than 2 dims, a 2-D mesh
            without dim names (or named the other way round), a mesh of another device type or
            without this rank; a ``Communicator`` not over the mesh's (shard) group; an unknown communicator; a
            ``reshard_after_forward`` int that does not divide W; a bad ``shard_placement_fn`` result.
        TypeError: not an ``nn.Module`` or list of them; a bad parameter dtype, ``mp_policy``,
            ``offload_policy``, ``shard_placement_fn`` (not callable) or ``reshard_after_forward``.
        RuntimeError: W > 1 requested (``WORLD_SIZE`` set) but torch.distributed not initialised.
        NotImplementedError: a ``ShardPlacementResult`` from ``shard_placement_fn``; what tensor
            parallelism does not support (``TensorParallelSpec``, ``reshard_after_forward=<int>``); ``dp_mesh_dims``.
    """
    modules = _init.check_modules(module)
    _check_dp_mesh_dims(dp_mesh_dims, mesh)
    mp_policy = _init.check_mp_policy(mp_policy)
    offload, pin_memory = _init.check_offload_policy(offload_policy)
    _init.check_communicator_kind(communicator)
    collected = _init.collect_params(modules, {id(p) for p in (ignored_params or ())})
    shard_dims = _init.check_shard_placement_fn(shard_placement_fn, collected.params, collected.fqns)
    device = _init.unit_device(modules, collected.params, mesh)
    target = _init.target_device(device, mesh, offload)
    if offload and device.type != "meta":
        device = target  # the compute device; the shards go to the CPU
    groups = _init.mesh_groups(mesh, target)
    unit, resolved = _build_unit(modules, collected, groups, mesh, communicator, device, target,
                                 reshard_after_forward, mp_policy, offload, pin_memory, shard_dims)
    _install(modules, unit, collected, mp_policy, resolved, (groups.shard, communicator), target)
    return module


def _check_dp_mesh_dims(dp_mesh_dims, mesh) -> None:
    """Refuse torch 2.13's SPMD-mesh form, saying what to pass instead.

    FSDP2 then takes ``mesh`` as the whole SPMD mesh and every parameter (and, in forward, every
    input) as a DTensor on it, ``Replicate()`` on the data-parallel dims; flashfsdp's units shard
    plain or 1-D tensor-parallel parameters over the data-parallel mesh alone.

    Raises:
        NotImplementedError: ``dp_mesh_dims`` is not None; the message names the submesh to pass.
    """
    if dp_mesh_dims is None:
        return
    shard = getattr(dp_mesh_dims, "shard_names", None)
    replicate = getattr(dp_mesh_dims, "replicate_names", ())
    names = tuple(replicate or ()) + tuple(shard or ())
    submesh = f"mesh[{names!r}]" if len(names) > 1 else f"mesh[{names[0]!r}]" if names else "the data-parallel submesh"
    raise NotImplementedError(
        f"fully_shard: dp_mesh_dims={dp_mesh_dims!r} (parameters as DTensors on the whole SPMD mesh {mesh}) is not "
        f"supported by flashfsdp: pass the data-parallel submesh, fully_shard(module, mesh={submesh}), with plain "
        f"parameters, or tensor-parallel ones from parallelize_module on the tensor-parallel submesh")


def _build_unit(modules, collected, groups: _init.MeshGroups, mesh, communicator, device, target,
                reshard_after_forward, mp_policy: MixedPrecisionPolicy, offload: bool, pin_memory: bool,
                shard_dims: list[int] | None = None):
    """The unit's communicator(s) and its ShardedUnit (the shards are cut here); the resolved
    ``reshard_after_forward``."""
    if isinstance(communicator, Communicator):
        if mesh is not None:
            _init.check_communicator_matches(communicator, groups.shard)
        comm = communicator
    else:
        comm = communicator_for(groups.shard, communicator, target)
    replicate_comm = replicate_communicator(groups.replicate, communicator, target)
    resolved = _init.resolve_reshard_after_forward(reshard_after_forward, comm.world_size)
    post_forward_comm = None
    if resolved.post_forward_size is not None:
        _init.check_no_tensor_parallel(collected, f"reshard_after_forward={reshard_after_forward}",
                                       "use reshard_after_forward=True or False (as FSDP2)")
        post_forward_comm = post_forward_communicator(comm, resolved.post_forward_size, communicator, target)
    name = "+".join(type(m).__name__ for m in modules)
    reducer = _quantized_reducer(mp_policy, comm, replicate_comm, communicator, target, name)
    # Named by class here; the root renames every unit by its qualified name at lazy init.
    unit = ShardedUnit(
        name, collected.params, collected.fqns, comm, device,
        param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype, post_forward_comm=post_forward_comm,
        offload=offload, pin_memory=pin_memory, replicate_comm=replicate_comm,
        all_gather_dtype=mp_policy.all_gather_dtype, spec=_init.sharding_spec(mesh, comm, target),
        shard_dims=shard_dims, reduce_quantization=reducer,
    )
    # what FSDP2 passes to a parameter's fsdp_pre_all_gather: the module holding it, the policy
    unit.extension_modules = [regs[0][0] for regs in collected.registrations]
    unit.mp_policy = mp_policy
    return unit, resolved


def _quantized_reducer(mp_policy: MixedPrecisionPolicy, comm, replicate_comm, communicator, target,
                       name: str) -> QuantizedReducer | None:
    """ZeRO++ qgZ's reducer of a unit (``mp_policy.reduce_quantization``), its node groups built
    (collective: every rank builds its units in one order); None without it.

    Raises:
        ValueError: see ``runtime/quantized_reduce.py``, [Note: what qgZ refuses].
    """
    config = check_reduce_quantization(mp_policy.reduce_quantization, comm, replicate_comm, name)
    if config is None:
        return None
    intra, inter = node_communicators(comm, config.local_size, communicator, target)
    return QuantizedReducer(config, comm, intra, inter)


def replicate_communicator(group, communicator: str | Communicator, device):
    """The communicator of an HSDP mesh's replicate group (None for a 1-D mesh, or one replica);
    of the kind ``communicator`` names (a given Communicator's kind follows the device)."""
    if group is None:
        return None
    comm = communicator_for(group, resolve_kind(communicator, device), device)
    return comm if comm.world_size > 1 else None


def _install(modules, unit: ShardedUnit, collected, mp_policy: MixedPrecisionPolicy, resolved, comm_spec,
             target) -> None:
    """Swap the modules' classes to ``FSDP<Class>``, attach the unit's FSDPState and its hooks."""
    _init.mark_taken(collected.params, f"the unit of {unit.name}")
    _init.register_composable(modules)
    for m in modules:
        m.__class__ = fsdp_class(m.__class__)
    state = FSDPState(modules, unit, collected.registrations, mp_policy, resolved, class_name=unit.name,
                      param_owners=collected.owners, comm_spec=comm_spec, compute_device=target)
    for m in modules:
        m.__dict__["_flashfsdp_state"] = state
        # state_dict() yields each unit parameter as its sharded DTensor (also inside forward, when
        # the module holds the unsharded ones); load_state_dict() writes into the shard (state_dict/sharded.py).
        install_state_dict_hooks(m, state)
    install_torch_state(modules, state)  # torch.distributed.fsdp.fully_shard.state(m): torch_state.py
    register_optimizer_hooks()  # one step pre- and post-hook for all optimizers: optimizer_hooks.py
    _adopt_nested(collected.nested, state)


# One FSDP<Class> per original class, as torch keeps (``cls_to_fsdp_cls``): a type per module
# instance would make every block a new class to torch.compile, which recompiles per class.
_FSDP_CLASSES: dict[type, type] = {}


def fsdp_class(cls: type) -> type:
    """``FSDP<cls.__name__>``: a subclass of :class:`FSDPModule` (itself torch's ``FSDPModule``) and
    ``cls``, created once per class."""
    fsdp_cls = _FSDP_CLASSES.get(cls)
    if fsdp_cls is None:
        fsdp_cls = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"_flashfsdp_orig_cls": cls})
        _FSDP_CLASSES[cls] = fsdp_cls
    return fsdp_cls


def _state(module: nn.Module) -> FSDPState | None:
    """The FSDPState of a fully_shard'ed module, None otherwise (``fully_shard.state(module)``, as the
    ``contract`` decorator gives torch's ``fully_shard``)."""
    return module.__dict__.get("_flashfsdp_state")


fully_shard.state = _state


def _adopt_nested(nested: list[tuple[nn.Module, str, nn.Module]], parent: FSDPState) -> None:
    """Nested units become children of ``parent`` (for the root's lazy init), and their parameters'
    names get the prefix of the child module that holds them (names end up fully qualified)."""
    for _, prefix, child in nested:
        for sub in child.modules():
            sub_state = sub.__dict__.get("_flashfsdp_state")
            if sub_state is None:
                continue
            if sub is child and sub_state.parent is None:
                sub_state.parent = parent
            sub_state.prefix_fqns(sub, f"{prefix}.")
