"""Execution order and prefetch decisions: a pure policy over unit keys (no tensors).

The runtime (``flashfsdp.bindings``) and the overlap simulator replay the same policy:

- The forward order of units is recorded every step. Implicit **forward prefetch**: when unit u
  starts its forward, unshard the unit that followed u in the last complete step's order — but only
  while this step has followed that order so far; a changed order (a branch taken, a unit skipped
  or run twice) turns implicit prefetch off for the rest of the step and the new order is recorded
  for the next one. So a wrong guess costs at most the one prefetch issued just before the order
  changed (a unit that then runs later in the step uses it; one that never runs is resharded at
  the end of the step).
- Implicit **backward prefetch**: when unit u starts its backward, unshard the unit whose forward
  *ended* just before u's did (backward runs in reverse post-forward order). Ordering by
  post-forward, as FSDP2 does, makes the root — whose forward ends last — prefetch the last block.
  A unit that ran k times in forward starts k backwards, last forward first: its j-th backward
  prefetches the predecessor of its (k-j+1)-th forward (``record_pre_backward`` counts them).
- **Keep the last unit for backward**: the unit whose forward ends last before the root's (the
  last block) is the first one the backward needs. Resharding it after its forward only to
  all-gather it again at once costs an all-gather that nothing can hide (only the loss and the
  root's short backward run in between), so while implicit backward prefetch is on and the step
  follows the recorded order, that unit keeps its parameters (``keep_for_backward``). torchtitan
  does the same by hand (``reshard_after_forward=False`` on the last block); the price is that
  block's unsharded parameters held through the loss. ``max_inflight = 0`` turns it off.
- Explicit lists (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``)
  replace the implicit choice for that unit.
- At most ``max_inflight`` prefetched units may be unsharded ahead of compute.

Same policy as FSDP2's implicit prefetching (``_fsdp_state.py``) with FSDP1's order validation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

Key = Hashable


@dataclass
class ExecutionOrder:
    """The forward order of units: this step's (being recorded) and the last complete step's."""

    current: list = field(default_factory=list)
    previous: list | None = None
    diverged: bool = False
    post_forward: list = field(default_factory=list)
    previous_post_forward: list | None = None
    backward_starts: dict = field(default_factory=dict)
    # where each key's forwards ended in ``post_forward`` (and their counts in the previous step's):
    # indexes built as the lists grow, so that lookups per unit do not walk the whole step
    _index: dict = field(default_factory=dict, repr=False, compare=False)
    _indexed: int = field(default=0, repr=False, compare=False)
    _previous_counts: dict | None = field(default=None, repr=False, compare=False)

    def _positions(self, key: Key) -> list[int]:
        """The positions of ``key`` in ``post_forward``."""
        post = self.post_forward
        if self._indexed > len(post):  # the list was replaced or cut: index it again
            self._index, self._indexed = {}, 0
        for pos in range(self._indexed, len(post)):
            self._index.setdefault(post[pos], []).append(pos)
        self._indexed = len(post)
        return self._index.get(key, [])

    def start_step(self) -> None:
        """Close the step being recorded (it becomes ``previous``) and start a new one."""
        if self.current:
            self.previous = self.current
        if self.post_forward:
            self.previous_post_forward = self.post_forward
            self._previous_counts = None
        self.current = []
        self.post_forward = []
        self._index, self._indexed = {}, 0
        self.backward_starts = {}
        self.diverged = False

    def record_post_forward(self, key: Key) -> None:
        """Note that ``key`` finished its forward (drives the backward prefetch order)."""
        self.post_forward.append(key)

    def record_pre_backward(self, key: Key) -> None:
        """Note that ``key`` started a backward (the j-th of this step pairs with its j-th last
        forward, see :meth:`previous_in_forward`)."""
        self.backward_starts[key] = self.backward_starts.get(key, 0) + 1

    def record(self, key: Key) -> None:
        """Note that ``key`` started its forward (first call per step counts; re-runs are kept too)."""
        self.current.append(key)
        prev = self.previous
        pos = len(self.current) - 1
        if prev is None or pos >= len(prev) or prev[pos] != key:
            self.diverged = True

    def next_forward(self, key: Key) -> Key | None:
        """The unit after ``key`` in the previous step, if this step has followed it so far."""
        prev = self.previous
        if prev is None or self.diverged:
            return None
        pos = len(self.current) - 1
        if pos < 0 or self.current[pos] != key or pos + 1 >= len(prev):
            return None
        return prev[pos + 1]

    def forward_after(self, key: Key) -> list:
        """The units expected to start their forward after ``key``'s, in order: the rest of the
        last complete step's order after ``key``, where ``key`` is the unit that just started
        or the one expected next, while this step has followed that order; else none."""
        prev = self.previous
        if prev is None or self.diverged:
            return []
        pos = len(self.current)
        if pos and self.current[-1] == key:
            return prev[pos:]
        if pos < len(prev) and prev[pos] == key:
            return prev[pos + 1:]
        return []

    def backward_after(self, key: Key) -> list:
        """The units expected to start their backward after ``key``'s, in order: those whose
        forward ended before the forward of ``key`` that its current (or, not started yet, next)
        backward undoes, latest first (see :meth:`previous_in_forward`)."""
        positions = self._positions(key)
        which = len(positions) - max(1, self.backward_starts.get(key, 1))
        if which < 0:
            return []
        return self.post_forward[positions[which] - 1 :: -1] if positions[which] > 0 else []

    def ends_forward_before_root(self, key: Key) -> bool:
        """Whether the forward of ``key`` that just ended is the last non-root forward of the step:
        in the last complete step ``key`` ended its forward just before the root did (the root's
        forward ends last), this step has followed that step's order so far, and ``key`` has now
        ended as many forwards as it did then."""
        prev = self.previous_post_forward
        if prev is None or len(prev) < 2 or self.diverged or prev[-2] != key:
            return False
        if self._previous_counts is None:
            counts: dict = {}
            for k in prev:
                counts[k] = counts.get(k, 0) + 1
            self._previous_counts = counts
        return len(self._positions(key)) == self._previous_counts.get(key, 0)

    def previous_in_forward(self, key: Key) -> Key | None:
        """The unit whose forward ended just before the forward of ``key`` that the current backward
        undoes: its last forward for its first backward (or when no backward was recorded), the
        one before for its second, and so on. None if there is no such forward or predecessor."""
        positions = self._positions(key)
        which = len(positions) - max(1, self.backward_starts.get(key, 1))
        if which < 0:
            return None
        pos = positions[which]
        return self.post_forward[pos - 1] if pos > 0 else None


@dataclass
class PrefetchPolicy:
    """Which units to unshard ahead of compute.

    Attributes:
        forward: implicit forward prefetch on/off.
        backward: implicit backward prefetch on/off.
        max_inflight: most units prefetched ahead of compute at once (>= 0).

    An explicit list given to ``forward_targets``/``backward_targets`` replaces the implicit choice.
    """

    forward: bool = True
    backward: bool = True
    max_inflight: int = 2

    def __post_init__(self) -> None:
        if self.max_inflight < 0:
            raise ValueError(f"max_inflight must be >= 0, got {self.max_inflight}")

    def forward_targets(self, key: Key, order: ExecutionOrder, explicit: Sequence[Key] | None = None) -> list:
        """Units to prefetch when ``key`` starts its forward (``explicit``, if given, wins)."""
        if explicit is not None:
            return list(explicit)
        nxt = order.next_forward(key) if self.forward else None
        return [nxt] if nxt is not None and nxt != key else []

    def backward_targets(self, key: Key, order: ExecutionOrder, explicit: Sequence[Key] | None = None) -> list:
        """Units to prefetch when ``key`` starts its backward (``explicit``, if given, wins)."""
        if explicit is not None:
            return list(explicit)
        prv = order.previous_in_forward(key) if self.backward else None
        return [prv] if prv is not None and prv != key else []

    def keep_for_backward(self, key: Key, order: ExecutionOrder) -> bool:
        """Whether ``key`` should keep its unsharded parameters after the forward that just ended
        (it is the first unit the backward needs; see the module docstring). Only while implicit
        backward prefetch is on and prefetching is allowed (``max_inflight > 0``)."""
        return self.backward and self.max_inflight > 0 and order.ends_forward_before_root(key)

    def admit(self, targets: Sequence[Key], inflight: int) -> list:
        """The prefix of ``targets`` that fits under ``max_inflight`` given ``inflight`` prefetched."""
        room = max(0, self.max_inflight - inflight)
        return list(targets[:room])
