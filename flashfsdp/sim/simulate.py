"""Event simulation of one training step under the runtime's own schedule policy.

The simulator replays what ``flashfsdp.bindings.state`` does, in the same order and through the
same policy objects (:class:`~flashfsdp.runtime.schedule.ExecutionOrder` and
:class:`~flashfsdp.runtime.schedule.PrefetchPolicy`), on a timeline of three streams:

- **compute** — the units' forward and backward compute (and, on a CPU host, everything the one
  Python thread does: copy-in, waits).
- **all-gather** — copy-in (optionally) and the all-gathers, first in first out.
- **reduce-scatter** — the reduce-scatters, first in first out.

A collective issued at compute time t starts at t or when its stream is free, whichever is later
(the runtime makes the side stream wait on the compute stream before it enqueues), and lasts the
ring cost of :mod:`flashfsdp.sim.link` (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009).
A wait blocks the compute stream until the collective ends; that blocked time is the **exposed**
communication. ``shared_comm_stream=True`` puts both collectives on one FIFO (gloo on CPU: one
worker runs every collective in issue order). ``share_link_bandwidth=True`` instead keeps two streams
but lets an all-gather and a reduce-scatter that overlap split the link's bandwidth evenly (one NIC
per rank), which the default (each collective at full bandwidth) does not. ``contention`` (a
:class:`~flashfsdp.sim.contention.Contention`) makes compute and an in-flight collective slow each
other down, as they do on a CPU host where gloo's thread and the compute thread share the cores:
without it, overlapped communication is free for compute, which on a GPU is close to true and on
2 CPU cores for 2 ranks is not.

[Note: the step the simulator replays]
Per step, mirroring ``FSDPState`` (``_pre_forward``, ``_post_forward``, ``_pre_backward``,
``_post_backward``, ``_final_callback``, ``_prefetch``):

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
   backward compute; post-backward issues the reduce-scatter (on a GPU after waiting on the previous
   pack, see [Note: waiting on the previous pack]), then finishes the reductions issued before it
   (on a CPU host, ``host_blocking=True``, that blocks the thread on them; on a GPU it only orders
   the reduce-scatter stream), then reshards.
6. the rest of the root's backward; the final callback runs the root's post-backward (its
   reduce-scatter), reshards any unit prefetched but unused, and waits for every reduce-scatter.
7. the optimizer step (``Model.optimizer_s``).

The first simulated step records the execution order (no forward prefetch yet, as in the
runtime); the prediction is the last of ``steps`` steps.

Memory per rank (bytes): the sharded state of every unit (``Unit.state_bytes`` per sharded element)
plus what the step allocates: a unit's unsharded parameters from its all-gather's issue to its
reshard; its unsharded gradients from the start of its backward until they are packed (CPU host: its
own post-backward; GPU: the next post-backward, when the compute stream has waited on the pack); the
reduce-scatter's buffers (packed input and reduced shard) from issue until the runtime finishes the
reduction (on a GPU the caching allocator hands the block back then and reuses it in stream order).
Activations are not modelled.

[Note: waiting on the previous pack]
On a GPU, each post-backward makes the compute stream wait on the event recorded after the
previous unit's gradient pack before dropping those gradients (``DeviceStreams.hold_until_passed``,
FSDP2's reduce-scatter-input scheme). The simulator models the pack as taking no time, so that wait
ends when the previous unit's reduce-scatter starts: reduce-scatters slower than backward compute
stall the compute stream instead of queueing without bound.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping, Sequence

from flashfsdp.runtime.schedule import ExecutionOrder, PrefetchPolicy

from .contention import Contention
from .link import Link, check_world_size, get_link
from .model import Model, Unit

_EPS = 1e-15


@dataclass
class Span:
    """One interval of the simulated timeline (seconds from the start of the predicted step)."""

    stream: str  # "compute", "all_gather", "reduce_scatter" (or "comm" when shared)
    kind: str  # "forward", "backward", "loss", "optimizer", "copy_in", "wait_all_gather", ...
    unit: str
    start: float
    end: float


@dataclass
class Prediction:
    """The simulator's prediction for one step (times in seconds, sizes in bytes).

    Attributes:
        world_size: W.
        link: the link's name.
        label: the setting's label (see :data:`SETTINGS`), or "".
        step_s: step time: from the root's pre-forward to the end of the optimizer step.
        compute_s: pure compute of the step (every unit's forward and backward, loss, optimizer).
        exposed_s: time the compute stream waited on all-gathers and reduce-scatters.
        host_copy_s: copy-in run on the compute thread (``host_blocking`` with a copy bandwidth).
        all_gather_s: sum of the step's all-gather costs (ring model, full bandwidth).
        reduce_scatter_s: sum of the step's reduce-scatter costs.
        all_gathers: all-gathers issued in the step.
        comm_busy_s: busy time of the step's communication as a trace records it: per kind
            (all-gather, reduce-scatter), the union of the collectives' [issue, completion]
            intervals (queueing behind earlier collectives and host contention included), summed
            over the two kinds, as ``Profile.summary()["comm_ms"]`` counts it.
        peak_bytes: peak memory per rank (see the module docstring).
        sharded_bytes: the constant part of it, the sharded state.
        timeline: the step's spans when ``record_timeline`` was set.
    """

    world_size: int
    link: str
    label: str
    step_s: float
    compute_s: float
    exposed_s: float
    host_copy_s: float
    all_gather_s: float
    reduce_scatter_s: float
    all_gathers: int
    comm_busy_s: float
    peak_bytes: int
    sharded_bytes: int
    timeline: list[Span] = field(default_factory=list, repr=False)

    @property
    def comm_s(self) -> float:
        """All communication of the step (seconds), overlapped or not."""
        return self.all_gather_s + self.reduce_scatter_s

    @property
    def efficiency(self) -> float:
        """Pure compute / step time (1.0: communication entirely hidden)."""
        return self.compute_s / self.step_s if self.step_s > 0 else 1.0

    def row(self) -> dict:
        """A flat dict for tables: times in ms, memory in GiB."""
        return {"setting": self.label, "link": self.link, "world_size": self.world_size,
                "step_ms": self.step_s * 1e3, "compute_ms": self.compute_s * 1e3,
                "exposed_ms": self.exposed_s * 1e3, "comm_ms": self.comm_s * 1e3,
                "efficiency": self.efficiency, "peak_GiB": self.peak_bytes / 2**30}


# ------------------------------------------------------------------------------------- streams


@dataclass(eq=False)
class _Op:
    """A collective on a side stream: phases of [seconds left, uses the link, is the collective]
    (a GPU copy-in phase is not: host contention does not slow it). Its collective phases cannot
    start before ``ready`` and it cannot end before ``done_after`` (when a peer rank issues it
    later or finishes it later: see :func:`simulate_ranks`)."""

    stream: str
    kind: str
    unit: str
    issue: float
    phases: list
    ready: float = -math.inf
    done_after: float = -math.inf
    start: float | None = None
    end: float | None = None


class _CommEngine:
    """FIFO side streams advanced as a fluid, in lockstep with the compute stream.

    Each stream's head op, once ready, progresses at rate 1; with link sharing, at 1/k while k heads
    are in a link-using phase; with host contention, at ``comm_rate`` while the compute stream
    computes (and the compute stream at ``compute_rate`` while a collective is in flight). The
    runtime advances time only through :meth:`compute` (the compute stream busy) and
    :meth:`finish` / :meth:`started` (the compute stream blocked), so ``now`` is always the compute
    stream's time.
    """

    def __init__(self, share_link: bool, contention: Contention | None):
        self.share_link = share_link
        self.contention = contention
        self.queues: dict[str, collections.deque] = {}
        self.now = 0.0

    def issue(self, op: _Op) -> None:
        """Enqueue ``op`` (issued now) on its stream."""
        self.queues.setdefault(op.stream, collections.deque()).append(op)
        self._retire()

    def compute(self, seconds: float) -> float:
        """Run ``seconds`` of compute on the compute stream from now; returns when it ends."""
        work = seconds
        while work > _EPS * max(1.0, self.now):
            work -= self._step(work)
        return self.now

    def finish(self, op: _Op) -> float:
        """When ``op`` ends, the compute stream blocked until then (no op issued later can delay it)."""
        while op.end is None:
            self._step(None)
        return op.end

    def started(self, op: _Op) -> float:
        """When ``op`` starts, the compute stream blocked until then."""
        while op.start is None:
            self._step(None)
        return op.start

    def drain(self) -> None:
        """Run every stream empty (the compute stream idle)."""
        while any(self.queues.values()):
            self._step(None)

    def _can_run(self, op: _Op) -> bool:
        """A local phase (GPU copy-in) runs at once; a collective phase once every rank issued it;
        an op with no phase left ends once every rank finished it."""
        tol = _EPS * max(1.0, self.now)
        if not op.phases:
            return op.done_after <= self.now + tol
        return not op.phases[0][2] or op.ready <= self.now + tol

    def _until_runnable(self, op: _Op) -> float:
        return (op.done_after if not op.phases else op.ready) - self.now

    def _heads(self) -> tuple[list[_Op], list[_Op]]:
        """(heads that run, heads whose collective waits for a peer rank), starting the former."""
        heads = [q[0] for q in self.queues.values() if q]
        running = [h for h in heads if self._can_run(h)]
        for h in running:
            if h.start is None:
                h.start = self.now
        return running, [h for h in heads if not self._can_run(h)]

    def _step(self, work: float | None) -> float:
        """Advance to the next event: a phase ends, a head becomes ready, or (``work`` given: the
        compute stream busy) the compute ends. Returns the compute seconds done."""
        heads, waiting = self._heads()
        heads = [h for h in heads if h.phases]
        on_link = sum(1 for h in heads if h.phases[0][1])
        computing = work is not None
        contended = [h for h in heads if h.phases[0][2]] if computing and self.contention is not None else []
        rates = []
        for h in heads:
            rate = 1.0 / on_link if self.share_link and on_link > 1 and h.phases[0][1] else 1.0
            if h in contended:
                rate *= self.contention.rates(h.kind)[1]
            rates.append(rate)
        compute_rate = min((self.contention.rates(h.kind)[0] for h in contended), default=1.0)
        times = [h.phases[0][0] / r for h, r in zip(heads, rates)] + [self._until_runnable(h) for h in waiting]
        if computing:
            times.append(work / compute_rate)
        if not times:
            raise RuntimeError("overlap simulator: waiting for a collective that was never issued")
        dt = min(times)
        for h, r in zip(heads, rates):
            h.phases[0][0] -= dt * r
        self.now += dt
        self._retire()
        return dt * compute_rate

    def _retire(self) -> None:
        """Drop the finished phases of the heads that can run; end the ops with none left."""
        tol = _EPS * max(1.0, self.now)
        for queue in self.queues.values():
            while queue and self._can_run(queue[0]):
                head = queue[0]
                if head.start is None:
                    head.start = self.now
                while head.phases and head.phases[0][0] <= tol and self._can_run(head):
                    head.phases.pop(0)
                if head.phases or not self._can_run(head):  # a phase left, or a peer still busy
                    break
                head.end = self.now
                queue.popleft()


# ------------------------------------------------------------------------------------- runtime


@dataclass
class _UnitState:
    unit: Unit
    sharded: bool = True
    op: _Op | None = None  # all-gather in flight
    unsharded_mem: int = 0  # memory event id of the unsharded parameters


class _Runtime:
    """The runtime's per-step sequence (see [Note: the step the simulator replays])."""

    def __init__(self, model: Model, world_size: int, link: Link, policy: PrefetchPolicy,
                 reshard_after_forward: bool, forward_prefetch: Mapping[str, Sequence[str]] | None,
                 backward_prefetch: Mapping[str, Sequence[str]] | None, shared_comm_stream: bool,
                 share_link_bandwidth: bool, host_blocking: bool, copy_bandwidth: float | None,
                 contention: Contention | None, peer_issues: Sequence[float] | None = None,
                 peer_ends: Sequence[float] | None = None):
        self.model, self.W, self.link, self.policy = model, world_size, link, policy
        self.peer_issues = peer_issues  # by collective number: the latest issue on the other ranks
        self.peer_ends = peer_ends  # by collective number: the latest end on the other ranks
        self.issues: list[float] = []  # this rank's issue times, by collective number
        self.all_ops: list[_Op] = []  # every step's collectives, by number
        self.reshard_after_forward = reshard_after_forward
        self.fwd_lists = dict(forward_prefetch or {})
        self.bwd_lists = dict(backward_prefetch or {})
        self.shared = shared_comm_stream
        self.host_blocking = host_blocking
        self.copy_bandwidth = copy_bandwidth
        self.engine = _CommEngine(share_link_bandwidth, contention)
        self.order = ExecutionOrder()
        self.states = {u.name: _UnitState(u) for u in model.units}
        self.prefetched: set[str] = set()
        self.pending: list[tuple[_Op, int]] = []  # reduce-scatters not finished, with their memory id
        self.held: tuple[_Op, int] | None = None  # the last reduce-scatter and its unit's gradients (GPU)
        self.t = 0.0
        self._reset_step()

    # -------------------------------------------------------------- bookkeeping
    def _reset_step(self) -> None:
        self.step_start = self.t
        self.exposed = 0.0
        self.host_copy = 0.0
        self.ag_cost = 0.0
        self.rs_cost = 0.0
        self.n_ag = 0
        self.spans: list[Span] = []
        self.ops: list[_Op] = []
        # memory: id -> [alloc time, free time (None: not yet), bytes]
        self.mem: dict[int, list] = {}

    def _alloc(self, nbytes: int) -> int:
        key = len(self.mem) + 1
        self.mem[key] = [self.t, None, nbytes]
        return key

    def _free(self, key: int) -> None:
        if key in self.mem:
            self.mem[key][1] = self.t

    def _compute(self, seconds: float, kind: str, unit: str) -> None:
        if seconds > 0:
            end = self.engine.compute(seconds)  # longer than ``seconds`` under host contention
            self.spans.append(Span("compute", kind, unit, self.t, end))
            self.t = end

    def _wait(self, op: _Op, until: str = "end") -> None:
        end = self.engine.finish(op) if until == "end" else self.engine.started(op)
        if end > self.t:
            self.spans.append(Span("compute", f"wait_{op.kind}", op.unit, self.t, end))
            self.exposed += end - self.t
            self.t = end

    def _stream(self, kind: str) -> str:
        return "comm" if self.shared else kind

    def _issue(self, kind: str, name: str, phases: list) -> _Op:
        """Issue a collective now; with peers, its collective phases wait until every rank issued it."""
        n = len(self.issues)
        self.issues.append(self.t)
        ready = self.t
        if self.peer_issues is not None and n < len(self.peer_issues):
            ready = max(ready, self.peer_issues[n])
        done_after = self.peer_ends[n] if self.peer_ends is not None and n < len(self.peer_ends) else -math.inf
        op = _Op(self._stream(kind), kind, name, self.t, phases, ready=ready, done_after=done_after)
        self.engine.issue(op)
        self.ops.append(op)
        self.all_ops.append(op)
        return op

    # -------------------------------------------------------------- unshard / reshard
    def unshard(self, name: str) -> None:
        st = self.states[name]
        if not st.sharded or st.op is not None:
            return
        unit = st.unit
        nbytes = unit.unsharded_bytes(self.W)
        copy_s = 0.0
        if self.copy_bandwidth:
            copy_s = nbytes / self.W / self.copy_bandwidth  # this rank's shard, cast into its slice
        phases = []
        if copy_s and self.host_blocking:
            self._compute(copy_s, "copy_in", name)
            self.host_copy += copy_s
        elif copy_s:
            phases.append([copy_s, False, False])
        st.unsharded_mem = self._alloc(nbytes)
        cost = self.link.all_gather_s(nbytes, self.W)
        latency = min(cost, self.link.latency_s(self.W, "all_gather"))
        phases += [[latency, False, True], [cost - latency, True, True]]
        op = self._issue("all_gather", name, phases)
        self.ag_cost += cost
        self.n_ag += 1
        st.op = op

    def wait_unshard(self, name: str) -> None:
        st = self.states[name]
        if st.sharded and st.op is None:
            self.unshard(name)
        if st.op is not None:
            self._wait(st.op)
            st.op = None
            st.sharded = False
        self.prefetched.discard(name)

    def reshard(self, name: str) -> None:
        st = self.states[name]
        if st.op is not None:
            self.wait_unshard(name)
        if not st.sharded:
            self._free(st.unsharded_mem)
        st.sharded = True
        self.prefetched.discard(name)

    def prefetch(self, targets: Iterable[str]) -> None:
        candidates = [t for t in targets if self.states[t].sharded and self.states[t].op is None]
        for target in self.policy.admit(candidates, len(self.prefetched)):
            self.unshard(target)
            self.prefetched.add(target)

    # -------------------------------------------------------------- gradients
    def reduce_grads(self, name: str, grads_mem: int) -> None:
        unit = self.states[name].unit
        if self.host_blocking:
            self._free(grads_mem)  # packed on the host thread: the gradients are gone
        elif self.held is not None:
            # hold_until_passed: the compute stream waits for the previous unit's pack (the start of
            # its reduce-scatter, the pack taking no time here) and drops that unit's gradients.
            prev_op, prev_grads = self.held
            self._wait(prev_op, until="start")
            self._free(prev_grads)
        nbytes = unit.reduce_bytes_total(self.W)
        cost = self.link.reduce_scatter_s(nbytes, self.W)
        latency = min(cost, self.link.latency_s(self.W, "reduce_scatter"))
        op = self._issue("reduce_scatter", name, [[latency, False, True], [cost - latency, True, True]])
        self.rs_cost += cost
        if not self.host_blocking:
            self.held = (op, grads_mem)
        buffers = self._alloc(nbytes + nbytes // self.W)  # packed input + reduced shard
        self.finish_pending()
        self.pending.append((op, buffers))

    def finish_pending(self) -> None:
        """Finish the reductions issued so far: on a CPU host the thread blocks on each; on a GPU
        only the reduce-scatter stream is ordered, and the buffers go back to the caching allocator
        (reused in stream order by the next pack)."""
        pending, self.pending = self.pending, []
        for op, buffers in pending:
            if self.host_blocking:
                self._wait(op)
            self._free(buffers)

    # -------------------------------------------------------------- one step
    def step(self) -> None:
        model, root = self.model, self.model.root.name
        blocks = [b.name for b in model.blocks]
        # forward
        self.finish_pending()
        self.order.start_step()
        self._reset_step()
        self.order.record(root)
        self.wait_unshard(root)
        self.prefetch(self.policy.forward_targets(root, self.order, self.fwd_lists.get(root)))
        self._compute(model.root.forward_s * model.root_forward_before, "forward", root)
        for name in blocks:
            self.order.record(name)
            self.wait_unshard(name)
            self.prefetch(self.policy.forward_targets(name, self.order, self.fwd_lists.get(name)))
            self._compute(self.states[name].unit.forward_s, "forward", name)
            self.order.record_post_forward(name)
            if self.reshard_after_forward and not self.policy.keep_for_backward(name, self.order):
                self.reshard(name)
        self._compute(model.root.forward_s * (1 - model.root_forward_before), "forward", root)
        self.order.record_post_forward(root)
        self._compute(model.loss_s, "loss", "")
        # backward
        grads = {}
        self.order.record_pre_backward(root)
        self.wait_unshard(root)
        self.prefetch(self.policy.backward_targets(root, self.order, self.bwd_lists.get(root)))
        grads[root] = self._alloc(model.root.unsharded_bytes(self.W))
        self._compute(model.root.backward_s * (1 - model.root_backward_after), "backward", root)
        for name in reversed(blocks):
            unit = self.states[name].unit
            self.order.record_pre_backward(name)
            self.wait_unshard(name)
            self.prefetch(self.policy.backward_targets(name, self.order, self.bwd_lists.get(name)))
            grads[name] = self._alloc(unit.unsharded_bytes(self.W))
            self._compute(unit.backward_s, "backward", name)
            self.reduce_grads(name, grads[name])
            self.reshard(name)
        self._compute(model.root.backward_s * model.root_backward_after, "backward", root)
        # final callback: the root's post-backward, unused prefetches, then every reduce-scatter
        self.reduce_grads(root, grads[root])
        self.reshard(root)
        for name in list(self.prefetched):
            self.reshard(name)
        self.finish_pending()
        for op in self.ops:  # wait_for_reduce_scatter: the compute stream waits for the whole stream
            if op.kind == "reduce_scatter":
                self._wait(op)
        if self.held is not None:  # release_held
            self._free(self.held[1])
            self.held = None
        self._compute(model.optimizer_s, "optimizer", "")
        self.engine.drain()

    # -------------------------------------------------------------- results
    def peak_step_bytes(self) -> int:
        events = []
        for alloc, free, nbytes in self.mem.values():
            if free is None:
                free = math.inf
            events.append((alloc, 1, nbytes))
            events.append((free, 0, -nbytes))  # at equal times frees go first
        peak = current = 0
        for _, _, delta in sorted(events):
            current += delta
            peak = max(peak, current)
        return peak

    def comm_busy(self) -> float:
        """Per collective kind, the union of [issue, end] of the step's ops; summed over kinds."""
        total = 0.0
        for kind in ("all_gather", "reduce_scatter"):
            cursor = -math.inf
            for op in sorted((o for o in self.ops if o.kind == kind), key=lambda o: o.issue):
                total += max(0.0, op.end - max(op.issue, cursor))
                cursor = max(cursor, op.end)
        return total

    def timeline(self) -> list[Span]:
        t0 = self.step_start
        spans = [Span(s.stream, s.kind, s.unit, s.start - t0, s.end - t0) for s in self.spans]
        spans += [Span(op.stream, op.kind, op.unit, op.start - t0, op.end - t0) for op in self.ops]
        return sorted(spans, key=lambda s: (s.start, s.stream))


def simulate(model: Model, world_size: int, link: "Link | str", *, policy: PrefetchPolicy | None = None,
             reshard_after_forward: bool = True, forward_prefetch: Mapping[str, Sequence[str]] | None = None,
             backward_prefetch: Mapping[str, Sequence[str]] | None = None, shared_comm_stream: bool = False,
             share_link_bandwidth: bool = False, host_blocking: bool = False,
             copy_bandwidth: float | None = None, contention: Contention | None = None, steps: int = 2,
             record_timeline: bool = False, label: str = "") -> Prediction:
    """Predict one training step of ``model`` on ``world_size`` ranks (see the module docstring).

    Args:
        model: the units and their compute (seconds) and bytes (:mod:`flashfsdp.sim.model`).
        world_size: ranks W >= 1.
        link: a :class:`~flashfsdp.sim.link.Link` or a name in :data:`~flashfsdp.sim.link.LINKS`.
        policy: the runtime's prefetch policy (default ``PrefetchPolicy()``: forward and backward
            prefetch, at most 2 in flight).
        reshard_after_forward: free non-root units after forward (re-gathered for backward).
        forward_prefetch, backward_prefetch: explicit prefetch lists by unit name, as
            ``FSDPModule.set_modules_to_forward_prefetch`` / ``..._backward_prefetch`` set them.
        shared_comm_stream: all-gathers and reduce-scatters share one FIFO (gloo on CPU).
        share_link_bandwidth: concurrent all-gather and reduce-scatter split the bandwidth.
        host_blocking: CPU-host semantics: waits block the thread (finishing reductions blocks on
            them), and copy-in runs on the compute thread.
        copy_bandwidth: bytes per second of the copy-in (the shard cast into the unsharded buffer);
            None: free.
        contention: host contention (:class:`~flashfsdp.sim.contention.Contention`): compute and a
            collective in flight slow each other down (CPU ranks sharing cores with gloo's thread);
            None: they do not (GPU streams).
        steps: steps simulated (>= 1); the first records the execution order; the last is reported.
        record_timeline: keep the predicted step's spans in ``Prediction.timeline``.
        label: a label carried into the prediction.

    Returns:
        the last step's :class:`Prediction`.

    Raises:
        ValueError: W < 1, an unknown link name, steps < 1, a bad copy bandwidth, a ``contention``
            that is not a Contention, or an explicit prefetch list naming an unknown unit (the
            message names the argument).
    """
    link = _check_simulate_args(model, world_size, link, steps, copy_bandwidth, contention, forward_prefetch,
                                backward_prefetch)
    runtime = _Runtime(model, world_size, link, policy if policy is not None else PrefetchPolicy(),
                       reshard_after_forward, forward_prefetch, backward_prefetch, shared_comm_stream,
                       share_link_bandwidth, host_blocking, copy_bandwidth, contention)
    for _ in range(steps):
        runtime.step()
    return _prediction(runtime, label, record_timeline)


def _check_simulate_args(model, world_size, link, steps, copy_bandwidth, contention, forward_prefetch,
                         backward_prefetch) -> Link:
    """The checks of :func:`simulate` (raising ValueError naming the argument); returns the Link."""
    check_world_size(world_size)
    link = get_link(link)
    if not isinstance(model, Model):
        raise ValueError(f"model must be a flashfsdp.sim.Model, got {type(model).__name__}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if copy_bandwidth is not None and not (isinstance(copy_bandwidth, (int, float)) and copy_bandwidth > 0):
        raise ValueError(f"copy_bandwidth must be > 0 bytes per second or None, got {copy_bandwidth!r}")
    if contention is not None and not isinstance(contention, Contention):
        raise ValueError(f"contention must be a flashfsdp.sim.Contention or None, got {type(contention).__name__}")
    names = {u.name for u in model.units}
    for arg, lists in (("forward_prefetch", forward_prefetch), ("backward_prefetch", backward_prefetch)):
        for key, targets in (lists or {}).items():
            unknown = [n for n in (key, *targets) if n not in names]
            if unknown:
                raise ValueError(f"{arg}: unknown unit(s) {unknown}; units are {sorted(names)}")
    return link


def _prediction(runtime: _Runtime, label: str, record_timeline: bool) -> Prediction:
    model, world_size = runtime.model, runtime.W
    sharded = sum(u.sharded_state_bytes(world_size) for u in model.units)
    return Prediction(
        world_size=world_size, link=runtime.link.name, label=label, step_s=runtime.t - runtime.step_start,
        compute_s=model.compute_s(), exposed_s=runtime.exposed, host_copy_s=runtime.host_copy,
        all_gather_s=runtime.ag_cost, reduce_scatter_s=runtime.rs_cost, all_gathers=runtime.n_ag,
        comm_busy_s=runtime.comm_busy(),
        peak_bytes=sharded + runtime.peak_step_bytes(), sharded_bytes=sharded,
        timeline=runtime.timeline() if record_timeline else [],
    )


def _not_later(new, old) -> bool:
    """Whether no time in ``new`` is later than the same one in ``old`` (None: not yet known)."""
    return old is not None and all(b <= a + 1e-12 + _EPS * abs(a) for a, b in zip(old, new))


def simulate_ranks(models: Sequence[Model], world_size: int, link: "Link | str", *,
                   policy: PrefetchPolicy | None = None, reshard_after_forward: bool = True,
                   forward_prefetch: Mapping[str, Sequence[str]] | None = None,
                   backward_prefetch: Mapping[str, Sequence[str]] | None = None, shared_comm_stream: bool = False,
                   share_link_bandwidth: bool = False, host_blocking: bool = False,
                   copy_bandwidth: "float | None | Sequence[float | None]" = None,
                   contention: Contention | None = None, steps: int = 2, record_timeline: bool = False,
                   label: str = "") -> list[Prediction]:
    """Predict one step on each of several ranks, each with its own compute, coupled by the collectives.

    :func:`simulate` follows one rank and lets a collective start as soon as that rank issued it. A
    collective needs every rank, though: when one rank computes longer (another job took its core,
    its operators ran slower), the others wait inside the collective. Here each rank runs its own
    ``Model`` (the same units and bytes, its own measured compute) and the i-th collective of the
    run starts on no rank before the last rank issued it, and ends on no rank before the last rank
    finished it (a ring moves at the pace of its slowest member: under host contention the ranks'
    progress differs). The ranks' times are found by fixed-point iteration: each rank is simulated
    against the latest issue and end times the other ranks reached so far, until no time moves
    later. Without host contention this is the exact coupled timeline (the i-th collective depends
    only on those before it); with it, two nearby timelines can feed each other (a rank's compute
    speed depends on when its collectives end), and the iteration keeps the later one. Ranks that are not listed (``world_size`` > ``len(models)``) are
    taken to be as fast as the fastest listed one, i.e. they delay nothing.

    Args:
        models: one :class:`Model` per rank (same unit names, sizes and bytes), compute per rank.
        copy_bandwidth: one value for every rank, or one per rank.
        world_size, link, policy, ...: as :func:`simulate`.

    Returns:
        one :class:`Prediction` per rank, in the order of ``models``.

    Raises:
        ValueError: no models, more models than ``world_size``, ranks whose units differ, a list of
            copy bandwidths of the wrong length, or any error of :func:`simulate`.
    """
    models = list(models)
    if not models:
        raise ValueError("simulate_ranks: models must hold one Model per rank, got none")
    check_world_size(world_size)
    if len(models) > world_size:
        raise ValueError(f"simulate_ranks: {len(models)} models for world_size {world_size}; give at most one per rank")
    signature = [(u.name, u.numel, u.param_bytes, u.reduce_bytes) for u in models[0].units]
    for r, m in enumerate(models):
        if not isinstance(m, Model):
            raise ValueError(f"simulate_ranks: models[{r}] must be a flashfsdp.sim.Model, got {type(m).__name__}")
        if [(u.name, u.numel, u.param_bytes, u.reduce_bytes) for u in m.units] != signature:
            raise ValueError(f"simulate_ranks: models[{r}] has other units (names, sizes or bytes) than models[0]; "
                             "every rank runs the same units, only compute times may differ")
    copies = list(copy_bandwidth) if isinstance(copy_bandwidth, (list, tuple)) else [copy_bandwidth] * len(models)
    if len(copies) != len(models):
        raise ValueError(f"simulate_ranks: copy_bandwidth has {len(copies)} values for {len(models)} models")
    link = _check_simulate_args(models[0], world_size, link, steps, copies[0], contention, forward_prefetch,
                                backward_prefetch)
    for c in copies[1:]:
        _check_simulate_args(models[0], world_size, link, steps, c, contention, None, None)

    def run(r: int, peer_issues, peer_ends) -> _Runtime:
        runtime = _Runtime(models[r], world_size, link, policy if policy is not None else PrefetchPolicy(),
                           reshard_after_forward, forward_prefetch, backward_prefetch, shared_comm_stream,
                           share_link_bandwidth, host_blocking, copies[r], contention, peer_issues=peer_issues,
                           peer_ends=peer_ends)
        for _ in range(steps):
            runtime.step()
        return runtime

    n_ranks = len(models)
    peers: list = [(None, None)] * n_ranks
    rounds = 0
    while True:
        runs = [run(r, *peers[r]) for r in range(n_ranks)]
        issues = [rt.issues for rt in runs]
        ends = [[op.end for op in rt.all_ops] for rt in runs]
        if len({len(i) for i in issues}) != 1:
            raise RuntimeError("simulate_ranks: the ranks issued different numbers of collectives")
        if n_ranks == 1:
            break
        latest = [tuple([max(times[q][i] for q in range(n_ranks) if q != r) for i in range(len(issues[0]))]
                        for times in (issues, ends)) for r in range(n_ranks)]
        if all(_not_later(new, old) for p, l in zip(peers, latest) for old, new in zip(p, l)):
            break
        rounds += 1
        if rounds > 4 * len(issues[0]) + 10:
            raise RuntimeError(f"simulate_ranks: the ranks' collective times did not converge in {rounds} rounds")
        # Never move a peer time earlier: the iteration is then monotone and settles even where host
        # contention makes it flip between two nearby solutions (it keeps the later one).
        peers = [tuple(new if old is None else [max(a, b) for a, b in zip(old, new)] for old, new in zip(p, l))
                 for p, l in zip(peers, latest)]
    return [_prediction(rt, label, record_timeline) for rt in runs]


# ------------------------------------------------------------------------------------- settings


def prefetch_ahead(model: Model, depth: int) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Explicit prefetch lists reaching ``depth`` units ahead (forward) and behind (backward).

    Forward: each unit prefetches the ``depth`` units after it in forward order (root first).
    Backward: each block prefetches the ``depth`` blocks before it, as the implicit policy would
    one deep (the root, first in forward order, gets no list). Pass the result as
    ``simulate(..., forward_prefetch=f, backward_prefetch=b)``, or to the runtime through
    ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
    order = [u.name for u in model.units]
    forward = {n: order[i + 1:i + 1 + depth] for i, n in enumerate(order)}
    backward = {n: order[max(1, i - depth):i][::-1] for i, n in enumerate(order) if i > 0}
    return forward, backward


@dataclass(frozen=True)
class Setting:
    """A schedule configuration to compare.

    Attributes:
        label: the name in tables and plots.
        forward, backward, max_inflight: the :class:`PrefetchPolicy` fields.
        reshard_after_forward: free non-root units after forward.
        depth: explicit prefetch lists this many units deep (:func:`prefetch_ahead`); 1: the
            implicit policy alone.
    """

    label: str
    forward: bool = True
    backward: bool = True
    max_inflight: int = 2
    reshard_after_forward: bool = True
    depth: int = 1

    def policy(self) -> PrefetchPolicy:
        """The runtime's :class:`PrefetchPolicy` of this setting (explicit lists aside)."""
        return PrefetchPolicy(self.forward, self.backward, self.max_inflight)

    def simulate_kwargs(self, model: Model) -> dict:
        """The :func:`simulate` keyword arguments of this setting for ``model``."""
        kwargs = {"policy": self.policy(),
                  "reshard_after_forward": self.reshard_after_forward, "label": self.label}
        fwd, bwd = prefetch_ahead(model, self.depth) if self.depth > 1 else ({}, {})
        if fwd:
            kwargs["forward_prefetch"] = fwd
        if bwd:
            kwargs["backward_prefetch"] = bwd
        return kwargs


SETTINGS: tuple[Setting, ...] = (
    Setting("no prefetch", forward=False, backward=False),
    Setting("backward only", forward=False),
    Setting("fwd+bwd (default)"),
    Setting("fwd+bwd, 2 deep, max_inflight 1", depth=2, max_inflight=1),
    Setting("fwd+bwd, 2 deep, max_inflight 2", depth=2, max_inflight=2),
    Setting("fwd+bwd, reshard_after_forward=False", reshard_after_forward=False),
)


def compare_settings(model: Model, world_size: int, link: "Link | str",
                     settings: Sequence[Setting] = SETTINGS, **kwargs) -> list[Prediction]:
    """:func:`simulate` under every setting (other keyword arguments passed through)."""
    return [simulate(model, world_size, link, **s.simulate_kwargs(model), **kwargs) for s in settings]
