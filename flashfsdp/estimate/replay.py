"""What one rank holds at every point of a training step: the runtime's own step protocol
(``runtime/step.py``) driven without tensors, on bytes.

:class:`StepWalk` is the protocol's executor for a model whose units run their forward once each,
in order, inside the root's forward (a Llama: embedding, blocks, head): it tells the protocol when
each unit's forward and backward start and end, and the protocol decides — as it does for the
runtime — which all-gather, prefetch, reshard (to the post-forward slice for an int
``reshard_after_forward``) and reduction happen. The walk counts the bytes: a unit's unsharded
parameters while it is unsharded, its gathered buffer from its all-gather's issue to its
copy-out (while it is prefetched, or at its wait), its post-forward slice, its unsharded
gradients (``param_dtype``) from its pre-backward until its reduction packs them, and the
reduction's buffers until the next unit's reduction finishes the earlier ones.

The first step records the order (no forward prefetch, nothing kept for backward); the second is
the steady state, whose peaks and all-gathers are reported. Activations are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from flashfsdp.runtime.schedule import PrefetchPolicy
from flashfsdp.runtime.states import ShardState
from flashfsdp.runtime.step import ReshardAfterForward, StepProtocol, UnitSettings

from .units import UnitSpec


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
    """The runtime's step over unit specs (see the module docstring): the step protocol's executor.

    Args:
        units: the root first, then the others in forward order.
        settings: the resolved ``reshard_after_forward`` of each unit, by name.
        world_size: the ranks a unit is sharded over (its all-gather group).
        max_inflight: the prefetch limit (``set_max_inflight_all_gathers``).
        log: record the protocol's actions (``self.step.log``).
    """

    def __init__(self, units: list[UnitSpec], settings: dict[str, ReshardAfterForward], world_size: int,
                 max_inflight: int, log: bool = False):
        self.units = {u.name: u for u in units}
        self.root = units[0].name
        self.world_size = world_size
        self._settings = {name: UnitSettings(settings[name]) for name in self.units}
        self.step = StepProtocol(self.root, self, PrefetchPolicy(max_inflight=max_inflight), log=log)
        self.state = {name: ShardState.SHARDED for name in self.units}
        self.slices: set[str] = set()  # units holding their post-forward 1/k slice (kept while regathered)
        self.grads: set[str] = set()  # units whose unsharded gradients are alive
        self.pending: list[str] = []  # units whose reduction buffers are alive
        self.result = StepHoldings()
        self.phase = "forward"

    # ---------------------------------------------------------------- holdings
    def _note(self, landing: str | None = None) -> None:
        """Record the holdings now; ``landing``: a unit whose all-gather lands now (its gathered
        buffer alive until copy-out, as the prefetched units' are)."""
        res, units = self.result, self.units
        unsharded = [n for n, s in self.state.items() if s is ShardState.UNSHARDED]
        in_flight = set(self.step.prefetched) | ({landing} if landing else set())
        params = sum(units[n].unsharded_bytes() for n in unsharded) + sum(
            units[n].secondary_bytes(self._settings[n].reshard_after_forward.post_forward_size) for n in self.slices) + sum(
            units[n].gathered_bytes() for n in in_flight)
        grads = sum(units[n].unsharded_grad_bytes() for n in self.grads)
        buffers = sum(units[n].reduce_buffer_bytes() for n in self.pending)
        if params > res.params_peak:
            res.params_peak, res.units_at_peak = params, tuple(unsharded)
        res.grads_peak = max(res.grads_peak, grads)
        res.buffers_peak = max(res.buffers_peak, buffers)
        res.transient_peak = max(res.transient_peak, params + grads + buffers)

    # ---------------------------------------------------------------- StepExecutor
    def keys(self) -> list[str]:
        return list(self.units)

    def settings(self, name: str) -> UnitSettings:
        return self._settings[name]

    def shard_state(self, name: str) -> ShardState:
        return ShardState.SECONDARY if self.state[name] is ShardState.SHARDED and name in self.slices else self.state[name]

    def unshard(self, name: str) -> None:
        """Issue the unit's all-gather unless it is unsharded (from its slice: over k ranks)."""
        if self.state[name] is ShardState.UNSHARDED:
            return
        k = self._settings[name].reshard_after_forward.post_forward_size if name in self.slices else None
        self.result.all_gathers.append((name, self.phase, k or self.world_size))
        self.state[name] = ShardState.UNSHARDED
        self._note(landing=name)

    def wait_unshard(self, name: str) -> None:
        self.unshard(name)

    def reshard(self, name: str, to_secondary: bool = False) -> None:
        """Free the unsharded parameters (keeping the 1/k slice with ``to_secondary``; a slice
        stays alive while its unit is gathered again, until a reshard that does not keep it)."""
        setting = self._settings[name].reshard_after_forward
        keep = to_secondary and setting.post_forward_size and self.state[name] is ShardState.UNSHARDED
        if keep:
            self.slices.add(name)
        elif not (to_secondary and self.state[name] is ShardState.SHARDED):
            self.slices.discard(name)
        self.state[name] = ShardState.SHARDED

    def reduce(self, name: str) -> None:
        """Pack and reduce-scatter (buffers alive), then finish the earlier reductions."""
        self.pending.append(name)
        self._note()  # the gradients are released once packed, the earlier buffers once finished
        self.grads.discard(name)
        self.pending = [name]

    def finish_reductions(self) -> None:
        self.pending = []

    def is_stale(self, name: str) -> bool:
        """Between steps an optimizer step wrote every shard: whatever is still gathered is stale."""
        return self.state[name] is not ShardState.SHARDED or name in self.slices

    def skips_backward_unshard(self, name: str) -> bool:
        return False

    def prefetches_in_backward(self, name: str) -> bool:
        return True

    # ---------------------------------------------------------------- one step
    def _backward(self, name: str, last: bool = True) -> None:
        self.step.pre_backward(name)
        self.grads.add(name)
        self._note()
        if last:
            self.step.gradients_ready(name)
            self.step.backward_done(name)

    def run_step(self) -> None:
        """One training step (see the module docstring)."""
        step = self.step
        self.phase = "forward"
        step.start_step(self.keys())
        blocks = [n for n in self.units if n != self.root]
        step.pre_forward(self.root)
        for name in blocks:
            step.pre_forward(name)
            step.post_forward(name)
        step.post_forward(self.root)
        self.phase = "backward"
        self._backward(self.root, last=False)  # the root's gradients come last (its embedding's)
        for name in reversed(blocks):
            self._backward(name)
        step.gradients_ready(self.root)
        step.backward_done(self.root)
        step.end_backward([], [], lambda name: name in self.slices)


def walk_steady_step(units: list[UnitSpec], settings: dict[str, ReshardAfterForward], world_size: int,
                     max_inflight: int) -> StepHoldings:
    """Walk two steps (the first records the execution order); the second one's holdings."""
    walk = StepWalk(units, settings, world_size, max_inflight)
    walk.run_step()
    walk.result = StepHoldings()
    walk.run_step()
    return walk.result
