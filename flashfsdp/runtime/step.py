"""One training step of the units under one root, without tensors: the protocol three drivers run.

The runtime (``flashfsdp.bindings``) executes the step on tensors, the overlap simulator
(``flashfsdp.sim``) on costs and the estimator (``flashfsdp.estimate``) on bytes. All three call the
same :class:`StepProtocol` at the same points of a unit's life, and it decides — from the unit's
resolved settings (:class:`UnitSettings`), the recorded execution order and the prefetch policy
(``schedule.py``) — which unshard, wait, reshard (to the full shard or the post-forward one),
prefetch and reduction happen, calling them on the driver's :class:`StepExecutor`:

======================  =================================================================================
``start_step(units)``   the root's pre-forward: finish the last step's reductions, start recording the
                        order, reshard the units whose gathered parameters went stale
``pre_forward(u)``      record u; wait for u's all-gather (issue it if no prefetch did); prefetch the
                        forward targets the policy admits
``post_forward(u, bwd)``  no backward follows (grad off): reshard u unless its ``reshard_after_forward``
                        is False (FSDP2 keeps it gathered), and the root reshards every unit
                        prefetched but not run; else reshard to the post-forward sharding when u's
                        ``reshard_after_forward`` says so — except the root and the unit the schedule
                        keeps for backward when the value was not given (FSDP2's default)
``pre_backward(u)``     record u; wait for u's parameters unless its backward needs none
                        (``set_unshard_in_backward(False)``, backward all-gather elision); prefetch the
                        backward targets that need theirs
``gradients_ready(u)``  reduce u's gradients (the driver issues the reduction, then finishes those
                        issued before it, so the next unit's backward runs while they are in flight)
``backward_done(u)``    reshard u unless ``set_reshard_after_backward(False)``
``end_backward(...)``   the units whose backward started but did not finish: reduce and end them;
                        reshard what still holds parameters it should not; with the last backward of
                        the step, reshard unused prefetches and finish every reduction
======================  =================================================================================

[Note: buckets]
Units that run back to back and are small share their collectives (``bucket_bytes`` > 0, the
driver's :meth:`StepExecutor.all_gather_bucket` / :meth:`StepExecutor.reduce_scatter_bucket` saying
which may and how many bytes they move). Where the protocol would issue the all-gather of a unit
u, it issues one all-gather for u and the units that follow u in the order of the phase (forward:
the last complete step's forward order, while this step follows it; backward: this step's forward
ends, latest first) and need their parameters there, as long as they are of u's bucket class and
the bucket's bytes stay within ``bucket_bytes``; units already unsharded are passed over, units
with nothing to gather do not end the run, any other unit ends it. The units gathered with u count
as prefetched (one in-flight all-gather for ``max_inflight``) and are resharded at the end of the
step if they did not run. Explicit prefetch lists unshard their targets alone. The first step,
whose forward order is not known yet, gathers its forward unit by unit.
Reductions are bucketed in the order their gradients become ready: a unit's reduction joins the
open bucket, which is issued as one reduce-scatter when the next unit expected to reduce (the
backward order above) would not fit or is of another class, when a unit of another class
reduces, and before any reduction is finished (the end of each backward, the next step). Every
decision depends only on the order, the units and their settings, which every rank shares, so
every rank issues the same collectives.

:class:`ReshardAfterForward` and its resolution from FSDP2's ``reshard_after_forward`` argument live
here, once. A driver may record the calls it receives (``StepProtocol.log``) to compare with another
driver's: the same model gives the same action sequence (``tests/runtime/test_step.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Hashable, Iterable, Protocol, Sequence

from .schedule import ExecutionOrder, PrefetchPolicy
from .states import ShardState

Key = Hashable


@dataclass(frozen=True)
class ReshardAfterForward:
    """FSDP2's ``reshard_after_forward: bool | int | None`` resolved once.

    Attributes:
        reshard: free the unsharded parameters after forward (None and True and W: yes; False and
            1: no).
        explicit: the value was given (not None). With None (FSDP2's default) the root keeps its
            parameters (its backward starts at once), and so does the unit whose forward ends
            last before the root's (the schedule's ``keep_for_backward``); an explicit value is
            followed exactly, as FSDP2 does.
        post_forward_size: k for 1 < k < W: keep 1/k of the parameters after forward and all-gather
            over k consecutive ranks in backward (ZeRO++ hpZ); None otherwise.
    """

    reshard: bool
    explicit: bool
    post_forward_size: int | None = None


def resolve_reshard_after_forward(value, world_size: int) -> ReshardAfterForward:
    """Resolve ``reshard_after_forward`` for a unit over ``world_size`` ranks.

    Raises:
        ValueError: an int that is < 1, > W or does not divide W.
        TypeError: neither a bool, an int nor None.
    """
    if value is None or isinstance(value, bool):
        return ReshardAfterForward(value is not False, value is not None, None)
    if not isinstance(value, int):
        raise TypeError(f"fully_shard: reshard_after_forward must be a bool, an int or None, got {type(value).__name__}")
    if value < 1 or value > world_size or world_size % value:
        raise ValueError(
            f"fully_shard: reshard_after_forward={value} must be a group size that divides the world size "
            f"{world_size} (1 < size < {world_size} reshards to groups of consecutive ranks); or pass True/False"
        )
    return ReshardAfterForward(value != 1, True, value if 1 < value < world_size else None)


DEFAULT_BUCKET_BYTES = 4 * 2**20
"""The runtime's default bucket size in bytes (``FSDPModule.set_bucket_bytes``, [Note: buckets]):
units whose collectives share a bucket move at most this many bytes per bucket. Here, below the
bindings, so that the estimator and the simulator take the same default. Chosen by measurement on
the 2-core CPU at W = 2 (benchmarks.small_units, 97 units of 1.6 MB in all): the step falls from
164 ms unit by unit to 130 / 49 / 33 / 31 / 32 ms with buckets of 64 KiB / 256 KiB / 1 / 4 /
8 MiB, while benchmarks.step's blocks of 7 MB (Llama 10.7M) step alike with 0 to 16 MiB; below a
few MiB a collective's cost is its latency on a GPU's NCCL too, and a bucket's memory (units
gathered ahead of their use) stays small."""


def check_bucket_bytes(value) -> int:
    """``value`` as a bucket size in bytes ([Note: buckets]); 0 turns buckets off.

    Raises:
        TypeError: not an int (a bool is refused too).
        ValueError: negative.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"bucket_bytes must be an int number of bytes (0: no buckets), got {type(value).__name__}")
    if value < 0:
        raise ValueError(f"bucket_bytes must be >= 0 (0: no buckets), got {value}")
    return value


