"""Agreement across ranks: an error on one rank raised on every rank, rank 0's value on all.

Used by the state-dict, checkpoint and gradient-clipping functions where one rank alone can fail
(file checks, input only rank 0 sees, an allocation on the rank that keeps the result), so that no
rank waits forever in a later collective: check first, agree, then act; a failure while acting is
held until the ranks agree again, and each rank still issues every collective it owes meanwhile.

:func:`all_gather_values`, :func:`broadcast_value` and :func:`broadcast_state` move Python values
between ranks over a process group without pickle (``all_gather_object`` and
``broadcast_object_list`` unpickle what other processes sent, which can run code): as control
messages (JSON), or as ``torch.save`` bytes read with ``weights_only=True``.

Every agreement runs on a control group (``control.py``): a gloo group of its own over the
ranks of the default group (:func:`agree`, :func:`agree_and_gather`, :func:`agree_on_list`,
:func:`agree_from_rank0`) or of a unit's communicator (:func:`agree_in_group`,
:func:`raise_group_errors`), never on the group the units' all-gathers use. Each message names
its operation: the innermost ``flight.operation`` block (``checkpoint.save``), else the function
that called the helper; ranks in different operations all raise ``control.ControlMismatch``
naming them. Without a process group (W = 1) nothing is communicated.
"""

from __future__ import annotations

import builtins
import sys
from typing import Any

import torch
import torch.distributed as dist

from . import control, flight
from .communicator import Communicator
from .process_group import all_gather_single


def global_rank() -> int:
    """This process's rank in the default group (0 when torch.distributed is not initialised)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def global_world_size() -> int:
    """The default group's size (1 when torch.distributed is not initialised)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def error_payload(exc: BaseException | None) -> tuple[str, str] | None:
    """(class name, message) of an exception, or None, to send to the other ranks."""
    return None if exc is None else (type(exc).__name__, str(exc))


def raise_agreed(payloads: list[tuple[str, str] | None], cause: BaseException | None = None) -> None:
    """Raise the first error of any rank, on every rank (of the same class if a builtin one).

    ``cause``: this rank's own exception, if it had one, chained as the ``__cause__`` (its
    traceback stays visible on the rank where it happened).
    """
    for rank, payload in enumerate(payloads):
        if payload is not None:
            kind, message = payload
            cls = getattr(builtins, kind, None)
            if not (isinstance(cls, type) and issubclass(cls, Exception)):
                cls = RuntimeError
            suffix = "" if len(payloads) == 1 else f" (rank {rank})"
            raise cls(message + suffix) from cause


def raise_own(exc: BaseException | None) -> None:
    """Raise ``exc`` itself if there is one: where no other rank has to learn of it (W = 1, or
    every rank already knows it failed the same way)."""
    if exc is not None:
        raise exc


_HELPERS = (__name__, "flashfsdp.bindings.structure")


def operation_name() -> str:
    """The operation a control message belongs to: the innermost ``flight.operation`` block, else
    the first caller outside the agreement helpers and the same-model check
    (``bindings.state_dict.full.get_full_state_dict``)."""
    named = flight.current_operation()
    if named is not None:
        return named
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") in _HELPERS:
        frame = frame.f_back
    if frame is None:
        return "an agreement"
    module = str(frame.f_globals.get("__name__", "?")).removeprefix("flashfsdp.")
    return f"{module}.{frame.f_code.co_qualname}"


def agree(exc: BaseException | None) -> None:
    """Collective: every rank passes its error or None; if any rank failed, every rank raises.

    Keeps the ranks together where one rank alone could fail (file checks, input only rank 0 sees),
    so that no rank waits forever in a later collective. No communication without a process group.
    """
    agree_and_gather(exc, None)


