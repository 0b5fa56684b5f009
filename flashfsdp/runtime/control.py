"""Control messages on their own gloo group: check-agree-act exchanges that never meet a data collective.

The agreement helpers (``agreement.py``), the same-model check (``bindings/structure.py``) and
the backward check exchange small Python values between ranks. Sent over the group the units'
all-gathers use, a rank that agrees (``checkpoint.save``) while another all-gathers (a forward)
pairs two different collectives: gloo aborts the process ("collective mismatch"), NCCL hangs. So,
as DCP does for its planning, each process group gets one dedicated gloo group over the same ranks
(:func:`control_group`), created once (``use_local_synchronization``: only its ranks take part,
so disjoint groups need not be created everywhere in one order), with the group's timeout. Only
:func:`exchange` speaks on it, always as the same two all-gathers (the lengths, then the padded
messages), so its ranks always issue matching collectives, whatever each of them is doing.

Each message carries this group's sequence number and the operation's name; when they differ
across ranks every rank raises :class:`ControlMismatch` naming what each rank was doing ("rank 0
is in checkpoint.save (control message 3) but rank 1 is in the same-model check (control message
3)"). Messages are JSON (:func:`encode` / :func:`decode`: None, bool, int, float, str, bytes,
tuples, lists and dicts of these, each container tagged so that it decodes to its own type): bytes
from another process are never unpickled, so a message can carry data, never code.

A rank waiting for the others polls: when another rank reports a failed collective through the
store (``divergence.py``), it stops waiting and raises the joint diagnosis instead of waiting out
the timeout; one whose wait outlasts the desync window (``flight_desync.py``) compares its
position with the other ranks' through the store, and raises when they wait on different
collectives. After a failure the control group is unusable, and says so.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import time
import weakref
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flashfsdp._torch_private import group_timeout

from . import divergence, flight, flight_desync
from .process_group import all_gather_single

TIMEOUT_ENV = "FLASHFSDP_CONTROL_TIMEOUT"
NOTICE_POLL_S = 0.05  # seconds between two looks at the store while waiting
MAX_MESSAGE_BYTES = 64 << 20  # a longer control message is refused (on every rank: all see the lengths)
_groups: dict[tuple, "ControlGroup"] = {}


class ControlMismatch(RuntimeError):
    """The ranks of a control group exchanged messages of different operations (raised on every one)."""


@dataclass
class ControlGroup:
    """One control group: its global ``ranks``, the gloo group and the default group it was made
    under (both weakly: torch's ``destroy_process_group`` ends them, and nothing here keeps their
    sockets and threads alive past it; a re-created default group gets new control groups), its
    sequence number, and why it is unusable (None while it is fine)."""

    ranks: tuple
    group_ref: "weakref.ref"
    world_ref: "weakref.ref"
    seq: int = 0
    broken: str | None = None
    channel: str | None = None  # the flight recorder's channel: the gloo group's name

    @property
    def group(self):
        """The gloo group (None once destroyed)."""
        return self.group_ref()

    def alive_under(self, world) -> bool:
        """Whether this control group belongs to the default group ``world`` and still exists."""
        return self.world_ref() is world and self.group_ref() is not None


def _timeout_of(group) -> datetime.timedelta | None:
    """The collective timeout of ``group`` (``FLASHFSDP_CONTROL_TIMEOUT`` seconds overrides it),
    None where torch does not tell it (then torch's default for new groups)."""
    raw = os.environ.get(TIMEOUT_ENV)
    if raw:
        return datetime.timedelta(seconds=float(raw))
    return group_timeout(group)


def control_group(group=None) -> ControlGroup | None:
    """The control group over the ranks of ``group`` (None: the default group), created at the
    first call: every rank of ``group`` must make that first call, in the same order relative to
    the other groups it creates (see the module docstring). None without torch.distributed or for
    a group of one rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    group = dist.group.WORLD if group is None else group
    if dist.get_world_size(group) == 1:
        return None
    ranks = tuple(dist.get_process_group_ranks(group))
    world = dist.group.WORLD
    found = _groups.get(ranks)
    if found is None or not found.alive_under(world):
        timeout = _timeout_of(group)
        try:
            created = dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True,
                                     group_desc="flashfsdp_control", **({"timeout": timeout} if timeout else {}))
        except Exception as exc:  # noqa: BLE001 - a rank that never came: diagnosed
            raise divergence.failure(exc, None, f"creating the control group of ranks {list(ranks)}") from exc
        found = _groups[ranks] = ControlGroup(ranks, weakref.ref(created), weakref.ref(world),
                                              channel=f"control:{getattr(created, 'group_name', ranks)}")
    return found


def for_comm(comm) -> ControlGroup | None:
    """The control group of a communicator's process group (None: one rank, or no group)."""
    group = getattr(comm, "group", None)
    if group is None or comm.world_size == 1:
        return None
    return control_group(group)


def encode(value: Any) -> bytes:
    """``value`` as a control message's bytes: JSON, each container tagged with its type (``{"t":
    [...]}`` a tuple, ``{"l": [...]}`` a list, ``{"d": [[key, value], ...]}`` a dict, ``{"b":
    base64}`` bytes); None, bool, int, float and str as they are.

    Raises:
        TypeError: ``value`` holds anything else (the type is named).
    """
    return json.dumps(_tree(value), separators=(",", ":")).encode()


def _tree(value: Any) -> Any:
    if value is None or isinstance(value, (bool, str, float)):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, (bytes, bytearray)):
        return {"b": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, (tuple, list)):
        return {"t" if isinstance(value, tuple) else "l": [_tree(v) for v in value]}
    if isinstance(value, dict):
        return {"d": [[_tree(k), _tree(v)] for k, v in value.items()]}
    raise TypeError(f"a control message holds None, bool, int, float, str, bytes, tuples, lists and dicts, "
                    f"not {type(value).__name__}")


