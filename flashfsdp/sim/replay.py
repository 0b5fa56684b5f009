"""The replay of the runtime's step on the simulator's event engine.

:class:`StepReplay` is an executor of the runtime's own step protocol
(:class:`~flashfsdp.runtime.step.StepProtocol`, which ``flashfsdp.bindings`` runs on tensors): it
tells the protocol when each unit's forward and backward start and end, and the protocol decides
— through the same :class:`~flashfsdp.runtime.schedule.ExecutionOrder` and
:class:`~flashfsdp.runtime.schedule.PrefetchPolicy` — which all-gather, wait, prefetch, reshard and
reduction happen, which the replay runs in the runtime's state machines
(:class:`~flashfsdp.runtime.states.ShardState`, :class:`~flashfsdp.runtime.states.TrainingState`)
on the three streams of :mod:`flashfsdp.sim.engine`:

- **compute** — the units' forward and backward compute (and, on a CPU host, everything the one
  Python thread does: copy-in, waits).
- **all-gather** — copy-in (optionally) and the all-gathers, first in first out.
- **reduce-scatter** — the reduce-scatters, first in first out.

``shared_comm_stream=True`` puts both collectives on one FIFO (gloo on CPU: one worker runs every
collective in issue order).

[Note: the step the simulator replays]
Per step, the protocol's decisions (``runtime/step.py``) at the points ``FSDPState`` calls it
(``_pre_forward``, ``_post_forward``, ``_pre_backward``, the post-backward gate, the final callback):

1. root pre-forward: finish pending reductions; ``order.start_step()``; ``order.record(root)``;
   wait for the root's all-gather (issuing it if no prefetch did); prefetch
   ``policy.forward_targets(root)`` (candidates still sharded, ``policy.admit`` against the number
   prefetched); the root's forward compute before its first block.
2. every block, in order: ``order.record``; wait own all-gather; prefetch forward targets; forward
   compute; reshard (if ``reshard_after_forward`` and not ``policy.keep_for_backward``: the last
   block keeps its parameters for the backward; the root never reshards after forward).
3. the rest of the root's forward; the loss (``Model.loss_s``).
4. root pre-backward: wait own all-gather (still unsharded), prefetch
   ``policy.backward_targets(root)``; the root's backward compute before the blocks'.
5. every block, in reverse: pre-backward waits own all-gather and prefetches backward targets;
   backward compute; post-backward packs the gradients and frees them, issues the reduce-scatter (on
   a GPU after the compute stream waited for the previous one to end, see [Note: waiting on the
   previous reduce-scatter]), then finishes the reductions issued before it
   (on a CPU host, ``host_blocking=True``, that blocks the thread on them; on a GPU it only orders
   the reduce-scatter stream), then reshards.
6. the rest of the root's backward, then its post-backward (its gradients, the embedding's, are
   ready last); the final callback issues the open bucket's reduction, runs the post-backward of
   every unit still in ``TrainingState.PRE_BACKWARD``, reshards any unit prefetched but unused,
   and waits for every reduce-scatter.
7. the optimizer step (``Model.optimizer_s``).

With ``ReplayOptions.bucket_bytes`` > 0 the protocol lets units that run back to back share one
all-gather and one reduce-scatter wherever it would issue a unit's (``runtime/step.py``, [Note:
buckets]); the replay runs them as ``runtime/bucket.py`` does: see [Note: buckets in the replay]
in :mod:`flashfsdp.sim.collectives`.

Tensor parallelism (``ReplayOptions.tp_link`` and the model's ``tp``: see
:mod:`flashfsdp.sim.tensor_parallel`): W is then the data-parallel size W / tp, and each unit's
``tp_ops`` run on the compute stream at their place in its compute, each for the ring time of its
collective over the tp ranks on the TP link: they delay the compute behind them, and the FSDP
collectives on the side streams keep running meanwhile (the TP link is not theirs).

HSDP (``replicate``: the replicate link and R, see :mod:`flashfsdp.sim.hierarchy`): W is then the
shard group's size S, and each reduce-scatter is followed by an all-reduce of its 1/S shard across
the R replicas, on the same FIFO: on a GPU issued right behind the reduce-scatter, on a CPU host
when the reduction is finished (the runtime's [Note: HSDP all-reduce]).

The first simulated step records the execution order (no forward prefetch yet, as in the
runtime); the prediction is the last of ``steps`` steps.

Memory per rank (bytes): the sharded state of every unit (``Unit.state_bytes`` per sharded element)
plus what the step allocates: a unit's unsharded parameters from its all-gather's issue to its
reshard (a bucket's gathered buffer until its copy-out); its unsharded gradients from the
start of its backward until they are packed in its own post-backward or its bucket's (on the host
thread, or on a GPU's compute stream as FSDP2's ``foreach_reduce``); the reduce-scatter's buffers
(packed input and reduced shard) from issue until the runtime finishes the reduction (on a GPU the
caching allocator hands the block back then and reuses it in stream order). Activations are not
modelled.

[Note: waiting on the previous reduce-scatter]
On a GPU, each post-backward makes the compute stream wait on the event recorded after the
previous unit's reduce-scatter before dropping its packed input (``DeviceStreams.hold_until_passed``,
FSDP2's reduce-scatter-input scheme; the pack itself runs on the compute stream and is modelled as
taking no time): reduce-scatters slower than backward compute stall the compute stream instead of
queueing without bound.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from flashfsdp.runtime.intervals import union_length
from flashfsdp.runtime.schedule import PrefetchPolicy
from flashfsdp.runtime.states import ShardState, TrainingState
from flashfsdp.runtime.step import ReshardAfterForward, StepProtocol, UnitSettings, check_bucket_bytes

from .collectives import COLLECTIVES, GatherBucket, ReplayCollectives
from .contention import Contention
from .engine import CommEngine, CommOp, Span
from .link import Link
from .model import Model, TPOp, Unit


@dataclass(frozen=True)
class ReplayOptions:
    """How the replayed runtime is configured (see :func:`~flashfsdp.sim.simulate.simulate`)."""

    policy: PrefetchPolicy
    reshard_after_forward: bool = True
    forward_prefetch: Mapping[str, Sequence[str]] | None = None
    backward_prefetch: Mapping[str, Sequence[str]] | None = None
    shared_comm_stream: bool = False
    share_link_bandwidth: bool = False
    host_blocking: bool = False
    contention: Contention | None = None
    elide_backward_all_gather: bool = True  # skip units with ``backward_reads_params=False``
    tp_link: Link | None = None  # the link of the tensor-parallel collectives (a model with ``tp`` > 1)
    bucket_bytes: int = 0  # the protocol's bucket size in bytes ([Note: buckets]); 0: no buckets

    def __post_init__(self) -> None:
        check_bucket_bytes(self.bucket_bytes)


@dataclass
class UnitState:
    """One unit in the replay, in the runtime's own states."""

    unit: Unit
    shard: ShardState = ShardState.SHARDED
    training: TrainingState = TrainingState.IDLE
    op: CommOp | None = None  # the all-gather in flight (``shard`` is UNSHARDING; None: nothing to wait for)
    unsharded_mem: int = 0  # memory id of the unsharded parameters
    grads_mem: int = 0  # memory id of the unsharded gradients (from pre-backward until packed)
    bucket: GatherBucket | None = None  # the bucket all-gather in flight the unit is part of


