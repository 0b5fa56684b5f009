"""The collectives of the simulator's replay (:mod:`flashfsdp.sim.replay`) on the event engine:
a unit's all-gather or a bucket's, the reductions (a unit's or a bucket's reduce-scatter, HSDP's
all-reduces), and the memory they hold.

[Note: buckets in the replay]
With ``ReplayOptions.bucket_bytes`` > 0 (``simulate(..., bucket_bytes=...)``; the runtime's default
is ``runtime/step.py``'s ``DEFAULT_BUCKET_BYTES``, the replay's 0 keeps predictions unit by unit)
the protocol shares collectives between units that run back to back ([Note: buckets] there), and
the replay runs them as ``runtime/bucket.py`` does. Which may share: every unit of the replay is
of one all-gather class (one communicator, one device) except units with ``all_gather_bytes`` (int8
all-gathers), which go alone; reductions share by their dtype (``reduce_bytes``); units without
parameters neither join nor end a bucket. A bucket all-gather is one copy-in of the units' shards
and one collective of their summed bytes per ``param_bytes`` among them (one latency each: that is
what buckets save), issued once; every unit of it is UNSHARDING on that one op from the issue,
its unsharded parameters allocated then, and the waits of the later units find it done or wait on
the same op. Beside them the bucket's gathered buffer (their unsharded bytes) is alive from the
issue to the copy-out at the first wait. On one rank there is nothing to gather (the copy-in
casts the shards into place): no all-gather, no gathered buffer. A bucket reduction is one
reduce-scatter of the summed bytes; under HSDP each unit's shard is then all-reduced on its own
(one all-reduce per unit, as the runtime issues one per group); its buffers (packed input and
reduced shards) are alive until the reductions finish, and each unit's unsharded gradients from
its backward until the bucket is packed. ``Prediction.all_gathers`` / ``reduce_scatters`` /
``all_reduces`` count collectives (a bucket's once), ``units_gathered`` the unit all-gathers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from flashfsdp.runtime.states import ShardState
from flashfsdp.runtime.step import NOTHING

from .engine import CommOp

COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass(eq=False)
class GatherBucket:
    """A bucket all-gather in flight: its collectives (one per ``param_bytes``, issued back to
    back on one FIFO, so the last ends last; on one rank only the copy-in, if it takes time) and
    the memory id of its gathered buffer, alive from the issue to the copy-out at the first wait
    of any of its units (0 once freed, or none)."""

    ops: list
    gathered_mem: int


def bucket_label(names: Sequence[str]) -> str:
    """The name of a bucket's collective in timelines, as the runtime's ``bucket.bucket_name``:
    ``"a .. c (3 units)"``; one unit's name for one unit."""
    return f"{names[0]} .. {names[-1]} ({len(names)} units)" if len(names) > 1 else names[0]


