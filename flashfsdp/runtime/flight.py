"""The flight recorder: the last N collectives of this process, cheap enough to stay on.

When the ranks of a job stop issuing the same collectives (one rank skipped a backward, ran one
batch more, called ``save`` while another ran a forward), gloo times out or aborts and NCCL hangs,
and the error names neither where each rank was nor where they parted. So every collective a
flashfsdp communicator issues, and every control exchange (``control.py``), takes one slot of a
ring of :data:`DEFAULT_ENTRIES` entries (``FLASHFSDP_FLIGHT_RECORDER=<N>``; 0 turns it off):

    seq (this process's count of recorded collectives), kind ("all_gather", "reduce_scatter",
    "all_reduce", "broadcast", "control"), group (its ranks), channel (the process group it runs
    on, by name) and gseq (its number among this process's collectives on that channel: the same
    collective has the same number on every rank), unit, phase, step, bytes, state ("issued",
    "waiting", "completed", "failed") and the wall-clock times of issue and end.

Cost: one small object per collective and a few attribute stores (measured by
``benchmarks/flight_recorder.py``). The phase and the step come from the units' hooks
(:func:`enter_hook`, called by ``trace.labelled``): "forward" or "backward" inside them, the
named operation inside :func:`operation` (a checkpoint save, a gradient-norm all-reduce),
"backward" inside the autograd engine elsewhere (the end-of-backward callback), else "outside
forward/backward". The step counts the root's forwards outside backward, as ``profile()`` does
(per root: the step of the root that ran last), until the application says which step it runs
(:func:`set_step`, e.g. the training job's step: evaluation batches and gradient-accumulation
micro-batches then count for nothing).

What reads the ring: ``divergence.py`` (the error every reachable rank raises when a collective
fails, naming where each rank is), ``flight_desync.py`` (the ranks' positions compared once a
collective outlasts the desync window) and ``flight_dump.py`` (the per-rank JSON dumps that
``python -m flashfsdp.debug`` reads).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import weakref
from typing import Iterator

from flashfsdp._torch_private import current_graph_task_id

from .env import count_from_env

ENV_ENTRIES = "FLASHFSDP_FLIGHT_RECORDER"
DEFAULT_ENTRIES = 2048
ISSUED, WAITING, COMPLETED, FAILED = "issued", "waiting", "completed", "failed"
OUTSIDE = "outside forward/backward"
_HOOK_PHASES = {"pre_forward": "forward", "post_forward": "forward", "pre_backward": "backward",
                "post_backward": "backward"}


class Entry:
    """One recorded collective (see the module docstring for the fields)."""

    __slots__ = ("seq", "kind", "group", "channel", "gseq", "unit", "phase", "step", "nbytes", "state", "issued_at",
                 "ended_at")

    def as_dict(self) -> dict:
        """The entry as JSON-serialisable values."""
        return {name: getattr(self, name) for name in self.__slots__}


def _entries_from_env() -> int:
    """The ring's size from ``FLASHFSDP_FLIGHT_RECORDER`` (default :data:`DEFAULT_ENTRIES`).

    Raises:
        ValueError: the variable is not an integer >= 0.
    """
    return count_from_env(ENV_ENTRIES, DEFAULT_ENTRIES, "set it to the number of collectives to keep (0: off)")


class _State:
    """The process's ring and what the hooks told it (module-level singleton :data:`_state`)."""

    def __init__(self, size: int):
        self.size = size
        self.ring: list = [None] * size
        self.counter = itertools.count(1)  # next() is atomic under the GIL: threads may record too
        self.last_seq = 0
        self.step = 0  # the step of the root that ran last (or the application's: set_step)
        self.app_step = False  # whether the application sets the step (set_step)
        self.channels: dict = {}  # channel -> itertools.count of its collectives (gseq)
        self.issued: dict = {}  # channel -> the last gseq taken there
        self.steps: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # root -> its steps
        self.phase: str | None = None  # the hook running now (None: no hook)
        self.unit: str | None = None  # the unit whose hook ran last
        self.hook_thread: int | None = None  # threading.get_ident() of the thread that ran it
        self.local = threading.local()  # .operations: this thread's stack of named operations


_state = _State(_entries_from_env())


def configure(entries: int = DEFAULT_ENTRIES) -> None:
    """Start afresh with a ring of ``entries`` slots (0: recording off): no entry, seq and steps
    from 0.

    Raises:
        ValueError: ``entries`` < 0.
    """
    if entries < 0:
        raise ValueError(f"flight recorder: entries must be >= 0, got {entries}")
    _state.__init__(entries)


def enabled() -> bool:
    """Whether collectives are recorded."""
    return _state.size > 0


def current_operation() -> str | None:
    """The innermost :func:`operation` this thread is in, or None."""
    operations = getattr(_state.local, "operations", None)
    return operations[-1] if operations else None


def current_phase() -> str:
    """What this thread is doing now, for a collective it issues (see the module docstring)."""
    operation_name = current_operation()
    if operation_name is not None:
        return operation_name
    if _state.phase is not None:
        return _state.phase
    return "backward" if current_graph_task_id() != -1 else OUTSIDE