class MemoryLog:
    """The step's allocations on the replay's clock: id -> [alloc time, free time (None: not
    yet), bytes]; :meth:`peak` is the most bytes alive at once."""

    def __init__(self):
        self.events: dict[int, list] = {}

    def alloc(self, now: float, nbytes: int) -> int:
        """Allocate ``nbytes`` at ``now``; returns the allocation's id."""
        key = len(self.events) + 1
        self.events[key] = [now, None, nbytes]
        return key

    def free(self, now: float, key: int) -> None:
        """Free allocation ``key`` at ``now`` (an id of an earlier step is ignored)."""
        if key in self.events:
            self.events[key][1] = now

    def peak(self) -> int:
        """The most bytes alive at once (at equal times frees go first)."""
        events = []
        for alloc, free, nbytes in self.events.values():
            events.append((alloc, 1, nbytes))
            events.append((math.inf if free is None else free, 0, -nbytes))
        peak = current = 0
        for _, _, delta in sorted(events):
            current += delta
            peak = max(peak, current)
        return peak


class StepReplay(ReplayCollectives):
    """The runtime's per-step sequence on one rank (see [Note: the step the simulator replays]; its
    collectives: :class:`~flashfsdp.sim.collectives.ReplayCollectives`).

    Args:
        model, world_size, link: what runs where.
        options: the runtime's configuration.
        copy_bandwidth: bytes per second of the copy-in; None: free.
        peer_issues, peer_ends: by collective number, the latest issue and end on the other ranks
            (None: this rank alone); see :func:`~flashfsdp.sim.simulate.simulate_ranks`.
        replicate: HSDP: ``(replicate link, R)``; ``world_size`` and ``link`` are then the shard
            group's. None: no replicas.
    """

    def __init__(self, model: Model, world_size: int, link: Link, options: ReplayOptions,
                 copy_bandwidth: float | None = None, peer_issues: Sequence[float] | None = None,
                 peer_ends: Sequence[float] | None = None, replicate: tuple[Link, int] | None = None,
                 log: bool = False):
        self.model, self.W, self.link, self.options = model, world_size, link, options
        self.replicate_link, self.replicas = replicate if replicate is not None else (None, 1)
        self.policy = options.policy
        self.copy_bandwidth = copy_bandwidth
        self.peer_issues, self.peer_ends = peer_issues, peer_ends
        self.issues: list[float] = []  # this rank's issue times, by collective number
        self.all_ops: list[CommOp] = []  # every step's collectives, by number
        fwd_lists, bwd_lists = dict(options.forward_prefetch or {}), dict(options.backward_prefetch or {})
        self.engine = CommEngine(options.share_link_bandwidth, options.contention)
        self.states = {u.name: UnitState(u) for u in model.units}
        setting = ReshardAfterForward(options.reshard_after_forward, False)  # FSDP2's default, the value given
        self._settings = {name: UnitSettings(setting, forward_prefetch=fwd_lists.get(name),
                                             backward_prefetch=bwd_lists.get(name)) for name in self.states}
        self.step_protocol = StepProtocol(model.root.name, self, options.policy, log=log,
                                          bucket_bytes=options.bucket_bytes)
        self.order = self.step_protocol.order
        self.prefetched = self.step_protocol.prefetched
        self.pending: list[tuple[CommOp, int, list[str]]] = []  # reductions not finished: memory id, units
        self.held: CommOp | None = None  # the last reduce-scatter, whose packed input is held (GPU)
        self.t = 0.0
        self._reset_step()

    # -------------------------------------------------------------- bookkeeping
    def _reset_step(self) -> None:
        self.step_start = self.t
        self.exposed = self.host_copy = self.ag_cost = self.rs_cost = self.ar_cost = 0.0
        self.n_ag = self.n_rs = self.n_ar = 0  # collectives issued (a bucket's count once per collective)
        self.units_gathered = 0  # unit all-gathers (a unit gathered in a bucket counts once)
        self.tp_cost = 0.0  # the TP collectives' time on the compute path
        self.bytes = dict.fromkeys(COLLECTIVES + tuple(f"tp_{k}" for k in COLLECTIVES), 0)  # per rank
        self.phase = "forward"  # "backward" from the root's pre-backward
        self.ag_bytes = {"forward": 0, "backward": 0, "elided": 0}  # all-gather outputs (unsharded bytes)
        self.spans: list[Span] = []
        self.ops: list[CommOp] = []
        self.mem = MemoryLog()

    def _compute(self, seconds: float, kind: str, unit: str) -> None:
        if seconds > 0:
            end = self.engine.compute(seconds)  # longer than ``seconds`` under host contention
            self.spans.append(Span("compute", kind, unit, self.t, end))
            self.t = end

    def _run(self, unit: Unit, pass_: str, part: int, seconds: float) -> None:
        """``seconds`` of the unit's compute in ``pass_`` (``part`` 0 or 1: before or after its
        nested units'), its TP collectives of that part in between, where their ``at`` puts them."""
        done = 0.0
        for op in sorted((op for op in unit.tp_ops if op.pass_ == pass_ and op.part == part), key=lambda o: o.at):
            self._compute(seconds * (op.at - done), pass_, unit.name)
            done = op.at
            self._tp_collective(op, unit.name)
        self._compute(seconds * (1 - done), pass_, unit.name)

    def _tp_collective(self, op: TPOp, name: str) -> None:
        """A TP collective on the compute stream: the ring time over the model's tp ranks on the TP
        link; the side streams run on meanwhile, host contention aside (it is not compute)."""
        link, tp = self.options.tp_link, self.model.tp
        cost = {"all_gather": link.all_gather_s, "reduce_scatter": link.reduce_scatter_s,
                "all_reduce": link.all_reduce_s}[op.kind](op.nbytes, tp)
        if cost > 0:
            end = self.engine.compute(cost, contended=False)
            self.spans.append(Span("compute", f"tp_{op.kind}", name, self.t, end))
            self.t = end
        self.tp_cost += cost
        self.bytes[f"tp_{op.kind}"] += op.nbytes

    def _wait(self, op: CommOp, until: str = "end") -> None:
        end = self.engine.finish(op) if until == "end" else self.engine.started(op)
        if end > self.t:
            self.spans.append(Span("compute", f"wait_{op.kind}", op.unit, self.t, end))
            self.exposed += end - self.t
            self.t = end

    # -------------------------------------------------------------- unshard / reshard (ShardState)
    def unshard(self, name: str) -> None:
        """Issue the unit's all-gather (copy-in first) unless it is unsharding or unsharded."""
        st = self.states[name]
        if st.shard is not ShardState.SHARDED:
            return
        self.unshard_together([name])

    def wait_unshard(self, name: str) -> None:
        """Wait for the unit's all-gather (issuing it if none is in flight); the first wait of a
        bucket's units copies every unit out and frees the bucket's gathered buffer."""
        st = self.states[name]
        if st.shard is ShardState.SHARDED:
            self.unshard(name)
        if st.shard is ShardState.UNSHARDING:
            if st.op is not None:
                self._wait(st.op)
            st.op = None
            st.shard = ShardState.UNSHARDED
            if st.bucket is not None and st.bucket.gathered_mem:
                self.mem.free(self.t, st.bucket.gathered_mem)
                st.bucket.gathered_mem = 0
            st.bucket = None
        self.prefetched.discard(name)

    def reshard(self, name: str, to_secondary: bool = False) -> None:
        """Free the unit's unsharded parameters (waiting first for an all-gather in flight); the
        replay has no post-forward sharding (``to_secondary`` frees it all)."""
        st = self.states[name]
        if st.shard is ShardState.UNSHARDING:
            self.wait_unshard(name)
        if st.shard is ShardState.UNSHARDED:
            self.mem.free(self.t, st.unsharded_mem)
        st.shard = ShardState.SHARDED
        self.prefetched.discard(name)

    # -------------------------------------------------------------- StepExecutor
    def keys(self) -> list[str]:
        return list(self.states)

    def settings(self, name: str) -> UnitSettings:
        return self._settings[name]

    def shard_state(self, name: str) -> ShardState:
        return self.states[name].shard

    def reduce(self, name: str) -> None:
        self.reduce_grads(name)

    def finish_reductions(self) -> None:
        self.finish_pending()

    def is_stale(self, name: str) -> bool:
        return False  # every unit ends the step resharded

    def skips_backward_unshard(self, name: str) -> bool:
        """Backward all-gather elision: the unit's backward reads no parameter (counted)."""
        st = self.states[name]
        if self._elides(name) and st.shard is ShardState.SHARDED:
            self.ag_bytes["elided"] += st.unit.unsharded_bytes(self.W)
            return True
        return False

    def prefetches_in_backward(self, name: str) -> bool:
        return not self._elides(name)

    # -------------------------------------------------------------- the runtime's hooks (TrainingState)
    def pre_forward(self, name: str) -> None:
        """A unit's forward starts (the protocol: record it, wait for its parameters, prefetch)."""
        self.states[name].training = TrainingState.FORWARD
        self.step_protocol.pre_forward(name)

    def post_forward(self, name: str) -> None:
        """A unit's forward ends (the protocol: reshard unless it is the root or kept for backward)."""
        self.step_protocol.post_forward(name)
        self.states[name].training = TrainingState.IDLE

    def pre_backward(self, name: str) -> None:
        """A unit's backward starts (the protocol: wait for its parameters unless elided,
        prefetch); its gradients are allocated."""
        st = self.states[name]
        st.training = TrainingState.PRE_BACKWARD
        self.phase = "backward"
        self.step_protocol.pre_backward(name)
        st.grads_mem = self.mem.alloc(self.t, st.unit.unsharded_bytes(self.W))

    def _elides(self, name: str) -> bool:
        """Whether the unit's backward runs without its parameters (backward all-gather elision)."""
        return self.options.elide_backward_all_gather and not self.states[name].unit.backward_reads_params

    def post_backward(self, name: str) -> None:
        """A unit's gradients are ready (the protocol: reduce them), then its backward ends
        (reshard)."""
        self.step_protocol.gradients_ready(name)
        self.states[name].training = TrainingState.POST_BACKWARD
        self.step_protocol.backward_done(name)

    def final_callback(self) -> None:
        """The end of the backward (the protocol: pending post-backwards, unused prefetches, every
        reduction), then the compute stream waits for every reduce-scatter."""
        unfinished = [name for name, st in self.states.items() if st.training is TrainingState.PRE_BACKWARD]
        for name in unfinished:
            self.states[name].training = TrainingState.POST_BACKWARD
        self.step_protocol.flush_reductions()  # the open bucket first, as the runtime's final callback
        self.step_protocol.end_backward(unfinished, unfinished, lambda name: False)
        for op in self.ops:  # wait_for_reduce_scatter: the compute stream waits for the whole stream
            if op.kind in ("reduce_scatter", "all_reduce"):
                self._wait(op)
        self.held = None  # release_held (its packed input was freed with the reductions)
        for st in self.states.values():
            st.training = TrainingState.IDLE

    # -------------------------------------------------------------- one step
    def step(self) -> None:
        """One training step: forward, loss, backward, final callback, optimizer step."""
        model, root = self.model, self.model.root
        # root pre-forward: the protocol finishes the last step's reductions, starts a new step
        self.step_protocol.start_step(self.keys())
        self._reset_step()
        self.pre_forward(root.name)
        self._run(root, "forward", 0, root.forward_s * model.root_forward_before)
        for block in model.blocks:
            self.pre_forward(block.name)
            self._run(block, "forward", 0, block.forward_s)
            self.post_forward(block.name)
        self._run(root, "forward", 1, root.forward_s * (1 - model.root_forward_before))
        self.post_forward(root.name)
        self._compute(model.loss_s, "loss", "")
        self.pre_backward(root.name)
        self._run(root, "backward", 0, root.backward_s * (1 - model.root_backward_after))
        for block in reversed(model.blocks):
            self.pre_backward(block.name)
            self._run(block, "backward", 0, block.backward_s)
            self.post_backward(block.name)
        self._run(root, "backward", 1, root.backward_s * model.root_backward_after)
        self.post_backward(root.name)  # the root's gradients are ready last
        self.final_callback()
        self._compute(model.optimizer_s, "optimizer", "")
        self.engine.drain()

    # -------------------------------------------------------------- results
    def peak_step_bytes(self) -> int:
        """The most bytes the last step held at once beyond the sharded state."""
        return self.mem.peak()

    def comm_busy(self) -> float:
        """Per collective kind, the union of [issue, end] of the step's ops; summed over kinds."""
        return sum(union_length((op.issue, op.end) for op in self.ops if op.kind == kind) for kind in COLLECTIVES)

    def timeline(self) -> list[Span]:
        """The last step's spans, compute and collectives, from the step's start."""
        t0 = self.step_start
        spans = [Span(s.stream, s.kind, s.unit, s.start - t0, s.end - t0) for s in self.spans]
        spans += [Span(op.stream, op.kind, op.unit, op.start - t0, op.end - t0) for op in self.ops]
        return sorted(spans, key=lambda s: (s.start, s.stream))
