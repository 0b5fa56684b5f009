"""The event engine of the overlap simulator: a compute stream and FIFO side streams on one clock.

A collective issued at compute time t starts at t or when its stream is free, whichever is later
(the runtime makes the side stream wait on the compute stream before it enqueues), and lasts the
ring cost of :mod:`flashfsdp.sim.link` (Thakur, Rabenseifner & Gropp 2005; Patarasuk & Yuan 2009).
A wait blocks the compute stream until the collective ends; that blocked time is the **exposed**
communication. With ``share_link`` an all-gather and a reduce-scatter that overlap split the
link's bandwidth evenly (one NIC per rank), which the default (each collective at full bandwidth)
does not. A :class:`~flashfsdp.sim.contention.Contention` makes compute and an in-flight collective
slow each other down, as they do on a CPU host where gloo's thread and the compute thread share the
cores: without it, overlapped communication is free for compute, which on a GPU is close to true
and on 2 CPU cores for 2 ranks is not.

The engine knows nothing of units or of the runtime's step: :mod:`flashfsdp.sim.replay` drives it.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass

from .contention import Contention

EPS = 1e-15  # relative tolerance of the engine's clock


@dataclass
class Span:
    """One interval of the simulated timeline (seconds from the start of the predicted step)."""

    stream: str  # "compute", "all_gather", "reduce_scatter" (or "comm" when shared)
    kind: str  # "forward", "backward", "loss", "optimizer", "copy_in", "wait_all_gather", ...
    unit: str
    start: float
    end: float


@dataclass(eq=False)
class CommOp:
    """A collective on a side stream: phases of [seconds left, uses the link, is the collective]
    (a GPU copy-in phase is not: host contention does not slow it). Its collective phases cannot
    start before ``ready`` and it cannot end before ``done_after`` (when a peer rank issues it
    later or finishes it later: see :func:`~flashfsdp.sim.simulate.simulate_ranks`)."""

    stream: str
    kind: str
    unit: str
    issue: float
    phases: list
    ready: float = -math.inf
    done_after: float = -math.inf
    start: float | None = None
    end: float | None = None


class CommEngine:
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

    def issue(self, op: CommOp) -> None:
        """Enqueue ``op`` (issued now) on its stream."""
        self.queues.setdefault(op.stream, collections.deque()).append(op)
        self._retire()

    def compute(self, seconds: float, contended: bool = True) -> float:
        """Run ``seconds`` of compute on the compute stream from now; returns when it ends.
        ``contended=False``: the stream is busy but not computing (a collective on the compute path,
        tensor parallelism's): host contention slows neither it nor the side streams."""
        work = seconds
        while work > EPS * max(1.0, self.now):
            work -= self._step(work, contended)
        return self.now

    def finish(self, op: CommOp) -> float:
        """When ``op`` ends, the compute stream blocked until then (no op issued later can delay it)."""
        while op.end is None:
            self._step(None)
        return op.end

    def started(self, op: CommOp) -> float:
        """When ``op`` starts, the compute stream blocked until then."""
        while op.start is None:
            self._step(None)
        return op.start

    def drain(self) -> None:
        """Run every stream empty (the compute stream idle)."""
        while any(self.queues.values()):
            self._step(None)

    def _can_run(self, op: CommOp) -> bool:
        """A local phase (GPU copy-in) runs at once; a collective phase once every rank issued it;
        an op with no phase left ends once every rank finished it."""
        tol = EPS * max(1.0, self.now)
        if not op.phases:
            return op.done_after <= self.now + tol
        return not op.phases[0][2] or op.ready <= self.now + tol

    def _until_runnable(self, op: CommOp) -> float:
        return (op.done_after if not op.phases else op.ready) - self.now

    def _heads(self) -> tuple[list[CommOp], list[CommOp]]:
        """(heads that run, heads whose collective waits for a peer rank), starting the former."""
        heads = [q[0] for q in self.queues.values() if q]
        running = [h for h in heads if self._can_run(h)]
        for h in running:
            if h.start is None:
                h.start = self.now
        return running, [h for h in heads if not self._can_run(h)]

    def _step(self, work: float | None, contended: bool = True) -> float:
        """Advance to the next event: a phase ends, a head becomes ready, or (``work`` given: the
        compute stream busy, computing unless ``contended`` is False) the compute ends. Returns the
        compute seconds done."""
        heads, waiting = self._heads()
        heads = [h for h in heads if h.phases]
        on_link = sum(1 for h in heads if h.phases[0][1])
        computing = work is not None
        slowed = [h for h in heads if h.phases[0][2]] if computing and contended and self.contention is not None else []
        rates = []
        for h in heads:
            rate = 1.0 / on_link if self.share_link and on_link > 1 and h.phases[0][1] else 1.0
            if h in slowed:
                rate *= self.contention.rates(h.kind)[1]
            rates.append(rate)
        compute_rate = min((self.contention.rates(h.kind)[0] for h in slowed), default=1.0)
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
        tol = EPS * max(1.0, self.now)
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
