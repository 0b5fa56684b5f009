"""The public entry points of the overlap simulator: predict one training step of one rank
(:func:`simulate`) or of several ranks coupled by their collectives (:func:`simulate_ranks`).

Both replay the runtime's own step (:mod:`flashfsdp.sim.replay`, see [Note: the step the simulator
replays] there) on the event engine of :mod:`flashfsdp.sim.engine`, and report the last simulated
step as a :class:`Prediction`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from flashfsdp.runtime.schedule import PrefetchPolicy

from .contention import Contention
from .engine import EPS, Span
from .hierarchy import Hierarchy
from .link import Link, check_world_size, get_link
from .model import Model
from .replay import ReplayOptions, StepReplay

__all__ = ["Prediction", "Span", "simulate", "simulate_ranks"]


@dataclass
class Prediction:
    """The simulator's prediction for one step (times in seconds, sizes in bytes).

    Attributes:
        world_size: W (all ranks; under HSDP R·S; with tensor parallelism dp·tp).
        link: the link's name (a :class:`~flashfsdp.sim.hierarchy.Hierarchy`'s: both links; with
            tensor parallelism the TP link's after " + TP ").
        label: the setting's label (see :data:`SETTINGS`), or "".
        step_s: step time: from the root's pre-forward to the end of the optimizer step.
        compute_s: pure compute of the step (every unit's forward and backward, loss, optimizer).
        exposed_s: time the compute stream waited on all-gathers and reduce-scatters.
        host_copy_s: copy-in run on the compute thread (``host_blocking`` with a copy bandwidth).
        all_gather_s: sum of the step's all-gather costs (ring model, full bandwidth).
        reduce_scatter_s: sum of the step's reduce-scatter costs.
        all_gathers: all-gather collectives issued in the step (a bucket's all-gather counts once
            per collective: one per ``param_bytes`` among its units, none on one rank; see
            ``units_gathered``).
        comm_busy_s: busy time of the step's communication as a trace records it: per kind
            (all-gather, reduce-scatter), the union of the collectives' [issue, completion]
            intervals (queueing behind earlier collectives and host contention included), summed
            over the two kinds, as ``Profile.summary()["comm_ms"]`` counts it.
        peak_bytes: peak memory per rank (see :mod:`flashfsdp.sim.replay`).
        sharded_bytes: the constant part of it, the sharded state.
        timeline: the step's spans when ``record_timeline`` was set.
        all_reduce_s: HSDP: sum of the step's all-reduces across replicas (ring model); 0 without.
        replicas: R, the replicas of each shard (1 without HSDP).
        all_gather_bytes_backward: bytes the step's backward all-gathers write (unsharded buffers).
        all_gather_bytes_elided: bytes of the backward all-gathers that elision skips (units with
            ``backward_reads_params=False``; :mod:`flashfsdp.sim.elision`).
        tp: the tensor-parallel degree (1: none).
        tp_comm_s: the TP collectives' time on the compute path (ring model on the TP link): part
            of ``step_s``, not of ``exposed_s``.
        collective_bytes: the step's bytes per rank by collective: "all_gather" (outputs),
            "reduce_scatter" (inputs), "all_reduce" (HSDP: the reduced shards) over the data-parallel
            ranks, and the same kinds prefixed "tp_" over the TP ranks.
        reduce_scatters: reduce-scatter collectives issued in the step (a bucket's counts once).
        all_reduces: HSDP: all-reduces across the replicas in the step (one per unit, in a
            bucket too, as the runtime issues them); 0 without.
        units_gathered: unit all-gathers in the step (a unit gathered in a bucket counts once;
            equal to ``all_gathers`` without buckets).
        bucket_bytes: the bucket size the step was replayed with (0: no buckets).
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
    all_reduce_s: float = 0.0
    replicas: int = 1
    all_gather_bytes_backward: int = 0
    all_gather_bytes_elided: int = 0
    tp: int = 1
    tp_comm_s: float = 0.0
    collective_bytes: dict = field(default_factory=dict)
    reduce_scatters: int = 0
    all_reduces: int = 0
    units_gathered: int = 0
    bucket_bytes: int = 0

    @property
    def collectives(self) -> int:
        """The FSDP collectives of the step: all-gathers, reduce-scatters and HSDP all-reduces (the
        TP collectives, on the compute path, not counted)."""
        return self.all_gathers + self.reduce_scatters + self.all_reduces

    @property
    def comm_s(self) -> float:
        """All communication of the step (seconds), overlapped or not (the TP collectives' too)."""
        return self.all_gather_s + self.reduce_scatter_s + self.all_reduce_s + self.tp_comm_s

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


def simulate(model: Model, world_size: int, link: "Link | str | Hierarchy", *, policy: PrefetchPolicy | None = None,
             reshard_after_forward: bool = True, forward_prefetch: Mapping[str, Sequence[str]] | None = None,
             backward_prefetch: Mapping[str, Sequence[str]] | None = None, shared_comm_stream: bool = False,
             share_link_bandwidth: bool = False, host_blocking: bool = False,
             copy_bandwidth: float | None = None, contention: Contention | None = None, steps: int = 2,
             record_timeline: bool = False, label: str = "", elide_backward_all_gather: bool = True,
             tp_link: "Link | str" = "nvlink", bucket_bytes: int = 0) -> Prediction:
    """Predict one training step of ``model`` on ``world_size`` ranks (the step replayed: see
    :mod:`flashfsdp.sim.replay`).

    Args:
        model: the units and their compute (seconds) and bytes (:mod:`flashfsdp.sim.model`).
        world_size: ranks W >= 1; a model built for ``tp`` > 1 (:mod:`flashfsdp.sim.tensor_parallel`)
            runs on a (W / tp, tp) layout: its units sharded over the W / tp data-parallel ranks.
        link: a :class:`~flashfsdp.sim.link.Link` or a name in :data:`~flashfsdp.sim.link.LINKS`
            (the data-parallel ranks' link); or a :class:`~flashfsdp.sim.hierarchy.Hierarchy` for
            HSDP (units sharded over its ``shard_size`` ranks on its shard link, each reduced shard
            all-reduced across the W / S replicas on its replicate link; not with tensor parallelism).
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
        elide_backward_all_gather: skip the backward all-gather of units whose backward reads no
            parameter (``Unit.backward_reads_params``), as the runtime does by default.
        tp_link: the link of the tensor-parallel collectives (a model with ``tp`` > 1): a Link or
            a name of ``LINKS`` (default "nvlink": a TP group within a node).
        bucket_bytes: the most bytes units that run back to back move in one shared all-gather or
            reduce-scatter ([Note: buckets in the replay]); 0 here: none. The runtime's default is
            ``runtime.step.DEFAULT_BUCKET_BYTES``.

    Returns:
        the last step's :class:`Prediction`.

    Raises:
        ValueError: W < 1, an unknown link name, a Hierarchy whose shard size does not divide W,
            a model's ``tp`` that does not divide W (or with a Hierarchy),
            steps < 1, a bad copy bandwidth, a ``contention`` that is not a Contention, an explicit
            prefetch list naming an unknown unit, or a negative ``bucket_bytes`` (the message names
            the argument). TypeError: ``bucket_bytes`` that is not an int.
    """
    link = _check_simulate_args(model, world_size, link, steps, copy_bandwidth, contention, forward_prefetch,
                                backward_prefetch)
    options = ReplayOptions(policy if policy is not None else PrefetchPolicy(), reshard_after_forward,
                            forward_prefetch, backward_prefetch, shared_comm_stream, share_link_bandwidth,
                            host_blocking, contention, bool(elide_backward_all_gather),
                            get_link(tp_link) if model.tp > 1 else None, bucket_bytes)
    return _prediction(_replay(model, world_size, link, options, steps, copy_bandwidth), label, record_timeline)


def _replay(model: Model, world_size: int, link: "Link | Hierarchy", options: ReplayOptions, steps: int,
            copy_bandwidth: float | None, peers: tuple = (None, None)) -> StepReplay:
    """``steps`` steps of one rank (``peers``: the other ranks' issue and end times, or None)."""
    world_size //= model.tp  # the data-parallel ranks (the TP collectives are the units' ``tp_ops``)
    replicate = None
    if isinstance(link, Hierarchy):  # shard over S ranks on the shard link, all-reduce across R
        world_size, link, replicate = link.shard_size, link.shard_link, (link.replicate_link, link.replicas(world_size))
    replay = StepReplay(model, world_size, link, options, copy_bandwidth, *peers, replicate=replicate)
    for _ in range(steps):
        replay.step()
    return replay


def _check_simulate_args(model, world_size, link, steps, copy_bandwidth, contention, forward_prefetch,
                         backward_prefetch) -> "Link | Hierarchy":
    """The checks of :func:`simulate` (raising ValueError naming the argument); returns the Link
    (or the Hierarchy)."""
    check_world_size(world_size)
    if not isinstance(model, Model):
        raise ValueError(f"model must be a flashfsdp.sim.Model, got {type(model).__name__}")
    if world_size % model.tp:
        raise ValueError(f"world_size {world_size} is not a multiple of the model's tp {model.tp}: a (dp, tp) "
                         "layout needs dp x tp ranks")
    if isinstance(link, Hierarchy):
        if model.tp > 1:
            raise ValueError("link: a Hierarchy (HSDP) with tensor parallelism is not modelled; pass the "
                             "data-parallel ranks' Link")
        link.replicas(world_size)
    else:
        link = get_link(link)
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


def _prediction(runtime: StepReplay, label: str, record_timeline: bool) -> Prediction:
    """The prediction of the last step ``runtime`` replayed."""
    model, world_size = runtime.model, runtime.W  # (the shard group's under HSDP)
    sharded = sum(u.sharded_state_bytes(world_size) for u in model.units)
    link = runtime.link.name if runtime.replicas == 1 else f"{runtime.link.name} / {runtime.replicate_link.name}"
    link += f" + TP {runtime.options.tp_link.name}" if model.tp > 1 else ""
    return Prediction(
        world_size=world_size * runtime.replicas * model.tp, link=link, label=label, step_s=runtime.t - runtime.step_start,
        compute_s=model.compute_s(), exposed_s=runtime.exposed, host_copy_s=runtime.host_copy,
        all_gather_s=runtime.ag_cost, reduce_scatter_s=runtime.rs_cost, all_gathers=runtime.n_ag,
        comm_busy_s=runtime.comm_busy(),
        peak_bytes=sharded + runtime.peak_step_bytes(), sharded_bytes=sharded,
        timeline=runtime.timeline() if record_timeline else [], all_reduce_s=runtime.ar_cost,
        replicas=runtime.replicas, all_gather_bytes_backward=runtime.ag_bytes["backward"],
        all_gather_bytes_elided=runtime.ag_bytes["elided"], tp=model.tp, tp_comm_s=runtime.tp_cost,
        collective_bytes=dict(runtime.bytes), reduce_scatters=runtime.n_rs, all_reduces=runtime.n_ar,
        units_gathered=runtime.units_gathered, bucket_bytes=runtime.options.bucket_bytes,
    )


def _not_later(new, old) -> bool:
    """Whether no time in ``new`` is later than the same one in ``old`` (None: not yet known)."""
    return old is not None and all(b <= a + 1e-12 + EPS * abs(a) for a, b in zip(old, new))


def simulate_ranks(models: Sequence[Model], world_size: int, link: "Link | str | Hierarchy", *,
                   policy: PrefetchPolicy | None = None, reshard_after_forward: bool = True,
                   forward_prefetch: Mapping[str, Sequence[str]] | None = None,
                   backward_prefetch: Mapping[str, Sequence[str]] | None = None, shared_comm_stream: bool = False,
                   share_link_bandwidth: bool = False, host_blocking: bool = False,
                   copy_bandwidth: "float | None | Sequence[float | None]" = None,
                   contention: Contention | None = None, steps: int = 2, record_timeline: bool = False,
                   label: str = "", tp_link: "Link | str" = "nvlink", bucket_bytes: int = 0) -> list[Prediction]:
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
        world_size, link, policy, bucket_bytes, ...: as :func:`simulate` (every rank takes the same
            bucket decisions: they depend on the units and the order only).

    Returns:
        one :class:`Prediction` per rank, in the order of ``models``.

    Raises:
        ValueError: no models, more models than ``world_size``, ranks whose units differ, a list of
            copy bandwidths of the wrong length, or any error of :func:`simulate`.
    """
    models = list(models)
    copies = _check_ranks(models, world_size, copy_bandwidth)
    link = _check_simulate_args(models[0], world_size, link, steps, copies[0], contention, forward_prefetch,
                                backward_prefetch)
    for c in copies[1:]:
        _check_simulate_args(models[0], world_size, link, steps, c, contention, None, None)
    options = ReplayOptions(policy if policy is not None else PrefetchPolicy(), reshard_after_forward,
                            forward_prefetch, backward_prefetch, shared_comm_stream, share_link_bandwidth,
                            host_blocking, contention, True, get_link(tp_link) if models[0].tp > 1 else None,
                            bucket_bytes)
    runs = _couple(lambda r, peers: _replay(models[r], world_size, link, options, steps, copies[r], peers),
                   len(models))
    return [_prediction(rt, label, record_timeline) for rt in runs]


def _check_ranks(models: list[Model], world_size: int, copy_bandwidth) -> list:
    """The checks of :func:`simulate_ranks` on its ranks; returns one copy bandwidth per model."""
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
    return copies


def _couple(run, n_ranks: int) -> list[StepReplay]:
    """Fixed-point iteration of :func:`simulate_ranks`: ``run(r, (peer_issues, peer_ends))`` replays
    rank r against the latest times the other ranks reached so far, until no time moves later."""
    peers: list = [(None, None)] * n_ranks
    rounds = 0
    while True:
        runs = [run(r, peers[r]) for r in range(n_ranks)]
        issues = [rt.issues for rt in runs]
        ends = [[op.end for op in rt.all_ops] for rt in runs]
        if len({len(i) for i in issues}) != 1:
            raise RuntimeError("simulate_ranks: the ranks issued different numbers of collectives")
        if n_ranks == 1:
            return runs
        latest = [tuple([max(times[q][i] for q in range(n_ranks) if q != r) for i in range(len(issues[0]))]
                        for times in (issues, ends)) for r in range(n_ranks)]
        if all(_not_later(new, old) for p, l in zip(peers, latest) for old, new in zip(p, l)):
            return runs
        rounds += 1
        if rounds > 4 * len(issues[0]) + 10:
            raise RuntimeError(f"simulate_ranks: the ranks' collective times did not converge in {rounds} rounds")
        # Never move a peer time earlier: the iteration is then monotone and settles even where host
        # contention makes it flip between two nearby solutions (it keeps the later one).
        peers = [tuple(new if old is None else [max(a, b) for a, b in zip(old, new)] for old, new in zip(p, l))
                 for p, l in zip(peers, latest)]