class ReplayCollectives:
    """The replay's collectives and the driver's bucket questions (the step protocol's
    :class:`~flashfsdp.runtime.step.StepExecutor` methods on collectives), a part of
    :class:`~flashfsdp.sim.replay.StepReplay`, whose state they use: ``states``, ``W``, ``link``,
    ``options``, ``copy_bandwidth``, ``replicate_link`` / ``replicas``, the engine and clock
    (``engine``, ``t``, ``_compute``, ``_wait``), the step's records (``ops``, ``all_ops``,
    ``issues``, ``peer_issues`` / ``peer_ends``, ``mem``, the costs, counts and bytes) and the
    reductions in flight (``pending``, ``held``)."""

    def _issue(self, kind: str, name: str, phases: list, stream: str | None = None) -> CommOp:
        """Issue a collective now; with peers, its collective phases wait until every rank issued it."""
        n = len(self.issues)
        self.issues.append(self.t)
        ready = self.t
        if self.peer_issues is not None and n < len(self.peer_issues):
            ready = max(ready, self.peer_issues[n])
        done_after = self.peer_ends[n] if self.peer_ends is not None and n < len(self.peer_ends) else -math.inf
        stream = "comm" if self.options.shared_comm_stream else stream or kind
        op = CommOp(stream, kind, name, self.t, phases, ready=ready, done_after=done_after)
        self.engine.issue(op)
        self.ops.append(op)
        self.all_ops.append(op)
        return op

    def _collective_phases(self, kind: str, cost: float) -> list:
        latency = min(cost, self.link.latency_s(self.W, kind))
        return [[latency, False, True], [cost - latency, True, True]]

    # -------------------------------------------------------------- all-gathers
    def unshard_together(self, names: Sequence[str]) -> None:
        """Issue one all-gather for the units ``names`` (all sharded; [Note: buckets]): one copy-in
        of their shards, one collective per ``param_bytes`` among them, of their summed bytes (one
        latency each); every unit's unsharded parameters allocated now, UNSHARDING on the last of
        the collectives. Several units also allocate the bucket's gathered buffer (their unsharded
        bytes), freed at the copy-out of the first wait (``bucket.py``) — except on one rank, where
        the copy-in casts the shards straight into place: no all-gather, no gathered buffer."""
        states = [self.states[name] for name in names]
        direct = self.W == 1 and len(states) > 1
        nbytes = sum(st.unit.unsharded_bytes(self.W) for st in states)
        label = bucket_label(names)
        copy_s = nbytes / self.W / self.copy_bandwidth if self.copy_bandwidth else 0.0  # this rank's shards
        copy_phase = []
        if copy_s and self.options.host_blocking:
            self._compute(copy_s, "copy_in", label)
            self.host_copy += copy_s
        elif copy_s:
            copy_phase = [[copy_s, False, False]]
        for st in states:
            st.unsharded_mem = self.mem.alloc(self.t, st.unit.unsharded_bytes(self.W))
        gathered = self.mem.alloc(self.t, nbytes) if len(states) > 1 and not direct else 0
        by_dtype: dict[int, list] = {}
        for st in states:
            by_dtype.setdefault(st.unit.param_bytes, []).append(st)
        ops = [self._issue("copy_in", label, copy_phase, stream="all_gather")] if direct and copy_phase else []
        for part in [] if direct else by_dtype.values():
            wire = sum(st.unit.all_gather_bytes_total(self.W) for st in part)
            cost = self.link.unit_all_gather_s(wire, sum(st.unit.unsharded_bytes(self.W) for st in part), self.W,
                                               self.phase)
            ops.append(self._issue("all_gather", label, copy_phase + self._collective_phases("all_gather", cost)))
            copy_phase = []
            self.ag_cost += cost
            self.n_ag += 1
            self.bytes["all_gather"] += wire
        bucket = GatherBucket(ops, gathered) if len(states) > 1 else None
        for st in states:
            st.op, st.bucket, st.shard = ops[-1] if ops else None, bucket, ShardState.UNSHARDING
        self.units_gathered += len(states)
        self.ag_bytes[self.phase] += nbytes

    def all_gather_bucket(self, name: str):
        """As the runtime's ``bucket.all_gather_class``: every unit of the replay is of one class
        (one communicator, one device), ``(class, unsharded bytes)``; :data:`NOTHING` for a unit
        without parameters; None (alone) for a unit all-gathered in another format
        (``Unit.all_gather_bytes``: int8)."""
        unit = self.states[name].unit
        if unit.numel == 0:
            return NOTHING
        if unit.all_gather_bytes is not None:
            return None
        return "all_gather", unit.unsharded_bytes(self.W)

    def reduce_scatter_bucket(self, name: str):
        """As the runtime's ``bucket.reduce_class``: ``(class, reduce-scatter input bytes)``, the
        class being the reduction's dtype (its bytes per element: the divide factors follow from
        it); :data:`NOTHING` for a unit without parameters."""
        unit = self.states[name].unit
        if unit.numel == 0:
            return NOTHING
        return ("reduce_scatter", unit.reduce_bytes or unit.param_bytes), unit.reduce_bytes_total(self.W)

    def reduce_together(self, names: Sequence[str]) -> None:
        self.reduce_grads(*names)

    # -------------------------------------------------------------- reductions
    def reduce_grads(self, *names: str) -> None:
        """Issue one reduce-scatter of the units' gradients (several: a bucket, [Note: buckets]),
        then finish the reductions issued before it."""
        units = [self.states[name].unit for name in names]
        # packed on the compute stream (GPU) or the host thread (CPU): the gradients are gone
        for name in names:
            self.mem.free(self.t, self.states[name].grads_mem)
        if not self.options.host_blocking and self.held is not None:
            # hold_until_passed: the compute stream waits for the previous reduce-scatter to end
            # (it has read the previous pack), see [Note: waiting on the previous reduce-scatter]
            self._wait(self.held)
        nbytes = sum(unit.reduce_bytes_total(self.W) for unit in units)
        cost = self.link.reduce_scatter_s(nbytes, self.W)
        op = self._issue("reduce_scatter", bucket_label(names), self._collective_phases("reduce_scatter", cost))
        self.rs_cost += cost
        self.n_rs += 1
        self.bytes["reduce_scatter"] += nbytes
        if not self.options.host_blocking:
            self.held = op
        if self.replicas > 1 and not self.options.host_blocking:
            for name in names:  # each unit's all-reduce, enqueued behind the reduce-scatter
                self.all_reduce(name)
        # packed input + reduced shards
        buffers = self.mem.alloc(self.t, nbytes + sum(unit.reduce_bytes_total(self.W) // self.W for unit in units))
        self.finish_pending()
        self.pending.append((op, buffers, list(names)))

    def all_reduce(self, name: str) -> CommOp:
        """HSDP: issue the all-reduce of the unit's reduced shard across the replicas, on the
        reduce-scatter stream (on the replicate link: it shares no bandwidth with the shard link)."""
        nbytes = self.states[name].unit.reduce_bytes_total(self.W) // self.W
        cost = self.replicate_link.all_reduce_s(nbytes, self.replicas)
        latency = min(cost, self.replicate_link.latency_s(self.replicas, "all_reduce"))
        self.ar_cost += cost
        self.n_ar += 1
        self.bytes["all_reduce"] += nbytes
        return self._issue("all_reduce", name, [[latency, False, True], [cost - latency, False, True]],
                           stream="reduce_scatter")

    def finish_pending(self) -> None:
        """Finish the reductions issued so far: on a CPU host the thread blocks on each (HSDP: then
        issues the all-reduce of each of its units and blocks on it); on a GPU only the
        reduce-scatter stream is ordered, and the buffers go back to the caching allocator (reused
        in stream order by the next pack)."""
        pending, self.pending = self.pending, []
        for op, buffers, names in pending:
            if self.options.host_blocking:
                self._wait(op)
                if self.replicas > 1:
                    for name in names:
                        self._wait(self.all_reduce(name))
            self.mem.free(self.t, buffers)