@dataclass
class UnitSettings:
    """What a unit's owner decided about its step (FSDPModule's setters change them at any time).

    Attributes:
        reshard_after_forward: the resolved ``reshard_after_forward``.
        reshard_after_backward: free the unsharded parameters after backward.
        unshard_in_backward: the unit's backward needs its parameters.
        forward_prefetch / backward_prefetch: explicit prefetch targets (keys), replacing the
            policy's choice; None: implicit.
    """

    reshard_after_forward: ReshardAfterForward = field(default_factory=lambda: ReshardAfterForward(True, False))
    reshard_after_backward: bool = True
    unshard_in_backward: bool = True
    forward_prefetch: list | None = None
    backward_prefetch: list | None = None

    def set_reshard_after_forward(self, reshard: bool) -> None:
        """An explicit value from ``FSDPModule.set_reshard_after_forward``, followed exactly (the
        root's too, as FSDP2's setter); a post-forward group size it had is dropped."""
        self.reshard_after_forward = ReshardAfterForward(bool(reshard), True, None)


class StepExecutor(Protocol):
    """What a driver does when the protocol says so (on tensors, costs or bytes)."""

    def keys(self) -> Sequence[Key]:
        """Every unit under the root, in a fixed order."""

    def settings(self, key: Key) -> UnitSettings:
        """The unit's settings now."""

    def shard_state(self, key: Key) -> ShardState:
        """Where the unit's parameters are now."""

    def unshard(self, key: Key) -> None:
        """Issue the unit's all-gather (asynchronous; from the post-forward sharding if it has one)."""

    def wait_unshard(self, key: Key) -> None:
        """Wait for the unit's all-gather, issuing it if none is in flight; it is unsharded after."""

    def reshard(self, key: Key, to_secondary: bool = False) -> None:
        """Free the unit's unsharded parameters (keeping the post-forward slice with ``to_secondary``)."""

    def reduce(self, key: Key) -> None:
        """Issue the unit's gradient reduction, then finish the reductions issued before it."""

    def finish_reductions(self) -> None:
        """Finish every reduction in flight (their gradients are then in place)."""

    def is_stale(self, key: Key) -> bool:
        """Whether the unit holds gathered parameters older than its shard (start of a step)."""

    def skips_backward_unshard(self, key: Key) -> bool:
        """Whether the unit's backward runs without its parameters (backward all-gather elision)."""

    def prefetches_in_backward(self, key: Key) -> bool:
        """Whether backward prefetch should unshard the unit (it needs its parameters there)."""

    # Only with ``bucket_bytes`` > 0 (see [Note: buckets]):
    def all_gather_bucket(self, key: Key) -> "tuple[Hashable, int] | None":
        """``(class, bytes)`` of the unit's all-gather from its shard (the protocol asks only for
        sharded units) if it may share one with units of the same class (its gathered bytes),
        :data:`NOTHING` if it has nothing to gather, None if it must all-gather alone."""

    def unshard_together(self, keys: Sequence[Key]) -> None:
        """Issue one all-gather for the units ``keys`` (all sharded, of one class)."""

    def reduce_scatter_bucket(self, key: Key) -> "tuple[Hashable, int] | None":
        """``(class, bytes)`` of the unit's reduction if it may share a reduce-scatter (its
        reduce-scatter input's bytes), :data:`NOTHING` if it reduces nothing, None if it must
        reduce alone (or accumulates without gradient sync)."""

    def reduce_together(self, keys: Sequence[Key]) -> None:
        """Issue one reduction for the units ``keys`` (of one class), then finish the reductions
        issued before it."""


