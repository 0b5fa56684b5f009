"""fully_shard() and FSDPModule: the drop-in for ``torch.distributed.fsdp.fully_shard``.

``fully_shard(module)`` makes one unit of the module's parameters that no nested fully_shard'ed
module owns, shards it across the mesh's ranks at once (the module's parameters become this rank's
local pieces, so an optimizer can be built right after), and installs the forward hooks that
unshard and reshard it. Call it bottom-up: on the blocks first, then on the root.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn

from flashfsdp.runtime.communicator import Communicator, LocalCommunicator
from flashfsdp.runtime.unit import ShardedUnit

from .mixed_precision import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .state import FSDPState
from .optim_state_dict import register_optimizer_step_hook
from .state_dict import install_state_dict_hooks

_COMMUNICATOR_KINDS = ("auto", "nccl", "process_group")
_communicator_cache: dict[tuple, Communicator] = {}


class UnshardHandle:
    """Returned by ``FSDPModule.unshard(async_op=True)``; ``wait()`` finishes the unshard."""

    def __init__(self, state: FSDPState):
        self._state = state

    def wait(self) -> None:
        """Make the current stream wait for the all-gather and install the unsharded parameters."""
        if self._state is not None:
            self._state.wait_unshard()
            self._state = None


class FSDPModule:
    """Mixin that ``fully_shard`` adds to a module's class (``FSDP<ClassName>``), as FSDP2 does."""

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this unit's parameters; with ``async_op`` return a handle to ``wait()`` on.

        Until :meth:`reshard` (or the end of the next forward/backward that reshards it) the
        module's parameters are the full-shape views into the unsharded buffer.

        Raises:
            ValueError: this module was never passed to ``fully_shard``.
        """
        state = _state_of(self, "unshard")
        state.unshard()
        handle = UnshardHandle(state)
        if async_op:
            return handle
        handle.wait()
        return None

    def reshard(self) -> None:
        """Free the unsharded parameters; the module holds its sharded pieces again.

        Raises:
            ValueError: this module was never passed to ``fully_shard``.
        """
        _state_of(self, "reshard").reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Reduce gradients in backward (True) or accumulate them unsharded, without communication.

        The next backward with sync on reduce-scatters everything accumulated meanwhile.
        ``recurse``: also every fully_shard'ed module below this one.

        Raises:
            ValueError: this module was never passed to ``fully_shard``.
        """
        for state in _states_of(self, recurse, "set_requires_gradient_sync"):
            state.requires_gradient_sync = bool(requires_gradient_sync)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Free the unsharded parameters after backward (True, the default) or keep them.

        Keeping them saves the all-gather of the next forward during gradient accumulation; set it
        back to True for the last micro-batch, since an optimizer step changes only the shards.

        Raises:
            ValueError: this module was never passed to ``fully_shard``.
        """
        for state in _states_of(self, recurse, "set_reshard_after_backward"):
            state.reshard_after_backward = bool(reshard_after_backward)

    def set_reshard_after_forward(self, reshard_after_forward: bool, *, recurse: bool = True) -> None:
        """Free the unsharded parameters after forward (re-gather in backward) or keep them.

        The root always keeps them (its backward starts right after forward).

        Raises:
            ValueError: this module was never passed to ``fully_shard``.
        """
        for state in _states_of(self, recurse, "set_reshard_after_forward"):
            if not state.is_root:
                state.reshard_after_forward = bool(reshard_after_forward)

    def set_max_inflight_all_gathers(self, max_inflight: int) -> None:
        """Let at most ``max_inflight`` units be prefetched (unsharded) ahead of compute.

        Default 2; 0 disables prefetching (each unit is all-gathered when its forward or backward
        starts). Only the root's value counts, for every unit under it: call this on the root,
        i.e. the outermost fully_shard'ed module. The limit bounds what prefetching may ask for:
        implicit prefetching asks for one unit at a time (the next in forward, the previous in
        backward), explicit lists (:meth:`set_modules_to_forward_prefetch`,
        :meth:`set_modules_to_backward_prefetch`) can ask for more and get the first ones that fit.

        Raises:
            ValueError: ``max_inflight`` is not an integer >= 0; this module was never passed to
                ``fully_shard``; or it is not the root (known once the root's first forward ran:
                then here, else at that forward).
        """
        if not isinstance(max_inflight, int) or isinstance(max_inflight, bool) or max_inflight < 0:
            raise ValueError(f"set_max_inflight_all_gathers: max_inflight must be an integer >= 0, got {max_inflight!r}")
        state = _state_of(self, "set_max_inflight_all_gathers")
        if state.ctx is not None and not state.is_root:
            raise ValueError(
                f"set_max_inflight_all_gathers: '{state.unit.name}' is not the root (its root is "
                f"{state.ctx.root.class_name}); only the root's limit is used: call it on the root module"
            )
        state.max_inflight = max_inflight
        state.max_inflight_set = True
        if state.ctx is not None:
            state.ctx.policy.max_inflight = max_inflight

    def set_modules_to_forward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Unshard these units when this one starts its forward (replaces the implicit choice).

        Raises:
            ValueError: this module or one of ``modules`` was never passed to ``fully_shard``.
        """
        where = "set_modules_to_forward_prefetch"
        _state_of(self, where).explicit_forward_prefetch = [_state_of(m, where) for m in modules]

    def set_modules_to_backward_prefetch(self, modules: list["FSDPModule"]) -> None:
        """Unshard these units when this one starts its backward (replaces the implicit choice).

        Raises:
            ValueError: this module or one of ``modules`` was never passed to ``fully_shard``.
        """
        where = "set_modules_to_backward_prefetch"
        _state_of(self, where).explicit_backward_prefetch = [_state_of(m, where) for m in modules]