def decode(data: bytes) -> Any:
    """The value :func:`encode` made ``data`` from; nothing but data is ever built.

    Raises:
        ValueError: ``data`` is not such a message (not JSON, an unknown tag, a dict key that cannot
            be one, nested too deep).
    """
    try:
        return _value(json.loads(data))
    except RecursionError:
        raise ValueError("not a control message: nested too deep") from None
    except (ValueError, TypeError) as exc:  # (JSON, base64 and UTF-8 errors are ValueErrors)
        if str(exc).startswith("not a control message"):
            raise
        raise ValueError(f"not a control message: {type(exc).__name__}: {exc}") from None


def _value(node: Any) -> Any:
    if node is None or isinstance(node, (bool, int, float, str)):
        return node
    if isinstance(node, dict) and len(node) == 1:
        (tag, body), = node.items()
        if tag == "b" and isinstance(body, str):
            return base64.b64decode(body.encode("ascii"), validate=True)
        if tag in ("t", "l") and isinstance(body, list):
            items = [_value(v) for v in body]
            return tuple(items) if tag == "t" else items
        if tag == "d" and isinstance(body, list) and all(isinstance(p, list) and len(p) == 2 for p in body):
            return {_value(k): _value(v) for k, v in body}  # (an unhashable key: TypeError)
    raise ValueError(f"not a control message: unexpected {type(node).__name__} {str(node)[:80]}")


def exchange(ctl: ControlGroup | None, operation: str, payload: Any) -> list[Any]:
    """Collective over ``ctl``: every rank's ``payload`` (what :func:`encode` takes), by rank in ``ctl``.

    Raises:
        TypeError: ``payload`` is not what a control message holds (raised before any exchange).
        ControlMismatch: the ranks are in different operations (or exchanges); on every rank.
        divergence.CollectiveFailure: the exchange failed, timed out, outlasted the desync window
            while another rank waited on another collective, or another rank reported a failure
            while this one waited (the message says where each rank is).
        ValueError: a rank's message is longer than :data:`MAX_MESSAGE_BYTES` or does not decode
            (on every rank: each sees every message).
        RuntimeError: the control group is unusable after an earlier failure.
    """
    if ctl is None:
        return [payload]
    if ctl.broken is not None:
        raise RuntimeError(f"the control group of ranks {list(ctl.ranks)} is unusable after an earlier failure "
                           f"({ctl.broken}); {operation} cannot agree across ranks: restart the job")
    data = encode((ctl.seq + 1, operation, payload))
    ctl.seq += 1
    entry = flight.record("control", ctl.ranks, len(data), unit=operation, channel=ctl.channel)
    lengths = _all_gather(ctl, torch.tensor([len(data)], dtype=torch.int64), entry, operation)
    longest = int(lengths.max())
    if longest > MAX_MESSAGE_BYTES:
        ctl.broken = f"a control message of {longest} bytes"  # (the ranks stop here, all of them)
        raise ValueError(f"{operation}: a control message of {longest} bytes (rank "
                         f"{ctl.ranks[int(lengths.argmax())]}), over the {MAX_MESSAGE_BYTES} bytes allowed")
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    flat = _all_gather(ctl, padded, entry, operation).numpy().tobytes()
    flight.completed(entry)
    messages = [_decoded(ctl, r, flat[r * longest : r * longest + int(n)]) for r, n in enumerate(lengths.tolist())]
    _check_same_operation(ctl, messages)
    return [message[2] for message in messages]


