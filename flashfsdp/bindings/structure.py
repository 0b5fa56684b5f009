"""The same model on every rank: checked once, with one small control exchange, before the first all-gather.

Every collective of a unit assumes that each rank's unit has the same flat layout (the same
parameters, in the same order, of the same shapes and dtypes) and the same settings that shape its
collectives: all-gather dtype (int8 on one rank: gloo aborts the process), ``reshard_after_forward``
(True on one rank, False on another: the backward all-gathers of one rank meet nothing), mesh,
mixed-precision policy, CPU offload, backward all-gather elision. So the root's lazy init (its
first forward), and the state-dict functions that gather before any forward, call
:func:`check_same_structure`: per communicator, one exchange of a 32-byte digest of its units'
rows over its control group (``flashfsdp.runtime.control``: never on the group the units'
all-gathers use, so a rank that is elsewhere gets a named error, not an abort); only when the
digests differ are the rows themselves exchanged, to name the first difference. A unit's rows are
compared once (on every rank alike: the ranks run the same calls); the exchange itself happens at
every call, as it also carries the errors of the checks before it.

A full state-dict read from a thread other than the training thread is refused on that thread
before any exchange (``concurrency.thread_refusal``); a first forward while another thread runs a
training step is refused on every rank through the exchange (``concurrency.busy_error``).
"""

from __future__ import annotations

import hashlib
import json
import weakref
from typing import Iterable

from flashfsdp.runtime import control
from flashfsdp.runtime.agreement import error_payload, global_rank, operation_name, raise_agreed, raise_own

from .autograd import outside_functorch
from .concurrency import busy_error, thread_refusal

# Units already found identical on every rank (weakly: a unit's state dies with its module).
_checked: "weakref.WeakSet" = weakref.WeakSet()
CHECK = "the same-model check"
_CALLERS = {"bindings.root.init_root": "at the first forward"}  # friendlier names of some callers


def _dtype(value) -> str | None:
    return None if value is None else str(value)


def _step_settings(state) -> list[list]:
    """``reshard_after_forward`` (as given: a bool, a post-forward group size, or None),
    ``reshard_after_backward`` and ``unshard_in_backward``, from the unit's step settings."""
    settings = getattr(state, "settings", state)  # (older states hold them themselves)
    after_forward = settings.reshard_after_forward
    if hasattr(after_forward, "reshard"):  # resolved: as given (None: not given)
        resolved = after_forward
        after_forward = (resolved.post_forward_size or resolved.reshard) if resolved.explicit else None
    return [["reshard_after_forward", after_forward],
            ["reshard_after_backward", settings.reshard_after_backward],
            ["unshard_in_backward", settings.unshard_in_backward]]


def unit_settings(state) -> list[list]:
    """The unit's settings that change its collectives, as ``[name, value]`` pairs (JSON values)."""
    unit, mp = state.unit, state.mp_policy
    groups = unit.groups
    mesh = getattr(unit.spec, "mesh", None)
    return [
        ["world size", unit.comm.world_size],
        ["post-forward group size", unit.post_forward_comm.world_size if unit.post_forward_comm is not None else None],
        ["replicate group size", unit.replicate_comm.world_size if unit.replicate_comm is not None else None],
        ["mesh shape", list(mesh.shape) if mesh is not None else None],
        ["param_dtype", _dtype(unit.param_dtype)], ["reduce_dtype", _dtype(unit.reduce_dtype)],
        ["output_dtype", _dtype(mp.output_dtype)], ["cast_forward_inputs", bool(mp.cast_forward_inputs)],
        ["all_gather_dtype", _dtype(unit.all_gather_dtype)],
        *_step_settings(state),
        ["CPU offload", any(g.offload for g in groups)], ["pin_memory", any(g.pin_memory for g in groups)],
        ["backward all-gather elision", bool(getattr(getattr(state, "elision", None), "enabled", False))],
        ["separate reduce-scatter group", unit.rs_comm is not None],
        ["requires_all_reduce", unit.requires_all_reduce],
    ]


def unit_structure(state) -> list[list]:
    """What must be identical on every rank for one unit: a row of its settings
    ``[unit name, None, settings]`` (:func:`unit_settings`), then one row per parameter,
    ``[unit name, parameter name, shape, dtype, group]``. JSON-serialisable."""
    unit = state.unit
    rows = [[unit.name, None, unit_settings(state)]]
    for g, group in enumerate(unit.groups):
        for fqn, shape in zip(group.fqns, group.shapes):
            rows.append([unit.name, fqn, list(shape), str(group.dtype), g])
    return rows