def _states_of(module: nn.Module, recurse: bool, where: str) -> list[FSDPState]:
    """``module``'s state, and with ``recurse`` those of every fully_shard'ed module below it.

    Raises:
        ValueError: ``module`` itself was never passed to ``fully_shard``.
    """
    states = [_state_of(module, where)]
    if recurse:
        states = [m._flashfsdp_state for m in module.modules() if hasattr(m, "_flashfsdp_state")]
    return states


def _state_of(module: nn.Module, where: str) -> FSDPState:
    state = module.__dict__.get("_flashfsdp_state") if isinstance(module, nn.Module) else None
    if state is None:
        raise ValueError(
            f"{where}: {type(module).__name__} is not a fully_shard'ed module; call flashfsdp.fully_shard on it first"
        )
    return state


def fully_shard(
    module: nn.Module,
    *,
    mesh=None,
    reshard_after_forward: bool | int | None = True,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy | None = None,
    ignored_params: Iterable[nn.Parameter] | None = None,
    communicator: str | Communicator = "auto",
) -> nn.Module:
    """Shard ``module``'s parameters across ranks as one unit (FSDP / ZeRO-3).

    A single process needs no process group: without ``torch.distributed`` initialised (and no
    ``WORLD_SIZE`` > 1 in the environment) the unit has W = 1 and trains as a plain module.

    Args:
        module: one module; its parameters not owned by a nested fully_shard'ed module (and not in
            ``ignored_params``) form the unit. They must be floating-point and on one device. Each
            sharded parameter's ``_flashfsdp_fqn`` is its name relative to the outermost
            ``fully_shard`` call so far (the root's call makes it the model's fully-qualified name).
        mesh: a 1-D ``DeviceMesh`` whose group shards the unit. None: the default process group,
            or a single rank (W = 1) when torch.distributed is not initialised.
        reshard_after_forward: free the unsharded parameters after forward and all-gather again in
            backward (ZeRO-3); False keeps them until backward ends (ZeRO-2-like, more memory). An
            int k dividing W, as in FSDP2: after forward keep 1/k of the parameters and all-gather
            in backward over k consecutive ranks only (ZeRO++ hpZ; k = GPUs per node keeps the
            backward all-gathers on the node); W means True, 1 means False. None (FSDP2's
            default): True, except for the root, which always keeps its parameters for backward.
        mp_policy: ``param_dtype`` for forward/backward, ``reduce_dtype`` for the reduce-scatter.
        offload_policy: None, ``flashfsdp.OffloadPolicy()`` or
            ``torch.distributed.fsdp.OffloadPolicy()`` (no offloading); ``CPUOffloadPolicy`` (either
            package's) is not supported yet.
        ignored_params: parameters left as they are (not sharded, gradients not reduced).
        communicator: "auto" (NCCL through CuPy for CUDA modules, the process group otherwise),
            "nccl", "process_group", or a ``Communicator`` instance (with ``mesh``, its world size
            and rank must be those of the mesh's group).

    Returns:
        ``module``, whose class now also derives from :class:`FSDPModule`.

    Raises:
        ValueError: ``module`` already fully_shard'ed; parameters on several devices; a parameter
            already owned by another unit or shared with one; a mesh that is not 1-D or does not
            match the module's device; a ``Communicator`` whose world size or rank differs from
            the mesh's group; an unknown communicator; a ``reshard_after_forward`` int that does
            not divide W.
        TypeError: ``module`` is not one ``nn.Module`` (e.g. a list); a non-floating parameter; a
            bad ``mp_policy``, ``offload_policy`` or ``reshard_after_forward``.
        RuntimeError: W > 1 requested (``WORLD_SIZE`` set) but torch.distributed not initialised.
        NotImplementedError: a ``CPUOffloadPolicy``.
    """
    if isinstance(module, (list, tuple)):
        raise TypeError(
            f"fully_shard: module must be one nn.Module, got a {type(module).__name__} of "
            f"{len(module)}; pass one module; call fully_shard on each (one unit per call)"
        )
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard: module must be an nn.Module, got {type(module).__name__}")
    if hasattr(module, "_flashfsdp_state"):
        raise ValueError(f"fully_shard: {type(module).__name__} is already fully_shard'ed; call fully_shard once per module")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy must be a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    _check_offload_policy(offload_policy)
    if communicator not in _COMMUNICATOR_KINDS and not isinstance(communicator, Communicator):
        raise ValueError(f"fully_shard: communicator must be one of {_COMMUNICATOR_KINDS} or a Communicator, got {communicator!r}")
    ignored = {id(p) for p in (ignored_params or ())}
    params, fqns, registrations, nested = _collect_params(module, ignored)
    device = _unit_device(module, params, mesh)
    comm = _make_communicator(mesh, communicator, device)
    post_forward_size = _post_forward_size(reshard_after_forward, comm.world_size)
    post_forward_comm = None
    if post_forward_size is not None:
        post_forward_comm = _post_forward_communicator(comm, post_forward_size, communicator, device)
    # Named by class here; the root renames every unit by its qualified name at lazy init.
    unit = ShardedUnit(
        type(module).__name__, params, fqns, comm, device,
        param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype, post_forward_comm=post_forward_comm,
    )
    cls = module.__class__
    module.__class__ = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {})
    # FSDP2's int: W behaves like True and 1 like False (keep the parameters for backward). None
    # (FSDP2's default) is True: the root keeps its parameters anyway (see FSDPState._lazy_init).
    if reshard_after_forward is None or isinstance(reshard_after_forward, bool):
        reshard = reshard_after_forward is not False
    else:
        reshard = reshard_after_forward != 1
    state = FSDPState(module, unit, registrations, mp_policy, reshard, class_name=cls.__name__)
    module.__dict__["_flashfsdp_state"] = state
    # state_dict() yields each unit parameter as a ShardedPiece that torch.distributed.checkpoint
    # saves and reshards; load_state_dict() writes into the sharded pieces (see state_dict.py).
    install_state_dict_hooks(module, state)
    # Optimizers over the pieces get their state-dict hooks at their first step (optim_state_dict.py).
    register_optimizer_step_hook()
    # Names are relative to the module of each fully_shard call: the nested units' names (their
    # own subtrees included) now get the prefix of the child module that holds them.
    for prefix, child in nested:
        for sub in child.modules():
            sub_state = sub.__dict__.get("_flashfsdp_state")
            if sub_state is not None:
                for group in sub_state.unit.groups:
                    group.prefix_fqns(f"{prefix}.")
    return module


