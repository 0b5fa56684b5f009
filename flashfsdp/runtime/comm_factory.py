"""Which communicator a unit gets: one per (process group, kind, device), shared by every unit.

An NCCL communicator is expensive to create (a rendezvous, GPU buffers), and ``clip_grad_norm_``
all-reduces once per communicator rather than once per unit, so units over the same group share
one. The first communicator of a group also creates the group's control group (``control.py``). The cache is process-wide and checked against the group object itself (a destroyed and
re-created default group gets new communicators).

[Note: sibling groups]
``dist.new_group`` is collective over the default group: every rank must create every group, in
the same order, even those it is not a member of. A unit's group may be one of several disjoint
groups of a mesh (the shard groups of an HSDP mesh, one per replica), whose ranks each know only
their own. :func:`register_siblings` records, for a group, the ranks of all its siblings (the
mesh's rows), so that the subgroups derived from it (``reshard_after_forward=<int>``, a separate
reduce-scatter group) are created for every sibling on every rank, in one order.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from . import control, flight_dump
from .communicator import Communicator, LocalCommunicator

KINDS = ("auto", "nccl", "process_group")
_cache: dict[tuple, Communicator] = {}
_siblings: dict[int, tuple[object, list[list[int]]]] = {}  # id(group) -> (group, every sibling's ranks)


def resolve_kind(kind: str | Communicator, device: torch.device) -> str:
    """"nccl" or "process_group" for a kind name (or for a given Communicator's subgroups)."""
    if isinstance(kind, Communicator) or kind == "auto":
        return "nccl" if device.type == "cuda" else "process_group"
    return kind


def default_group():
    """The default process group, or None for a single process without torch.distributed.

    Raises:
        RuntimeError: ``WORLD_SIZE`` > 1 but torch.distributed is not initialised.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if world > 1:
        raise RuntimeError(
            f"fully_shard: WORLD_SIZE={world} but torch.distributed is not initialised; call "
            f"torch.distributed.init_process_group() before fully_shard (W = 1 needs no process group)"
        )
    return None


def communicator_for(group, kind: str | Communicator, device: torch.device) -> Communicator:
    """The shared communicator of ``kind`` over ``group`` on ``device`` (LocalCommunicator for no group).

    Args:
        group: a torch.distributed process group, or None (a single rank; a group of one rank gets
            the LocalCommunicator too: no collective runs).
        kind: "auto" (NCCL through CuPy on CUDA, the process group otherwise), "nccl",
            "process_group", or a Communicator (whose kind is taken from ``device``).
        device: the device of the unit's tensors.
    """
    if group is None or dist.get_world_size(group) == 1:
        return LocalCommunicator()  # a group of one rank has nothing to communicate (as FSDP2)
    # The group's control group, now that every rank of the group builds its units in one order
    # (see flashfsdp.runtime.control); and the flight recorder's signal dumps, when asked for.
    control.control_group(group)
    flight_dump.arm_from_environment()
    kind = resolve_kind(kind, device)
    key = (id(group), kind, str(device))
    cached = _cache.get(key)
    if cached is None or cached.group is not group:
        if kind == "nccl":
            from .nccl import NcclCommunicator  # noqa: PLC0415

            cached = NcclCommunicator(group, device)
        else:
            from .process_group import ProcessGroupCommunicator  # noqa: PLC0415

            cached = ProcessGroupCommunicator(group)
        _cache[key] = cached
    return cached


def forget_communicators(group=None) -> int:
    """Drop the cached communicators over ``group`` (None or the default group: every one) and
    the subgroup communicators derived from it; returns how many. Call it on every rank before
    ``destroy_process_group`` of a job that creates groups again (a test running several jobs in
    one process): the cache would otherwise keep the destroyed groups, their sockets and threads
    alive while the new ones connect. Units built before keep their own communicators."""
    everything = group is None or (dist.is_initialized() and group is dist.group.WORLD)
    doomed = [key for key, comm in _cache.items()
              if everything or getattr(comm, "group", None) is group or getattr(comm, "parent", None) is group]
    for key in doomed:
        del _cache[key]
    return len(doomed)


def communicator_in_use(group, device: torch.device) -> Communicator:
    """The communicator the units over ``group`` on ``device`` use (the first created, whatever its
    kind), else the "auto" one: a collective outside the units (``all_gather_with_grad``) then
    shares their NCCL communicator, and NCCL orders it with their prefetches. Two communicators
    with collectives in flight at once can deadlock (NCCL's documentation: "Using multiple NCCL
    communicators concurrently")."""
    if group is None or dist.get_world_size(group) == 1:
        return LocalCommunicator()
    for key, comm in _cache.items():  # the units' keys: (id(group), kind, device)
        if key[0] == id(group) and key[2] == str(device) and getattr(comm, "group", None) is group:
            return comm
    return communicator_for(group, "auto", device)


def register_siblings(group, ranks: list[list[int]]) -> None:
    """Record that ``group`` is one of the disjoint groups whose (global) ranks are ``ranks``, one
    list per group, the same on every rank (see [Note: sibling groups]).

    Raises:
        ValueError: ``group``'s own ranks are not among ``ranks``.
    """
    if group is None:
        return
    own = dist.get_process_group_ranks(group)
    if own not in ranks:
        raise ValueError(f"register_siblings: the group's ranks {own} are not among the sibling groups {ranks}")
    _siblings[id(group)] = (group, [list(r) for r in ranks])


def sibling_ranks(group) -> list[list[int]]:
    """The ranks of every sibling of ``group`` (its own among them): the registered ones, else
    ``group``'s alone (a group spanning the default group, or a 1-D mesh)."""
    entry = _siblings.get(id(group))
    if entry is not None and entry[0] is group:
        return entry[1]
    return [dist.get_process_group_ranks(group)]


def _new_groups_for(group, split) -> object:
    """Create, on every rank and in one order, the groups ``split(ranks)`` of every sibling of
    ``group`` (see [Note: sibling groups]); returns the one this rank belongs to (None if none)."""
    me, mine = dist.get_rank(), None
    for ranks in sibling_ranks(group):
        for sub_ranks in split(ranks):
            sub = dist.new_group(sub_ranks)
            if me in sub_ranks:
                mine = sub
    return mine


def post_forward_communicator(comm: Communicator, k: int, kind: str | Communicator,
                              device: torch.device) -> Communicator:
    """The communicator over this rank's group of k consecutive ranks of ``comm``'s group (hpZ).

    Every rank creates every subgroup of every sibling group, in the same order (``dist.new_group``
    is collective; see [Note: sibling groups]).

    Raises:
        ValueError: ``comm`` has no torch.distributed process group.
    """
    group = getattr(comm, "group", None)
    if group is None:
        raise ValueError("fully_shard: reshard_after_forward=<int> needs a torch.distributed process group")
    key = ("post_forward", id(group), k, str(device))
    cached = _cache.get(key)
    if cached is not None and cached.parent is group:
        return cached
    mine = _new_groups_for(group, lambda ranks: [ranks[start : start + k] for start in range(0, len(ranks), k)])
    cached = communicator_for(mine, kind, device)
    cached.parent = group
    _cache[key] = cached
    return cached


def separate_communicator(comm: Communicator, device: torch.device) -> Communicator:
    """A communicator of the same kind over a new process group with the ranks of ``comm``'s
    group (FSDP2's ``set_separate_reduce_scatter_group``): collectives on it do not queue behind
    those on ``comm``. Collective: every rank of the group and of its siblings (see [Note: sibling
    groups]) must call it, in the same order.

    Raises:
        ValueError: ``comm`` has no torch.distributed process group.
    """
    group = getattr(comm, "group", None)
    if group is None:
        if comm.world_size == 1:
            return comm
        raise ValueError("set_separate_reduce_scatter_group needs a communicator over a torch.distributed group")
    key = ("separate", id(group), type(comm).__name__, str(device))
    cached = _cache.get(key)
    if cached is not None and cached.parent is group:
        return cached
    sub = _new_groups_for(group, lambda ranks: [ranks])
    kind = "nccl" if type(comm).__name__ == "NcclCommunicator" else "process_group"
    cached = communicator_for(sub, kind, device)
    cached.parent = group
    _cache[key] = cached
    return cached


def node_communicators(comm: Communicator, local_size: int, kind: str | Communicator,
                       device: torch.device) -> tuple[Communicator, Communicator]:
    """``(intra, inter)``: the communicators over this rank's "node" and across the nodes, the
    ranks of ``comm``'s group taken as N = W / ``local_size`` nodes of ``local_size`` consecutive
    ranks (node m: ranks m·L .. m·L + L - 1, as the hpZ groups of :func:`post_forward_communicator`,
    which builds ``intra``); ``inter`` holds the ranks of the same local rank l of every node
    (l, L + l, 2L + l, ...). ZeRO++ qgZ's hierarchical all-to-all runs over them
    (``quantized_reduce.py``). A group of one rank gets the LocalCommunicator. Every rank creates
    every subgroup of every sibling group in one order (see [Note: sibling groups]).

    Raises:
        ValueError: ``local_size`` does not divide W, or ``comm`` has no torch.distributed group
            while W > 1.
    """
    world = comm.world_size
    if local_size < 1 or world % local_size:
        raise ValueError(f"node_communicators: local_size={local_size} must divide the world size {world}")
    if world == 1:
        return comm, comm
    intra = comm if local_size == world else post_forward_communicator(comm, local_size, kind, device)
    if local_size == 1:
        return intra, comm
    group = getattr(comm, "group", None)
    if group is None:
        raise ValueError("node_communicators: the nodes' groups need a torch.distributed process group")
    key = ("inter_node", id(group), local_size, str(device))
    cached = _cache.get(key)
    if cached is None or cached.parent is not group:
        mine = _new_groups_for(group, lambda ranks: [ranks[l::local_size] for l in range(local_size)])
        cached = communicator_for(mine, kind, device)
        cached.parent = group
        _cache[key] = cached
    return intra, cached
