"""What one rank holds at every point of a training step: the runtime's step walked through without
tensors, through the runtime's own prefetch policy (``runtime/schedule.py``).

The walk follows ``bindings/state.py`` and ``bindings/root.py`` for a model whose units run their
forward once each, in order, inside the root's forward (a Llama: embedding, blocks, head):

1. root pre-forward: ``order.start_step()``; each unit's pre-forward records it, waits for its own
   all-gather (issuing it if no prefetch did) and prefetches ``policy.forward_targets`` as
   ``policy.admit`` allows (at most ``max_inflight`` prefetched units).
2. post-forward: reshard if the unit's ``reshard_after_forward`` says so — to its 1/k slice for an
   int k — unless the value was not given and ``policy.keep_for_backward`` keeps it (the last
   block), or it is the root with no explicit value.
3. backward, root first then the blocks in reverse: pre-backward waits for the unit's parameters
   and prefetches ``policy.backward_targets``; its unsharded gradients (``param_dtype``) live until
   its post-backward packs them; the pack and the reduced shard live until the next unit's
   reduction finishes the earlier ones (``RootContext.finish_pending``); then the unit reshards.
   The root's post-backward comes last (its embedding's gradient is the last one computed).
4. the final callback reshards unused prefetches and finishes the reductions.

The first step records the order (no forward prefetch, nothing kept for backward); the second is
the steady state, whose peaks and all-gathers are reported. Activations are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashfsdp.runtime.schedule import ExecutionOrder, PrefetchPolicy

from .units import UnitSpec


@dataclass(frozen=True)
class ReshardSetting:
    """One unit's resolved ``reshard_after_forward`` (see ``bindings/_init.py``).

    Attributes:
        reshard: free the unsharded parameters after forward.
        explicit: the value was given (None: the root keeps its parameters, and so does the
            unit the schedule keeps for backward).
        post_forward_size: k when resharding to groups of k ranks (1 < k < W), else None.
    """

    reshard: bool
    explicit: bool
    post_forward_size: int | None


@dataclass
class StepHoldings:
    """Peaks (bytes) and all-gathers of the steady-state step on one rank.

    Attributes:
        params_peak: most bytes of unsharded parameters and post-forward slices alive at once.
        units_at_peak: the units holding unsharded parameters at that moment.
        transient_peak: most bytes alive at once of everything the step allocates (unsharded
            parameters, post-forward slices, unsharded gradients, reduction buffers).
        grads_peak: most bytes of unsharded gradients alive at once.
        buffers_peak: most bytes of reduction buffers (packs and reduced shards) alive at once.
        all_gathers: (unit name, phase "forward"/"backward", group size) of each all-gather.
    """

    params_peak: int = 0
    units_at_peak: tuple[str, ...] = ()
    transient_peak: int = 0
    grads_peak: int = 0
    buffers_peak: int = 0
    all_gathers: list[tuple[str, str, int]] = field(default_factory=list)


class StepWalk:
    """The runtime's step over unit specs (see the module docstring).

    Args:
        units: the root first, then the others in forward order.
        settings: the resolved ``reshard_after_forward`` of each unit, by name.
        world_size: the ranks a unit is sharded over (its all-gather group).
        max_inflight: the prefetch limit (``set_max_inflight_all_gathers``).
    """

    def __init__(self, units: list[UnitSpec], settings: dict[str, ReshardSetting], world_size: int,
                 max_inflight: int):
        self.units = {u.name: u for u in units}
        self.root = units[0].name
        self.settings, self.world_size = settings, world_size
        self.policy = PrefetchPolicy(max_inflight=max_inflight)
        self.order = ExecutionOrder()
        self.state = {name: "sharded" for name in self.units}  # sharded | unsharded
        self.slices: set[str] = set()  # units holding their post-forward 1/k slice (kept while regathered)
        self.prefetched: set[str] = set()
        self.grads: set[str] = set()  # units whose unsharded gradients are alive
        self.pending: list[str] = []  # units whose reduction buffers are alive
        self.result = StepHoldings()
        self.phase = "forward"

    # ---------------------------------------------------------------- holdings
    def _note(self, landing: str | None = None) -> None:
        """Record the holdings now; ``landing``: a unit whose all-gather lands now (its gathered
        buffer alive until copy-out, as the prefetched units' are)."""
        res, units = self.result, self.units
        unsharded = [n for n, s in self.state.items() if s == "unsharded"]
        in_flight = set(self.prefetched) | ({landing} if landing else set())
        params = sum(units[n].unsharded_bytes() for n in unsharded) + sum(
            units[n].secondary_bytes(self.settings[n].post_forward_size) for n in self.slices) + sum(
            units[n].gathered_bytes() for n in in_flight)
        grads = sum(units[n].unsharded_grad_bytes() for n in self.grads)
        buffers = sum(units[n].reduce_buffer_bytes() for n in self.pending)
        if params > res.params_peak:
            res.params_peak, res.units_at_peak = params, tuple(unsharded)
        res.grads_peak = max(res.grads_peak, grads)
        res.buffers_peak = max(res.buffers_peak, buffers)
        res.transient_peak = max(res.transient_peak, params + grads + buffers)

    # ---------------------------------------------------------------- the runtime's transitions
    def unshard(self, name: str) -> None:
        """Issue the unit's all-gather unless it is unsharded (from its slice: over k ranks)."""
        if self.state[name] == "unsharded":
            return
        k = self.settings[name].post_forward_size if name in self.slices else None
        self.result.all_gathers.append((name, self.phase, k or self.world_size))
        self.state[name] = "unsharded"
        self._note(landing=name)

    def reshard(self, name: str, to_secondary: bool = False) -> None:
        """Free the unsharded parameters (keeping the 1/k slice with ``to_secondary``; a slice
        stays alive while its unit is gathered again, until a reshard that does not keep it)."""
        keep = to_secondary and self.settings[name].post_forward_size and self.state[name] == "unsharded"
        if keep:
            self.slices.add(name)
        elif not (to_secondary and self.state[name] == "sharded"):
            self.slices.discard(name)
        self.state[name] = "sharded"
        self.prefetched.discard(name)

    def _wait_and_prefetch(self, name: str, targets: list) -> None:
        self.unshard(name)
        self.prefetched.discard(name)
        candidates = [t for t in targets if self.state[t] != "unsharded"]
        for target in self.policy.admit(candidates, len(self.prefetched)):
            self.unshard(target)
            self.prefetched.add(target)

    def pre_forward(self, name: str) -> None:
        self.order.record(name)
        self._wait_and_prefetch(name, self.policy.forward_targets(name, self.order))

    def post_forward(self, name: str) -> None:
        self.order.record_post_forward(name)
        setting = self.settings[name]
        keep = not setting.explicit and (name == self.root or self.policy.keep_for_backward(name, self.order))
        if setting.reshard and not keep:
            self.reshard(name, to_secondary=True)

    def pre_backward(self, name: str) -> None:
        self.order.record_pre_backward(name)
        self._wait_and_prefetch(name, self.policy.backward_targets(name, self.order))
        self.grads.add(name)
        self._note()

    def post_backward(self, name: str) -> None:
        """Pack and reduce-scatter (buffers alive), finish the earlier reductions, reshard."""
        self.pending.append(name)
        self._note()  # the gradients are released once packed, the earlier buffers once finished
        self.grads.discard(name)
        self.pending = [name]
        self.reshard(name)

    def step(self) -> None:
        """One training step (see the module docstring)."""
        self.order.start_step()
        self.phase = "forward"
        blocks = [n for n in self.units if n != self.root]
        self.pre_forward(self.root)
        for name in blocks:
            self.pre_forward(name)
            self.post_forward(name)
        self.post_forward(self.root)
        self.phase = "backward"
        self.pre_backward(self.root)
        for name in reversed(blocks):
            self.pre_backward(name)
            self.post_backward(name)
        self.post_backward(self.root)
        for name in list(self.prefetched):
            self.reshard(name)
        self.pending = []
        for name in self.units:  # the end of backward drops the slices; the next step regathers
            self.reshard(name)  # whatever an optimizer step made stale


def walk_steady_step(units: list[UnitSpec], settings: dict[str, ReshardSetting], world_size: int,
                     max_inflight: int) -> StepHoldings:
    """Walk two steps (the first records the execution order); the second one's holdings."""
    walk = StepWalk(units, settings, world_size, max_inflight)
    walk.step()
    walk.result = StepHoldings()
    walk.step()
    return walk.result