def agree_and_gather(exc: BaseException | None, value: Any) -> list:
    """Collective over the default group's control group: :func:`agree` on ``exc``, and every rank's
    ``value`` (what a control message holds: ``control.encode``), by rank, in the same exchange.

    Raises:
        The first error of any rank, on every rank (this rank's own ``exc`` chained as the cause).
        control.ControlMismatch: the ranks are in different operations (see the module docstring).
    """
    if global_world_size() == 1:
        raise_own(exc)
        return [value]
    gathered = control.exchange(control.control_group(), operation_name(), (error_payload(exc), value))
    raise_agreed([payload for payload, _ in gathered], exc)
    return [v for _, v in gathered]


def agree_on_list(exc: BaseException | None, items: list, what: str) -> None:
    """Collective over the default group: :func:`agree` on ``exc``, and on ``items`` being equal on
    every rank (``what`` names them in the error), in one exchange.

    Raises:
        The first error of any rank, on every rank (as :func:`agree`).
        ValueError: ``items`` differ; names the first differing item and the ranks.
    """
    everyone = agree_and_gather(exc, items)
    reference = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        if theirs != reference:
            i = next((i for i, (a, b) in enumerate(zip(reference, theirs)) if a != b), min(len(reference), len(theirs)))
            ours_i = reference[i] if i < len(reference) else "nothing"
            theirs_i = theirs[i] if i < len(theirs) else "nothing"
            raise ValueError(f"{what} differ across ranks: item {i} is {ours_i} on rank 0 but {theirs_i} on rank {rank}")


def agree_from_rank0(exc: BaseException | None, obj: Any) -> Any:
    """Collective: :func:`agree` on ``exc`` and hand rank 0's ``obj`` to every rank, in one exchange.

    Returns:
        rank 0's ``obj`` (``obj`` itself without a process group).

    Raises:
        The first error of any rank, on every rank (as :func:`agree`).
    """
    return agree_and_gather(exc, obj if global_rank() == 0 else None)[0]


def agree_in_group(comm: Communicator, exc: BaseException | None, device: torch.device | None = None) -> None:
    """Collective over the control group of ``comm``'s ranks: if any of them failed, every one
    raises the first (lowest rank's) error, naming that rank (its rank in ``comm``'s group), as
    :func:`raise_agreed`. Nothing is communicated at W = 1. ``device`` is not used (the control
    group is on the host); kept for the callers that pass the unit's device."""
    if comm.world_size == 1:
        raise_own(exc)
        return
    payloads = control.exchange(control.for_comm(comm), operation_name(), error_payload(exc))
    raise_agreed(payloads, exc)


def raise_group_errors(comm: Communicator, exc: BaseException | None, device: torch.device | None = None) -> None:
    """Collective over ``comm``'s control group, once every rank knows that some rank failed:
    exchange the errors and raise the first on every rank (see :func:`agree_in_group`)."""
    agree_in_group(comm, exc, device)
    raise RuntimeError(f"a rank of the group of rank {comm.rank} failed, but sent no error")


def all_gather_bytes(comm: Communicator, data: bytes, device: torch.device) -> list[bytes]:
    """Collective over ``comm``: every rank's ``data`` (any length), by rank.

    Two all-gathers of uint8 tensors on ``device`` (the communicator's): the lengths (8 bytes per
    rank), then the data padded to the longest. One all-gather when every rank's ``data`` has the
    same, known length: see :func:`all_gather_fixed`.
    """
    lengths = all_gather_fixed(comm, len(data).to_bytes(8, "little"), device)
    longest = max(int.from_bytes(n, "little") for n in lengths)
    padded = all_gather_fixed(comm, data.ljust(longest, b"\0"), device)
    return [p[: int.from_bytes(n, "little")] for p, n in zip(padded, lengths)]