def _check_offload_policy(offload_policy) -> None:
    """Accept no offloading (None, or either package's ``OffloadPolicy()`` base).

    Raises:
        NotImplementedError: a ``CPUOffloadPolicy`` (flashfsdp's or torch's).
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
        return
    if isinstance(offload_policy, tuple(cpu)):
        raise NotImplementedError(
            f"fully_shard: {type(offload_policy).__name__} (CPU offload) is not supported yet; pass "
            f"offload_policy=None to keep parameters and gradients on the module's device"
        )
    raise TypeError(
        f"fully_shard: offload_policy must be None or OffloadPolicy() (flashfsdp's or "
        f"torch.distributed.fsdp's), got {offload_policy!r}"
    )


def _post_forward_size(value, world_size: int) -> int | None:
    """FSDP2's ``reshard_after_forward: bool | int | None``: the size k of the group the unit is
    resharded to after forward when 1 < k < W (ZeRO++ hpZ), else None (True, False, None, W or 1).

    Raises:
        ValueError: an int that is < 1, > W or does not divide W.
        TypeError: neither a bool, an int nor None.
    """
    if value is None or isinstance(value, bool):
        return None
    if not isinstance(value, int):
        raise TypeError(f"fully_shard: reshard_after_forward must be a bool, an int or None, got {type(value).__name__}")
    if value < 1 or value > world_size or world_size % value:
        raise ValueError(
            f"fully_shard: reshard_after_forward={value} must be a group size that divides the world size "
            f"{world_size} (1 < size < {world_size} reshards to groups of consecutive ranks); or pass True/False"
        )
    return value if 1 < value < world_size else None


def _post_forward_communicator(comm: Communicator, k: int, kind, device: torch.device) -> Communicator:
    """The communicator over this rank's group of k consecutive ranks of ``comm``'s group."""
    group = getattr(comm, "group", None)
    if group is None:
        raise ValueError("fully_shard: reshard_after_forward=<int> needs a torch.distributed process group")
    key = ("post_forward", id(group), k, str(device))
    cached = _communicator_cache.get(key)
    if cached is not None and cached.parent is group:
        return cached
    ranks = dist.get_process_group_ranks(group)
    mine = None
    for start in range(0, len(ranks), k):  # every rank creates every subgroup, in the same order
        sub = dist.new_group(ranks[start : start + k])
        if dist.get_rank() in ranks[start : start + k]:
            mine = sub
    cached = _make_communicator(None, kind, device, group=mine)
    cached.parent = group
    _communicator_cache[key] = cached
    return cached


def _collect_params(module: nn.Module, ignored: set[int]):
    """The unit's parameters (deduplicated), their names relative to ``module``, every registration
    of each, and the nested fully_shard'ed children as ``(prefix, child module)``."""
    nested = []
    index: dict[int, int] = {}
    params, fqns, registrations = [], [], []
    stack = [("", module)]
    while stack:
        prefix, mod = stack.pop()
        for name, param in mod._parameters.items():
            if param is None or id(param) in ignored:
                continue
            fqn = f"{prefix}{name}"
            if hasattr(param, "_flashfsdp_fqn"):
                raise ValueError(
                    f"fully_shard: parameter '{fqn}' of {type(module).__name__} already belongs to the unit of "
                    f"an earlier fully_shard call (unit '{param._flashfsdp_unit.name}', where it is "
                    f"'{param._flashfsdp_fqn}'); call fully_shard bottom-up: inner modules first, then their parents"
                )
            if not param.is_floating_point():
                raise TypeError(
                    f"fully_shard: parameter '{fqn}' has dtype {param.dtype}; only floating-point parameters "
                    f"are sharded: pass it in ignored_params or register it as a buffer"
                )
            if id(param) in index:
                registrations[index[id(param)]].append((mod, name))
                continue
            index[id(param)] = len(params)
            params.append(param)
            fqns.append(fqn)
            registrations.append([(mod, name)])
        for name, child in reversed(list(mod._modules.items())):
            if child is None:
                continue
            if hasattr(child, "_flashfsdp_state"):
                nested.append((f"{prefix}{name}", child))
                continue
            stack.append((f"{prefix}{name}.", child))
    for child_name, child in nested:
        for i, p in enumerate(params):
            if id(p) in child._flashfsdp_state.unit.original_param_ids:
                raise ValueError(
                    f"fully_shard: parameter '{fqns[i]}' is shared with the unit at '{child_name}' (e.g. tied "
                    f"embeddings); shared parameters must live in one unit: do not fully_shard "
                    f"'{child_name}' on its own, let a module that contains every user of the parameter own it"
                )
    return params, fqns, registrations, nested


