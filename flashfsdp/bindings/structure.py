"""The same model on every rank: checked once, with one small collective, before the first all-gather.

Every collective of a unit assumes that each rank's unit has the same flat layout: the same
parameters, in the same order, of the same shapes and dtypes. A model built differently on one rank
(a parameter of 4160 elements where the others have 4096, a block more) would make the ranks issue
collectives of different sizes: gloo aborts the process, NCCL hangs or reads out of bounds. So the
root's lazy init (its first forward), and the state-dict functions that gather before any forward,
call :func:`check_same_structure`: per communicator, one all-gather of a 32-byte digest of its
units' structure (over its torch process group: a control-plane collective, not one of the units'); only when the digests differ are the descriptions themselves gathered, to name
the first difference. A unit is checked once (on every rank alike: the ranks run the same calls).
"""

from __future__ import annotations

import hashlib
import json
import weakref
from typing import Iterable

from .autograd import outside_functorch
from .agreement import all_gather_bytes, all_gather_fixed, error_payload, raise_agreed, raise_own

# Units already found identical on every rank (weakly: a unit's state dies with its module).
_checked: "weakref.WeakSet" = weakref.WeakSet()


def unit_structure(state) -> list[list]:
    """What must be identical on every rank for one unit: one row per parameter,
    ``[unit name, parameter name, shape, dtype, group]``, plus a row of the unit's settings that
    change its collectives (world size, ``param_dtype``, ``reduce_dtype``, post-forward group size).
    JSON-serialisable."""
    unit = state.unit
    post_forward = unit.post_forward_comm.world_size if unit.post_forward_comm is not None else None
    rows = [[unit.name, None, ["world size", unit.comm.world_size, "post-forward group", post_forward],
             [str(unit.param_dtype), str(unit.reduce_dtype)], None]]
    for g, group in enumerate(unit.groups):
        for fqn, shape in zip(group.fqns, group.shapes):
            rows.append([unit.name, fqn, list(shape), str(group.dtype), g])
    return rows


def check_same_structure(states: Iterable, error: BaseException | None = None) -> None:
    """Collective: raise on every rank unless every rank's units are the same as this rank's.

    Each communicator among the units not checked yet gets one all-gather of a 32-byte digest (of
    :func:`unit_structure` of its units, in the given order); on a mismatch a second exchange gathers
    the rows, and the error names the first difference. Units on the meta device (not materialised:
    nothing to gather yet) and single-rank units are skipped.

    Args:
        states: the units (FSDPStates), in the same order on every rank.
        error: this rank's own error in the checks that precede (e.g. a refused setting): it takes
            part in the digest, so that a rank that failed alone fails every rank.

    Raises:
        ValueError: the units differ across ranks; names the unit, the parameter, the ranks and
            their shapes/dtypes (raised identically on every rank of the communicator).
        Exception: ``error`` of the first rank that had one, on every rank (see ``agreement.py``).
    """
    by_comm: dict[int, list] = {}
    for state in states:
        if state in _checked or state.unit.device.type == "meta" or state.unit.comm.world_size == 1:
            continue
        by_comm.setdefault(id(state.unit.comm), []).append(state)
    head = [] if error is None else [["error", *error_payload(error)]]
    with outside_functorch():  # a first forward inside torch.func.jvp: plain tensors here
        _exchange(by_comm, head, error)
    raise_own(error)  # the same error on every rank (or W = 1)
    for group_states in by_comm.values():
        _checked.update(group_states)


def _exchange(by_comm: dict[int, list], head: list, error: BaseException | None) -> None:
    """Per communicator: the digests all-gathered; on a mismatch the rows, and the error."""
    for group_states in by_comm.values():
        comm, device = group_states[0].unit.comm, group_states[0].unit.device
        rows = head + [row for state in group_states for row in unit_structure(state)]
        encoded = json.dumps(rows).encode()
        # over the torch process group: a control-plane collective, not one of the unit's (which
        # its communicator carries, counts and traces)
        digests = all_gather_fixed(comm, hashlib.sha256(encoded).digest(), device, over_group=True)
        if len(set(digests)) > 1:
            everyone = [json.loads(b) for b in all_gather_bytes(comm, encoded, device)]
            raise_agreed([tuple(rows[0][1:]) if rows and rows[0][0] == "error" else None for rows in everyone], error)
            raise ValueError(describe_difference(everyone))


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
        return (f"{head} {_label(ours)} has settings {ours[2]} {ours[3]} on rank 0 but {theirs[2]} {theirs[3]} "
                f"on rank {rank}; {fix}")
    return (f"{head} {_label(ours)} has shape {tuple(ours[2])}, dtype {ours[3]} (flat group {ours[4]}) on rank 0 "
            f"but shape {tuple(theirs[2])}, dtype {theirs[3]} (flat group {theirs[4]}) on rank {rank}; {fix}")