def all_gather_fixed(comm: Communicator, data: bytes, device: torch.device, over_group: bool = False) -> list[bytes]:
    """Collective over ``comm``: every rank's ``data``, by rank; every rank passes the same length.
    One all-gather of a uint8 tensor on ``device``; with ``over_group``, issued on the
    communicator's torch process group where it has one (not through the communicator)."""
    if comm.world_size == 1:
        return [data]
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if data else torch.empty(0, dtype=torch.uint8, device=device)
    out = torch.empty(len(data) * comm.world_size, dtype=torch.uint8, device=device)
    group = getattr(comm, "group", None) if over_group and dist.is_initialized() else None
    if group is not None:
        all_gather_single(out, mine, group=group)
    else:
        comm.all_gather_into_tensor(out, mine).wait()
    flat = out.cpu().numpy().tobytes()
    return [flat[r * len(data) : (r + 1) * len(data)] for r in range(comm.world_size)]


# ------------------------------------------------------------- objects between ranks, without pickle
def _object_device(group) -> torch.device:
    """Where a group's collectives take their tensors: the current GPU for NCCL, else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if "nccl" in str(dist.get_backend(group)) \
        else torch.device("cpu")


def _all_gather_data(data: bytes, group) -> list[bytes]:
    """Every rank's ``data`` (any lengths), by rank in ``group``: the lengths, then the padded bytes."""
    device, world = _object_device(group), dist.get_world_size(group)
    lengths = torch.empty(world, dtype=torch.int64, device=device)
    all_gather_single(lengths, torch.tensor([len(data)], dtype=torch.int64, device=device), group=group)
    sizes = lengths.tolist()
    longest = max(sizes)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if data:
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    out = torch.empty(longest * world, dtype=torch.uint8, device=device)
    all_gather_single(out, mine.to(device), group=group)
    flat = out.cpu().numpy().tobytes()
    return [flat[r * longest : r * longest + n] for r, n in enumerate(sizes)]


def _broadcast_data(data: bytes | None, src: int, group) -> bytes:
    """Rank ``src``'s (global rank) ``data`` on every rank of ``group``."""
    device = _object_device(group)
    length = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=device)
    dist.broadcast(length, src=src, group=group)
    buffer = torch.zeros(int(length.item()), dtype=torch.uint8)
    if data:
        buffer[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    buffer = buffer.to(device)
    dist.broadcast(buffer, src=src, group=group)
    return buffer.cpu().numpy().tobytes()


def all_gather_values(value: Any, group=None) -> list:
    """Collective over ``group`` (None: the default group): every rank's ``value``, by rank in the
    group. ``torch.distributed.all_gather_object`` without pickle: the values travel as control
    messages (``control.encode``: None, bool, int, float, str, bytes, tuples, lists, dicts).

    Raises:
        TypeError: ``value`` holds anything else (on this rank, before any collective).
        ValueError: a rank's bytes do not decode (not one of this library's messages).
    """
    data = control.encode(value)
    return [control.decode(d) for d in _all_gather_data(data, group)]


def broadcast_value(value: Any, src: int = 0, group=None) -> Any:
    """Collective over ``group``: rank ``src``'s (global rank) ``value`` on every rank (what the
    other ranks pass is ignored). ``broadcast_object_list`` of one value, without pickle (see
    :func:`all_gather_values`).

    Raises:
        TypeError / ValueError: as :func:`all_gather_values` (TypeError on ``src``).
    """
    mine = dist.get_rank() == src
    data = _broadcast_data(control.encode(value) if mine else None, src, group)
    return value if mine else control.decode(data)


def broadcast_state(obj: Any, src: int = 0, group=None) -> Any:
    """Collective over ``group``: rank ``src``'s ``obj`` — tensors, containers, numbers and strings,
    as an optimizer's state dict holds — on every rank: ``torch.save`` bytes read back with
    ``torch.load(weights_only=True)``, whose unpickler builds tensors and plain containers only
    (never a pickled object's code).

    Raises:
        pickle.UnpicklingError: the bytes hold anything else (raised on the receiving ranks).
    """
    import io  # noqa: PLC0415

    mine = dist.get_rank() == src
    data = None
    if mine:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        data = buffer.getvalue()
    data = _broadcast_data(data, src, group)
    return obj if mine else torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