def _unit_device(module: nn.Module, params: list[nn.Parameter], mesh) -> torch.device:
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(
            f"fully_shard: {type(module).__name__} has parameters on several devices "
            f"({sorted(map(str, devices))}); move the module to one device first (module.to(device))"
        )
    if devices:
        device = devices.pop()
    elif mesh is not None:
        device = torch.device(mesh.device_type)
    else:
        device = torch.device("cpu")
    if device.type == "meta":
        raise ValueError(f"fully_shard: {type(module).__name__} has parameters on the meta device; materialise them first")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _mesh_group(mesh, device: torch.device):
    """The process group of a 1-D ``DeviceMesh`` of ``device``'s type.

    Raises:
        TypeError: ``mesh`` is not a DeviceMesh.
        ValueError: a mesh that is not 1-D, or of another device type than the parameters.
    """
    from torch.distributed.device_mesh import DeviceMesh  # noqa: PLC0415

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard: mesh must be a torch.distributed DeviceMesh or None, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(
            f"fully_shard: mesh must be a 1-D DeviceMesh, got {mesh.ndim} "
            f"dimensions; pass a 1-D mesh (2-D HSDP meshes are not supported yet)"
        )
    if mesh.device_type != device.type:
        raise ValueError(
            f"fully_shard: mesh is of device type '{mesh.device_type}' but the module's parameters are on "
            f"{device}; build the mesh with init_device_mesh('{device.type}', ...) or move the module"
        )
    return mesh.get_group()