def record(kind: str, group: tuple, nbytes: int, unit: str | None = None, phase: str | None = None,
           channel: str | None = None) -> Entry | None:
    """Record a collective being issued (state "issued"); returns its entry, None when off.

    Args:
        kind: "all_gather", "reduce_scatter", "all_reduce", "broadcast" or "control".
        group: the global ranks of its group (a tuple, for the reports).
        nbytes: the bytes this rank sends (its input).
        unit: the unit it serves, if known now (``Work.set_unit`` names it later otherwise).
        phase: overrides :func:`current_phase` (a control exchange names its operation).
        channel: the process group it runs on, by a name that is the same on every rank of it
            (torch's ``group_name``); default: the kind's family and the ranks.
    """
    state = _state
    if not state.size:
        return None
    entry = Entry()
    entry.seq = seq = next(state.counter)
    if channel is None:
        channel = f"{'control' if kind == 'control' else 'data'}:{','.join(map(str, group))}"
    counter = state.channels.get(channel)
    if counter is None:
        counter = state.channels.setdefault(channel, itertools.count(1))
    entry.channel, entry.gseq = channel, next(counter)
    state.issued[channel] = entry.gseq
    entry.kind, entry.group, entry.unit, entry.nbytes = kind, group, unit, nbytes
    entry.phase = phase if phase is not None else current_phase()
    entry.step, entry.state, entry.issued_at, entry.ended_at = state.step, ISSUED, time.time(), None
    state.ring[seq % state.size] = entry
    state.last_seq = seq
    return entry


def waiting(entry: Entry | None) -> None:
    """The caller blocks on ``entry``'s collective now."""
    if entry is not None and entry.state is ISSUED:
        entry.state = WAITING


def completed(entry: Entry | None) -> None:
    """``entry``'s collective completed (its wait returned)."""
    if entry is not None:
        entry.state, entry.ended_at = COMPLETED, time.time()


def failed(entry: Entry | None) -> None:
    """``entry``'s collective failed (its wait raised: a timeout, a closed connection, an abort)."""
    if entry is not None:
        entry.state, entry.ended_at = FAILED, time.time()


def enter_hook(kind: str, owner, unit: str) -> tuple:
    """A unit's hook ``kind`` ("pre_forward", "post_forward", "pre_backward", "post_backward")
    starts on ``owner`` (``.parent`` None for a root, whose pre-forward outside backward starts a
    step) of the unit named ``unit``. Returns what :func:`exit_hook` restores."""
    state = _state
    saved = (state.phase, state.unit)
    phase = _HOOK_PHASES.get(kind, kind)
    if kind == "pre_forward":
        if current_graph_task_id() != -1:
            phase = "backward (recomputation)"
        elif getattr(owner, "parent", 0) is None and state.app_step:  # a root, at the application's step
            state.steps[owner] = state.step
        elif getattr(owner, "parent", 0) is None:  # a root: its next step
            state.step = state.steps[owner] = state.steps.get(owner, 0) + 1
    state.phase = phase
    state.unit = unit
    state.hook_thread = threading.get_ident()
    return saved


def exit_hook(saved: tuple) -> None:
    """The hook that :func:`enter_hook` announced ended; the unit named last stays named."""
    _state.phase = saved[0]


@contextlib.contextmanager
def operation(name: str) -> Iterator[None]:
    """The collectives this thread issues inside the block belong to the operation ``name``
    (e.g. "checkpoint.save", "clip_grad_norm_"): their phase, and the position reports give."""
    local = _state.local
    stack = getattr(local, "operations", None)
    if stack is None:
        stack = local.operations = []
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def entries() -> list[Entry]:
    """The recorded entries still in the ring, oldest first."""
    state = _state
    if not state.size:
        return []
    first = max(1, state.last_seq - state.size + 1)
    found = (state.ring[seq % state.size] for seq in range(first, state.last_seq + 1))
    return sorted((e for e in found if e is not None), key=lambda e: e.seq)


def position() -> dict:
    """Where this process is now: step, phase, unit whose hook ran last, this thread's operation,
    the last seq recorded, and the entry it waits on (or None)."""
    recorded = entries()
    pending = [e for e in recorded if e.state in (WAITING, FAILED)]
    return {"step": _state.step, "phase": current_phase(), "unit": _state.unit, "last_seq": _state.last_seq,
            "waiting": pending[-1].as_dict() if pending else None}


def hook_thread() -> int | None:
    """``threading.get_ident()`` of the thread that ran the last unit hook (None: none ran yet)."""
    return _state.hook_thread


def step() -> int:
    """The step count (root forwards outside backward so far, or the application's: :func:`set_step`)."""
    return _state.step


def set_step(step: int | None) -> None:
    """The collectives recorded from now on belong to the application's step ``step`` (e.g. the
    training step being run, 1 for the first); root forwards no longer count steps. None: count
    them again, from the step set last.

    Raises:
        TypeError: ``step`` is not an int (or None).
    """
    if step is None:
        _state.app_step = False
        return
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"set_step: step must be an int or None, got {type(step).__name__}")
    _state.step, _state.app_step = step, True


def issued() -> dict[str, int]:
    """How many collectives this process has issued on each channel (see :func:`record`)."""
    return dict(_state.issued)


def last_seq() -> int:
    """The seq of the last collective recorded (0: none)."""
    return _state.last_seq