NOTHING = ("nothing", 0)
"""What :meth:`StepExecutor.all_gather_bucket` / :meth:`~StepExecutor.reduce_scatter_bucket` return
for a unit with nothing to gather / reduce: it neither joins nor ends a bucket."""


class StepProtocol:
    """The step of the units under one root (see the module docstring).

    Args:
        root: the root unit's key.
        executor: the driver.
        policy: the prefetch policy (default: implicit prefetch, at most 2 units ahead).
        log: record every action as ``(action, key)`` in :attr:`log` (for comparing drivers; a
            bucket's action is ``(action, (key, ...))``).
        bucket_bytes: the most bytes one bucket moves; 0: every unit has its own collectives (see
            [Note: buckets]).

    Attributes:
        order: the execution order, recorded every step.
        prefetched: units unsharded ahead of their use, not used yet.
        is_last_backward: ``set_is_last_backward``: the next backward ends the step's reductions.
        forward_with_grad: units whose forward ran with grad enabled in this step (their backward
            is expected).
    """

    def __init__(self, root: Key, executor: StepExecutor, policy: PrefetchPolicy | None = None,
                 log: bool = False, bucket_bytes: int = 0):
        self.root, self.x = root, executor
        self.policy = policy or PrefetchPolicy()
        self.order = ExecutionOrder()
        self.prefetched: set = set()
        self.bucket_bytes = check_bucket_bytes(bucket_bytes)
        self._leader: dict = {}  # a unit gathered in a bucket -> the bucket's first unit
        self._open: list = []  # the reductions waiting in the open bucket
        self._open_class = None
        self._open_bytes = 0
        self._reduced: set = set()  # the units whose reduction this backward took
        self.is_last_backward = True
        self.forward_with_grad: set = set()
        self.log: list[tuple[str, object]] | None = [] if log else None

    # ---------------------------------------------------------------- actions (logged)
    def _do(self, action: str, key: Key, fn: Callable, *args) -> None:
        if self.log is not None:
            self.log.append((action, key))
        fn(key, *args)

    def _unshard(self, key: Key, followers: Sequence[Key] | None = None) -> None:
        """Issue ``key``'s all-gather; with ``followers`` (an ordered list of the units that come
        after it in this phase) in one bucket with those that may join it ([Note: buckets])."""
        bucket = self._gather_bucket(key, followers) if followers is not None else [key]
        if len(bucket) == 1:
            self._do("unshard", key, self.x.unshard)
            return
        if self.log is not None:
            self.log.append(("unshard_together", tuple(bucket)))
        self.x.unshard_together(bucket)
        for other in bucket[1:]:
            self.prefetched.add(other)
            self._leader[other] = key

    def _gather_bucket(self, key: Key, followers: Sequence[Key]) -> list:
        """``key`` and the units of ``followers`` that share its all-gather ([Note: buckets])."""
        if not self.bucket_bytes or self.x.shard_state(key) is not ShardState.SHARDED:
            return [key]
        first = self.x.all_gather_bucket(key)
        if first is None or first == NOTHING or first[1] > self.bucket_bytes:
            return [key]
        cls, total = first
        bucket, seen = [key], {key}
        for other in followers:
            if other in seen:
                break
            seen.add(other)
            state = self.x.shard_state(other)
            if state in (ShardState.UNSHARDING, ShardState.UNSHARDED):
                continue
            if state is not ShardState.SHARDED:
                break
            info = self.x.all_gather_bucket(other)
            if info == NOTHING:
                continue
            if info is None or info[0] != cls or total + info[1] > self.bucket_bytes:
                break
            bucket.append(other)
            total += info[1]
        return bucket

    def _inflight(self) -> int:
        """All-gathers issued ahead of their use: the prefetched units, a bucket counting once."""
        if not self._leader:
            return len(self.prefetched)
        return len({self._leader.get(k, k) for k in self.prefetched})

    def _wait(self, key: Key) -> None:
        self._do("wait", key, self.x.wait_unshard)
        self._forget(key)

    def _forget(self, key: Key) -> None:
        self.prefetched.discard(key)
        self._leader.pop(key, None)

    def reshard(self, key: Key, to_secondary: bool = False) -> None:
        """Reshard ``key`` now (also for a driver's own reasons: an explicit ``reshard()``)."""
        self._do("reshard_secondary" if to_secondary else "reshard", key, self.x.reshard, to_secondary)
        self._forget(key)

    def _prefetch(self, targets: Sequence[Key], followers: Callable[[Key], Sequence[Key]] | None = None) -> None:
        candidates = [t for t in targets if self.x.shard_state(t) in (ShardState.SHARDED, ShardState.SECONDARY)]
        if not candidates:
            return
        for target in self.policy.admit(candidates, self._inflight()):
            self._unshard(target, followers(target) if followers is not None else None)
            self.prefetched.add(target)

    def _reduce(self, key: Key) -> None:
        self._do("reduce", key, self.x.reduce)

    def flush_reductions(self) -> None:
        """Issue the open bucket's reduction, if any ([Note: buckets])."""
        if not self._open:
            return
        keys, self._open, self._open_class, self._open_bytes = self._open, [], None, 0
        if len(keys) == 1:
            self._reduce(keys[0])
            return
        if self.log is not None:
            self.log.append(("reduce_together", tuple(keys)))
        self.x.reduce_together(keys)

    def finish_reductions(self) -> None:
        """Issue the open bucket's reduction, then finish every reduction in flight."""
        self.flush_reductions()
        if self.log is not None:
            self.log.append(("finish_reductions", None))
        self.x.finish_reductions()

    # ---------------------------------------------------------------- the unit's life
    def start_step(self, keys: Iterable[Key]) -> None:
        """The root's pre-forward, before its own: the last step's reductions finish, the order
        starts again, and units whose gathered parameters went stale (an optimizer step, a load)
        are resharded to be gathered again."""
        self.finish_reductions()
        self.order.start_step()
        self.forward_with_grad.clear()
        self._reduced.clear()
        for key in keys:
            if self.x.is_stale(key):
                self.reshard(key)

    def pre_forward(self, key: Key) -> None:
        """``key``'s forward starts: record it, wait for its parameters, prefetch."""
        self.order.record(key)
        if self.bucket_bytes and self.x.shard_state(key) is ShardState.SHARDED:
            self._unshard(key, self.order.forward_after(key))
        self._wait(key)
        explicit = self.x.settings(key).forward_prefetch
        self._prefetch(self.policy.forward_targets(key, self.order, explicit),
                       self.order.forward_after if explicit is None and self.bucket_bytes else None)

    def post_forward(self, key: Key, backward_follows: bool = True) -> None:
        """``key``'s forward ended (see the module docstring for what reshards)."""
        self.order.record_post_forward(key)
        if backward_follows:
            self.forward_with_grad.add(key)
        if not backward_follows:
            setting = self.x.settings(key).reshard_after_forward
            if setting.reshard:  # FSDP2: reshard_after_forward=False keeps the unit gathered here too
                self.reshard(key)
            if key == self.root:  # a unit prefetched in this forward that never ran (a branch not taken)
                for other in list(self.prefetched):
                    self.reshard(other)
            return
        setting = self.x.settings(key).reshard_after_forward
        if not setting.reshard:
            return
        if not setting.explicit and (key == self.root or self.policy.keep_for_backward(key, self.order)):
            return
        self.reshard(key, to_secondary=True)

    def pre_backward(self, key: Key) -> None:
        """``key``'s backward starts: record it, wait for its parameters if it needs them, prefetch
        the backward targets that need theirs."""
        self.order.record_pre_backward(key)
        if self.x.settings(key).unshard_in_backward and not self.x.skips_backward_unshard(key):
            if self.bucket_bytes and self.x.shard_state(key) is ShardState.SHARDED:
                self._unshard(key, self._backward_followers(key))
            self._wait(key)
        explicit = self.x.settings(key).backward_prefetch
        targets = self.policy.backward_targets(key, self.order, explicit)
        self._prefetch([t for t in targets if self.x.prefetches_in_backward(t)],
                       self._backward_followers if explicit is None and self.bucket_bytes else None)

    def _backward_followers(self, key: Key) -> list:
        """The units whose backward comes after ``key``'s and needs their parameters, in order."""
        return [k for k in self.order.backward_after(key)
                if self.x.settings(k).unshard_in_backward and self.x.prefetches_in_backward(k)]

    def gradients_ready(self, key: Key) -> None:
        """Every gradient of ``key`` this backward computes is there: reduce them (in the open
        bucket, see [Note: buckets])."""
        self._reduced.add(key)
        info = self.x.reduce_scatter_bucket(key) if self.bucket_bytes else None
        if info == NOTHING:
            return
        if info is None or info[1] > self.bucket_bytes:
            self.flush_reductions()
            self._reduce(key)
            return
        cls, nbytes = info
        if self._open and (cls != self._open_class or self._open_bytes + nbytes > self.bucket_bytes):
            self.flush_reductions()
        self._open.append(key)
        self._open_class = cls
        self._open_bytes += nbytes
        if not self._next_fits(key):
            self.flush_reductions()

    def _next_fits(self, key: Key) -> bool:
        """Whether the unit expected to reduce after ``key`` would join the open bucket; True where
        no unit is expected (the end of the backward's known order: the root's reduction, the
        last backward's, may still come; the end of the backward issues the bucket)."""
        for other in self.order.backward_after(key):
            if other in self._reduced:
                continue
            info = self.x.reduce_scatter_bucket(other)
            if info == NOTHING:
                continue
            return (info is not None and info[0] == self._open_class
                    and self._open_bytes + info[1] <= self.bucket_bytes)
        return True

    def backward_done(self, key: Key) -> None:
        """``key``'s backward is over: reshard it unless told to keep its parameters."""
        if self.x.settings(key).reshard_after_backward:
            self.reshard(key)

    def end_backward(self, unreduced: Sequence[Key], undone: Sequence[Key], holding: Callable[[Key], bool]) -> bool:
        """The end of a backward (the autograd engine's final callback).

        Args:
            unreduced: units whose backward started, or that hold gradients, without their
                gradients having been reduced since: they reduce now.
            undone: units whose backward started and did not end: they end now (reshard unless
                told to keep their parameters).
            holding: whether a unit still holds parameters it should free at the end of a
                backward (a post-forward slice; unsharded parameters while resharding after
                backward), asked once the others ended.

        Returns:
            Whether this was the step's last backward (the reductions are then finished and the
            driver waits for the reduction stream).
        """
        for key in unreduced:
            self.gradients_ready(key)
        self.flush_reductions()
        self._reduced.clear()
        for key in undone:
            self.backward_done(key)
        for key in [k for k in self.x.keys() if holding(k)]:
            self.reshard(key)
        if not self.is_last_backward:
            # set_is_last_backward(False): the reductions finish at the next root forward, and a
            # unit prefetched for a backward that did not need it stays for the next backward.
            return False
        for key in list(self.prefetched):
            self.reshard(key)
        self.finish_reductions()
        return True