def _check_communicator_matches(comm: Communicator, group) -> None:
    """Raise ValueError unless ``comm`` has the world size and rank of the mesh's ``group``."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if comm.world_size != world or comm.rank != rank:
        raise ValueError(
            f"fully_shard: communicator {type(comm).__name__} has world size {comm.world_size} and rank "
            f"{comm.rank}, but the mesh's group has world size {world} and this process is its rank {rank}; "
            f"pass a communicator over the mesh's group, or communicator='auto' to build one"
        )


def _make_communicator(mesh, communicator, device: torch.device, group=None) -> Communicator:
    """The communicator of a unit: ``communicator`` itself if it is a Communicator (checked against
    ``mesh``), else one built over ``group`` / the mesh's group / the default group (one per
    group, kind and device, shared by every unit), or a LocalCommunicator for W = 1 without a
    process group.

    Raises:
        see :func:`_mesh_group` and :func:`_check_communicator_matches`; RuntimeError when
        ``WORLD_SIZE`` > 1 but torch.distributed is not initialised.
    """
    if group is None:
        if mesh is not None:
            group = _mesh_group(mesh, device)
            if isinstance(communicator, Communicator):
                _check_communicator_matches(communicator, group)
                return communicator
        elif isinstance(communicator, Communicator):
            return communicator
        elif dist.is_available() and dist.is_initialized():
            group = dist.group.WORLD
        else:
            world = int(os.environ.get("WORLD_SIZE", "1") or 1)
            if world > 1:
                raise RuntimeError(
                    f"fully_shard: WORLD_SIZE={world} but torch.distributed is not initialised; call "
                    f"torch.distributed.init_process_group() before fully_shard (W = 1 needs no process group)"
                )
            return LocalCommunicator()
    kind = communicator
    if isinstance(kind, Communicator):  # a subgroup of a given communicator's group (hpZ)
        kind = "nccl" if device.type == "cuda" else "process_group"
    if kind == "auto":
        kind = "nccl" if device.type == "cuda" else "process_group"
    # One communicator per (group, kind, device), shared by every unit: an NCCL communicator is
    # expensive to create, and clip_grad_norm_ then all-reduces once per group, not once per unit.
    key = (id(group), kind, str(device))
    cached = _communicator_cache.get(key)
    if cached is None or cached.group is not group:
        if kind == "nccl":
            from flashfsdp.runtime.nccl import NcclCommunicator  # noqa: PLC0415

            cached = NcclCommunicator(group, device)
        else:
            from flashfsdp.runtime.process_group import ProcessGroupCommunicator  # noqa: PLC0415

            cached = ProcessGroupCommunicator(group)
        _communicator_cache[key] = cached
    return cached
