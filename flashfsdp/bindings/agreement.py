"""Agreement across ranks: an error on one rank raised on every rank, rank 0's value on all.

Used by the state-dict and checkpoint functions where one rank alone can fail (file checks, input
only rank 0 sees), so that no rank waits forever in a later collective. Without a process group
(W = 1) nothing is communicated.
"""

from __future__ import annotations

import builtins
from typing import Any

import torch.distributed as dist


def global_rank() -> int:
    """This process's rank in the default group (0 when torch.distributed is not initialised)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def global_world_size() -> int:
    """The default group's size (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def error_payload(exc: BaseException | None) -> tuple[str, str] | None:
    """(class name, message) of an exception, or None, to send to the other ranks."""
    return None if exc is None else (type(exc).__name__, str(exc))


def raise_agreed(payloads: list[tuple[str, str] | None]) -> None:
    """Raise the first error of any rank, on every rank (of the same class if a builtin one)."""
    for rank, payload in enumerate(payloads):
        if payload is not None:
            kind, message = payload
            cls = getattr(builtins, kind, None)
            if not (isinstance(cls, type) and issubclass(cls, Exception)):
                cls = RuntimeError
            suffix = "" if len(payloads) == 1 else f" (rank {rank})"
            raise cls(message + suffix)


def agree(exc: BaseException | None) -> None:
    """Collective: every rank passes its error or None; if any rank failed, every rank raises.

    Keeps the ranks together where one rank alone could fail (file checks, input only rank 0 sees),
    so that no rank waits forever in a later collective. No communication without a process group.
    """
    payload = error_payload(exc)
    if global_world_size() == 1:
        raise_agreed([payload])
        return
    payloads: list = [None] * global_world_size()
    dist.all_gather_object(payloads, payload)
    raise_agreed(payloads)


def from_rank0(obj: Any) -> Any:
    """Collective: rank 0's ``obj`` on every rank (``obj`` itself without a process group)."""
    if global_world_size() == 1:
        return obj
    box = [obj if global_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