def _decoded(ctl: ControlGroup, r: int, data: bytes) -> tuple:
    """Rank ``r``'s message (seq, operation, payload), or ValueError naming the rank."""
    try:
        message = decode(data)
    except ValueError as exc:
        message = exc
    if not (isinstance(message, tuple) and len(message) == 3 and isinstance(message[1], str)):
        ctl.broken = f"rank {ctl.ranks[r]} sent a malformed control message"
        raise ValueError(f"rank {ctl.ranks[r]} sent a control message that is not one ({message}); are all "
                         f"ranks running the same flashfsdp?")
    return message


def _check_same_operation(ctl: ControlGroup, messages: list[tuple]) -> None:
    """Raise :class:`ControlMismatch` unless every rank sent the same (sequence, operation)."""
    if len({(seq, op) for seq, op, _ in messages}) == 1:
        return
    doing = "; ".join(f"rank {ctl.ranks[r]} is in {op} (control message {seq})" for r, (seq, op, _) in enumerate(messages))
    raise ControlMismatch(
        f"the ranks are not doing the same thing: {doing}. Every rank must make the same collective calls in "
        f"the same order (the same number of training steps before a checkpoint save or a state-dict call, "
        f"the same calls on every rank)")


def _all_gather(ctl: ControlGroup, tensor: torch.Tensor, entry, operation: str) -> torch.Tensor:
    """One all-gather on the control group, waited for by polling (see the module docstring)."""
    out = torch.empty(tensor.numel() * len(ctl.ranks), dtype=tensor.dtype)
    what = f"the control exchange of {operation}"
    try:
        work = all_gather_single(out, tensor, group=ctl.group, async_op=True)
    except Exception as exc:  # noqa: BLE001 - a dead peer or a broken group: diagnosed
        ctl.broken = f"{type(exc).__name__}: {exc}"
        raise divergence.failure(exc, entry, what) from exc
    flight.waiting(entry)
    _poll(ctl, work, entry, what)
    return out


def _poll(ctl: ControlGroup, work, entry, what: str) -> None:
    """Wait for ``work``; give up when another rank reports a failure (``divergence.notice_pending``)
    or, past the desync window, when the ranks wait on collectives that cannot pair."""
    start = time.monotonic()
    pause, next_look = 1e-5, start + NOTICE_POLL_S
    window, stall = flight_desync.window(), None
    try:
        while not work.is_completed():
            now = time.monotonic()
            if now >= next_look:
                if divergence.notice_pending():
                    ctl.broken = "another rank reported a failed collective"  # (gloo's work keeps its buffers)
                    raise divergence.failure(RuntimeError("another rank reported a failed collective while this "
                                                          "rank waited"), entry, what, reason="interrupted")
                if window is not None and entry is not None and now - start >= window:
                    stall = stall or flight_desync.Stall(entry)
                    verdict = stall.check()
                    if verdict is not None:
                        ctl.broken = "the ranks desynchronised"
                        error = flight_desync.DesyncError(verdict)
                        raise divergence.failure(error, entry, what) from error
                next_look = time.monotonic() + NOTICE_POLL_S
            time.sleep(pause)
            pause = min(pause * 2, 0.005)
    finally:
        if stall is not None:
            stall.close()
    try:
        work.wait()
    except Exception as exc:  # noqa: BLE001 - a timeout or a dead peer: diagnosed
        ctl.broken = f"{type(exc).__name__}: {str(exc).strip()[:200]}"
        raise divergence.failure(exc, entry, what) from exc
