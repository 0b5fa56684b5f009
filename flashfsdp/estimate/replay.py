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

With ``bucket_bytes`` > 0 (the runtime's default, ``runtime/step.py``'s [Note: buckets]) small
units that run back to back share collectives, as ``runtime/bucket.py`` runs them: the units of
one all-gather are unsharded together at its issue (so some parameters are held earlier than
unit by unit: the peak may grow), and the bucket's gathered buffer per ``param_dtype`` (the
units' gathered layouts side by side, not the unsharded buffers themselves; none on one rank,
where zero-copy layouts are cast into place and nothing is gathered) is alive from the issue to
the copy-out at the first wait of any of its units; the units of one
reduction keep their unsharded gradients until the bucket is packed, and the bucket's buffers
are its units' together. Which units may share follows the runtime's ``all_gather_class`` /
``reduce_class`` on the unit specs: one class per step (one communicator, one device), except
that int8 all-gathers, post-forward regathers and ``Shard(k)`` parameters all-gather alone, and
units reducing in several dtypes or with ``Shard(k)`` parameters reduce alone; reductions of
different dtypes do not share.

The collectives are counted as the runtime issues them: a unit alone one all-gather per flat
group and one reduce-scatter per trainable group; a bucket one all-gather per ``param_dtype``
among its groups (none on one rank, see above) and one reduce-scatter (:class:`StepHoldings`).

