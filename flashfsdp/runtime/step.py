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
``post_forward(u, bwd)``  no backward follows (grad off): reshard u, and the root reshards every unit
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


class StepProtocol:
    """The step of the units under one root (see the module docstring).

    Args:
        root: the root unit's key.
        executor: the driver.
        policy: the prefetch policy (default: implicit prefetch, at most 2 units ahead).
        log: record every action as ``(action, key)`` in :attr:`log` (for comparing drivers).

    Attributes:
        order: the execution order, recorded every step.
        prefetched: units unsharded ahead of their use, not used yet.
        is_last_backward: ``set_is_last_backward``: the next backward ends the step's reductions.
        forward_with_grad: units whose forward ran with grad enabled in this step (their backward
            is expected).
    """

    def __init__(self, root: Key, executor: StepExecutor, policy: PrefetchPolicy | None = None,
                 log: bool = False):
        self.root, self.x = root, executor
        self.policy = policy or PrefetchPolicy()
        self.order = ExecutionOrder()
        self.prefetched: set = set()
        self.is_last_backward = True
        self.forward_with_grad: set = set()
        self.log: list[tuple[str, object]] | None = [] if log else None

    # ---------------------------------------------------------------- actions (logged)
    def _do(self, action: str, key: Key, fn: Callable, *args) -> None:
        if self.log is not None:
            self.log.append((action, key))
        fn(key, *args)

    def _unshard(self, key: Key) -> None:
        self._do("unshard", key, self.x.unshard)

    def _wait(self, key: Key) -> None:
        self._do("wait", key, self.x.wait_unshard)
        self.prefetched.discard(key)

    def reshard(self, key: Key, to_secondary: bool = False) -> None:
        """Reshard ``key`` now (also for a driver's own reasons: an explicit ``reshard()``)."""
        self._do("reshard_secondary" if to_secondary else "reshard", key, self.x.reshard, to_secondary)
        self.prefetched.discard(key)

    def _prefetch(self, targets: Sequence[Key]) -> None:
        candidates = [t for t in targets if self.x.shard_state(t) in (ShardState.SHARDED, ShardState.SECONDARY)]
        for target in self.policy.admit(candidates, len(self.prefetched)):
            self._unshard(target)
            self.prefetched.add(target)

    def _reduce(self, key: Key) -> None:
        self._do("reduce", key, self.x.reduce)

    def finish_reductions(self) -> None:
        """Finish every reduction in flight."""
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
        for key in keys:
            if self.x.is_stale(key):
                self.reshard(key)

    def pre_forward(self, key: Key) -> None:
        """``key``'s forward starts: record it, wait for its parameters, prefetch."""
        self.order.record(key)
        self._wait(key)
        explicit = self.x.settings(key).forward_prefetch
        self._prefetch(self.policy.forward_targets(key, self.order, explicit))

    def post_forward(self, key: Key, backward_follows: bool = True) -> None:
        """``key``'s forward ended (see the module docstring for what reshards)."""
        self.order.record_post_forward(key)
        if backward_follows:
            self.forward_with_grad.add(key)
        if not backward_follows:
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
            self._wait(key)
        explicit = self.x.settings(key).backward_prefetch
        targets = self.policy.backward_targets(key, self.order, explicit)
        self._prefetch([t for t in targets if self.x.prefetches_in_backward(t)])

    def gradients_ready(self, key: Key) -> None:
        """Every gradient of ``key`` this backward computes is there: reduce them."""
        self._reduce(key)

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