def check_same_structure(states: Iterable, error: BaseException | None = None) -> None:
    """Collective: raise on every rank unless every rank's units are the same as this rank's.

    Each communicator of the units gets one exchange on its control group, carrying this rank's
    error and a 32-byte digest of :func:`unit_structure` of its units not checked yet (in the given
    order); on a mismatch a second exchange carries the rows, and the error names the first
    difference. Units on the meta device (not materialised: nothing to gather yet) and
    single-rank units are skipped.

    Args:
        states: the units (FSDPStates), in the same order on every rank.
        error: this rank's own error in the checks that precede (e.g. a refused setting): it takes
            part in the exchange, so that a rank that failed alone fails every rank.

    Raises:
        ValueError: the units differ across ranks; names the unit, the parameter or setting, the
            ranks and their values (raised identically on every rank of the communicator).
        RuntimeError: a state-dict read from a thread other than the training thread (on this
            rank, before any exchange), or a first forward while another thread runs a step.
        control.ControlMismatch: a rank is in another operation (named).
        Exception: ``error`` of the first rank that had one, on every rank (see ``runtime/agreement.py``).
    """
    states = list(states)
    caller = operation_name()
    if caller not in _CALLERS:  # a state-dict read (the root's first forward is checked below)
        refused = thread_refusal(states, global_rank())
        if refused is not None:
            raise refused
    error = error or busy_error(states)
    by_comm: dict[int, list] = {}
    for state in states:
        if state.unit.device.type == "meta" or state.unit.comm.world_size == 1:
            continue
        by_comm.setdefault(id(state.unit.comm), []).append(state)
    operation = f"{CHECK} ({_CALLERS.get(caller, caller)})"
    with outside_functorch():  # a first forward inside torch.func.jvp: plain tensors here
        _exchange(by_comm, operation, error)
    raise_own(error)  # the same error on every rank (or W = 1)
    for group_states in by_comm.values():
        _checked.update(group_states)


def _exchange(by_comm: dict[int, list], operation: str, error: BaseException | None) -> None:
    """Per communicator: the digests exchanged (of the units not checked yet: none is an empty
    digest, the exchange still carries the errors); on a mismatch the rows, and the error."""
    for group_states in by_comm.values():
        ctl = control.for_comm(group_states[0].unit.comm)
        rows = [row for state in group_states if state not in _checked for row in unit_structure(state)]
        encoded = json.dumps(rows).encode()
        everyone = control.exchange(ctl, operation, (error_payload(error), hashlib.sha256(encoded).digest()))
        raise_agreed([payload for payload, _ in everyone], error)
        if len({digest for _, digest in everyone}) > 1:
            raise ValueError(describe_difference([json.loads(b) for b in control.exchange(ctl, operation, encoded)]))


def describe_difference(rows_by_rank: list[list[list]]) -> str:
    """The first row where a rank's structure differs from rank 0's, in words (what to do included)."""
    reference = rows_by_rank[0]
    for rank, rows in enumerate(rows_by_rank[1:], start=1):
        for i in range(max(len(reference), len(rows))):
            ours = reference[i] if i < len(reference) else None
            theirs = rows[i] if i < len(rows) else None
            if ours != theirs:
                return _difference(ours, theirs, rank)
    return "fully_shard: the units differ across ranks (no single difference found)"


def _label(row: list) -> str:
    return f"unit '{row[0]}'" + (f" parameter '{row[1]}'" if row[1] is not None else "")


def _setting_difference(ours: list, theirs: list) -> str:
    """``"all_gather_dtype torch.int8 on rank 1 but None on rank 0"``-style text for two settings lists."""
    for (name, mine), (_, other) in zip(ours, theirs):
        if mine != other:
            return f"{name} {other}", f"{name} {mine}"
    return f"settings {theirs}", f"settings {ours}"


def _difference(ours: list | None, theirs: list | None, rank: int) -> str:
    """One differing row of rank 0 (``ours``) and of ``rank`` (``theirs``; None: no such row)."""
    fix = ("every rank must build the same model (the same parameters, shapes and dtypes, and the same "
           "fully_shard calls with the same settings) before its first forward")
    head = "fully_shard: the model differs across ranks:"
    if ours is None or theirs is None:
        present, absent, row = (0, rank, ours) if theirs is None else (rank, 0, theirs)
        return f"{head} rank {present} has {_label(row)} but rank {absent} has no such entry there; {fix}"
    if ours[:2] != theirs[:2]:
        return f"{head} rank 0 has {_label(ours)} where rank {rank} has {_label(theirs)}; {fix}"
    if ours[1] is None:
        theirs_text, ours_text = _setting_difference(ours[2], theirs[2])
        return f"{head} {_label(ours)} has {theirs_text} on rank {rank} but {ours_text} on rank 0; {fix}"
    return (f"{head} {_label(ours)} has shape {tuple(ours[2])}, dtype {ours[3]} (flat group {ours[4]}) on rank 0 "
            f"but shape {tuple(theirs[2])}, dtype {theirs[3]} (flat group {theirs[4]}) on rank {rank}; {fix}")