The first step records the order (no forward prefetch, nothing kept for backward); the second is
the steady state, whose peaks and collectives are reported. Activations are not modelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from flashfsdp.runtime.schedule import PrefetchPolicy
from flashfsdp.runtime.states import ShardState
from flashfsdp.runtime.step import NOTHING, ReshardAfterForward, StepProtocol, UnitSettings

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
        all_gathers: (unit name, phase "forward"/"backward", group size) of each unit's
            all-gather (a unit gathered in a bucket has its entry too).
        all_gather_collectives: the all-gather collectives of the step (a unit alone: one per
            flat group; a bucket: one per ``param_dtype`` among its groups).
        reduce_scatter_collectives: the reduce-scatter collectives of the step (a unit alone:
            one per trainable group; a bucket: one).
    """

    params_peak: int = 0
    units_at_peak: tuple[str, ...] = ()
    transient_peak: int = 0
    grads_peak: int = 0
    buffers_peak: int = 0
    all_gathers: list[tuple[str, str, int]] = field(default_factory=list)
    all_gather_collectives: int = 0
    reduce_scatter_collectives: int = 0


class StepWalk:
    """The runtime's step over unit specs (see the module docstring): the step protocol's executor.

    Args:
        units: the root first, then the others in forward order.
        settings: the resolved ``reshard_after_forward`` of each unit, by name.
        world_size: the ranks a unit is sharded over (its all-gather group).
        max_inflight: the prefetch limit (``set_max_inflight_all_gathers``).
        log: record the protocol's actions (``self.step.log``).
        bucket_bytes: the protocol's bucket size in bytes (0: no buckets; see the module docstring).
        all_gather_dtype: ``MixedPrecisionPolicy.all_gather_dtype`` (``torch.int8``: every unit
            all-gathers alone, as the runtime's do).
    """

    def __init__(self, units: list[UnitSpec], settings: dict[str, ReshardAfterForward], world_size: int,
                 max_inflight: int, log: bool = False, bucket_bytes: int = 0,
                 all_gather_dtype: torch.dtype | None = None):
        self.units = {u.name: u for u in units}
        self.root = units[0].name
        self.world_size = world_size
        self.all_gather_dtype = all_gather_dtype
        self._settings = {name: UnitSettings(settings[name]) for name in self.units}
        self.step = StepProtocol(self.root, self, PrefetchPolicy(max_inflight=max_inflight), log=log,
                                 bucket_bytes=bucket_bytes)
        self.state = {name: ShardState.SHARDED for name in self.units}
        self.slices: set[str] = set()  # units holding their post-forward 1/k slice (kept while regathered)
        self.grads: set[str] = set()  # units whose unsharded gradients are alive
        self.pending: list[str] = []  # units whose reduction buffers are alive
        self.in_bucket: dict[str, tuple[str, ...]] = {}  # a unit of a bucket not copied out yet -> the bucket
        self.result = StepHoldings()
        self.phase = "forward"

    # ---------------------------------------------------------------- holdings
    def _note(self, landing: str | None = None) -> None:
        """Record the holdings now; ``landing``: a unit whose all-gather lands now (its gathered
        buffer alive until copy-out, as the prefetched units' are)."""
        res, units = self.result, self.units
        unsharded = [n for n, s in self.state.items() if s is ShardState.UNSHARDED]
        in_flight = (set(self.step.prefetched) | ({landing} if landing else set())) - set(self.in_bucket)
        buckets = set(self.in_bucket.values())  # a bucket's gathered buffers: its units' gathered layouts
        params = sum(units[n].unsharded_bytes() for n in unsharded) + sum(
            units[n].secondary_bytes(self._settings[n].reshard_after_forward.post_forward_size) for n in self.slices) + sum(
            units[n].gathered_bytes() for n in in_flight) + sum(
            nbytes for bucket in buckets for nbytes, gathers in self._bucket_parts(bucket) if gathers)
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
        self.result.all_gather_collectives += len(self.units[name].groups)
        self.state[name] = ShardState.UNSHARDED
        self._note(landing=name)

    def unshard_together(self, names) -> None:
        """Issue one all-gather for the units ``names`` (sharded): all unsharded now, the bucket's
        gathered buffer alive until the first of them is waited for."""
        bucket = tuple(names)
        for name in bucket:
            self.result.all_gathers.append((name, self.phase, self.world_size))
            self.state[name] = ShardState.UNSHARDED
            self.in_bucket[name] = bucket
        self.result.all_gather_collectives += sum(1 for _, gathers in self._bucket_parts(bucket) if gathers)
        self._note()

    def _bucket_parts(self, bucket: tuple[str, ...]) -> list[tuple[int, bool]]:
        """Per ``param_dtype`` among the bucket's groups (``runtime/bucket.py``'s
        ``GatherBucket``): the bytes of its gathered buffer and whether it all-gathers — not on
        one rank where every group's gathered layout is its unsharded one (the copy-in then casts
        each shard straight into its unsharded buffer)."""
        parts: dict = {}
        for name in bucket:
            for g in self.units[name].groups:
                parts.setdefault(_dtype_key(g), []).append(g)
        return [(sum(g.layout.gathered_size * g.param_bytes for g in groups),
                 not (self.world_size == 1 and all(g.layout.zero_copy for g in groups))) for groups in parts.values()]

    def _copy_out(self, name: str) -> None:
        """A wait (or a reshard, which waits first) of a unit of a bucket in flight: the bucket is
        copied out and its gathered buffers freed."""
        for other in self.in_bucket.get(name, ()):
            del self.in_bucket[other]

    def wait_unshard(self, name: str) -> None:
        if name in self.in_bucket:
            self._copy_out(name)
            return
        self.unshard(name)

    def reshard(self, name: str, to_secondary: bool = False) -> None:
        """Free the unsharded parameters (keeping the 1/k slice with ``to_secondary``; a slice
        stays alive while its unit is gathered again, until a reshard that does not keep it)."""
        self._copy_out(name)
        setting = self._settings[name].reshard_after_forward
        keep = to_secondary and setting.post_forward_size and self.state[name] is ShardState.UNSHARDED
        if keep:
            self.slices.add(name)
        elif not (to_secondary and self.state[name] is ShardState.SHARDED):
            self.slices.discard(name)
        self.state[name] = ShardState.SHARDED

    def reduce(self, name: str) -> None:
        """Pack and reduce-scatter (buffers alive), then finish the earlier reductions."""
        self.reduce_together([name])

    def reduce_together(self, names) -> None:
        """Pack the units' gradients into one reduction (a unit alone: one reduce-scatter per
        trainable group; a bucket: one), buffers alive; then finish the earlier reductions."""
        names = list(names)
        self.pending += names
        self._note()  # the gradients are released once packed, the earlier buffers once finished
        self.grads.difference_update(names)
        self.pending = names
        trainable = sum(1 for g in self.units[names[0]].groups if g.trainable)
        self.result.reduce_scatter_collectives += trainable if len(names) == 1 else 1

    def finish_reductions(self) -> None:
        self.pending = []

    def is_stale(self, name: str) -> bool:
        """Between steps an optimizer step wrote every shard: whatever is still gathered is stale."""
        return self.state[name] is not ShardState.SHARDED or name in self.slices

    def skips_backward_unshard(self, name: str) -> bool:
        return False

    def prefetches_in_backward(self, name: str) -> bool:
        return True

    def all_gather_bucket(self, name: str):
        """The runtime's ``bucket.all_gather_class`` on the unit spec: ``(class, gathered bytes)``,
        :data:`NOTHING` without parameters, None (alone) for int8 all-gathers or ``Shard(k)``
        parameters (the protocol asks only for sharded units: a regather from the post-forward
        slice goes alone)."""
        unit = self.units[name]
        if not unit.groups:
            return NOTHING
        if self.all_gather_dtype is not None or any(g.layout.strided for g in unit.groups):
            return None
        return "all_gather", _gathered_layout_bytes(unit)

    def reduce_scatter_bucket(self, name: str):
        """The runtime's ``bucket.reduce_class`` on the unit spec: ``(reduce dtype, reduce-scatter
        input bytes)``, :data:`NOTHING` without trainable groups, None (alone) for several reduce
        dtypes or ``Shard(k)`` parameters."""
        unit = self.units[name]
        dtypes = {g.reduce_dtype or g.reduce_bytes for g in unit.groups if g.trainable}
        if not dtypes:
            return NOTHING
        if len(dtypes) != 1 or any(g.layout.strided for g in unit.groups):
            return None
        return ("reduce_scatter", dtypes.pop()), unit.reduce_scatter_bytes()

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
        # the root's gradients are ready last; then the final callback (the runtime's
        # RootContext.end_backward) issues the open bucket and reshards what should be
        step.gradients_ready(self.root)
        step.backward_done(self.root)
        step.flush_reductions()
        step.end_backward([], [], lambda name: name in self.slices)


def _gathered_layout_bytes(unit: UnitSpec) -> int:
    """Bytes of the unit's gathered layouts in ``param_dtype`` (what it adds to a bucket's
    all-gather and to its gathered buffer)."""
    return sum(g.layout.gathered_size * g.param_bytes for g in unit.groups)


def _dtype_key(group) -> object:
    """The ``param_dtype`` of a group (its bytes per element where the spec has no dtype): a
    bucket all-gathers once per ``param_dtype``."""
    return group.param_dtype or group.param_bytes


def walk_steady_step(units: list[UnitSpec], settings: dict[str, ReshardAfterForward], world_size: int,
                     max_inflight: int, bucket_bytes: int = 0,
                     all_gather_dtype: torch.dtype | None = None) -> StepHoldings:
    """Walk two steps (the first records the execution order); the second one's holdings
    (``bucket_bytes``, ``all_gather_dtype``: see :class:`StepWalk`)."""
    walk = StepWalk(units, settings, world_size, max_inflight, bucket_bytes=bucket_bytes,
                    all_gather_dtype=all_gather_dtype)
    walk.run_step()
    walk.result = StepHoldings()
    walk.run_step()
    return walk.result
