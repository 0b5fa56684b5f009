"""Which communicator a unit gets: one per (process group, kind, device), shared by every unit.

An NCCL communicator is expensive to create (a rendezvous, GPU buffers), and ``clip_grad_norm_``
all-reduces once per communicator rather than once per unit, so units over the same group share
one. The cache is process-wide and checked against the group object itself (a destroyed and
re-created default group gets new communicators).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .communicator import Communicator, LocalCommunicator

KINDS = ("auto", "nccl", "process_group")
_cache: dict[tuple, Communicator] = {}


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


def post_forward_communicator(comm: Communicator, k: int, kind: str | Communicator,
                              device: torch.device) -> Communicator:
    """The communicator over this rank's group of k consecutive ranks of ``comm``'s group (hpZ).

    Every rank creates every subgroup, in the same order (``dist.new_group`` is collective).

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
    ranks = dist.get_process_group_ranks(group)
    mine = None
    for start in range(0, len(ranks), k):
        sub = dist.new_group(ranks[start : start + k])
        if dist.get_rank() in ranks[start : start + k]:
            mine = sub
    cached = communicator_for(mine, kind, device)
    cached.parent = group
    _cache[key] = cached
    return cached


def separate_communicator(comm: Communicator, device: torch.device) -> Communicator:
    """A communicator of the same kind over a new process group with the ranks of ``comm``'s
    group (FSDP2's ``set_separate_reduce_scatter_group``): collectives on it do not queue behind
    those on ``comm``. Collective: every rank of the group must call it, in the same order.

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
    sub = dist.new_group(dist.get_process_group_ranks(group))
    kind = "nccl" if type(comm).__name__ == "NcclCommunicator" else "process_group"
    cached = communicator_for(sub, kind, device)
    cached.parent = group
    _cache[key] = cached
    return cached
