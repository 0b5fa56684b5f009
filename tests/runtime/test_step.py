"""One step protocol, three drivers: the runtime (on tensors), the overlap simulator (on costs) and
the estimator (on bytes) run ``runtime/step.py``'s StepProtocol, and for the same model and
settings it takes the same actions in the same order: which unit is unsharded (alone or in a
bucket with others), waited for, prefetched, resharded (to the full shard or the post-forward
one), reduced (alone or in a bucket), and when the reductions finish. Compared on the steady step
(the second: the first records the order), with buckets off, at the runtime's default, and at
sizes that fit two units or all of them: the three drivers see the same bytes per unit (the
simulator's units are the estimator's layouts, which are the runtime's).

Also the protocol's decisions themselves, on a driver that only records (``Recorder``): the root
and the last block keep their parameters after forward by default, an explicit value is
followed exactly, ``reshard_after_backward=False`` keeps a unit gathered, a forward without
backward reshards what it gathered, and the rules of [Note: buckets] (``BucketRecorder``).
"""

from __future__ import annotations

import pytest
import torch

from flashfsdp.runtime.schedule import PrefetchPolicy
from flashfsdp.runtime.states import ShardState
from flashfsdp.runtime.step import (
    DEFAULT_BUCKET_BYTES,
    NOTHING,
    ReshardAfterForward,
    StepProtocol,
    UnitSettings,
    resolve_reshard_after_forward,
)

BLOCKS = 3
# Unsharded (all-gather) bytes at W = 1 in fp32: root 2112, each block 13,440; reduce-scatter
# inputs (the shard and a flag per parameter): root 2128, each block 13,488.
TWO_BLOCKS = 2 * 13_488  # fits the root and a block, or two blocks, not three units
EVERYTHING = 2**20
BUCKETS = [None, 0, TWO_BLOCKS, EVERYTHING]  # None: the runtime's default, not set


def _config():
    from flashfsdp.models import LlamaConfig  # noqa: PLC0415

    return LlamaConfig(dim=16, n_layers=BLOCKS, n_heads=2, multiple_of=8, max_seq_len=8, vocab_size=32)


def _name(key) -> object:
    """A runtime log key by unit name (a bucket's: the tuple of its names)."""
    if key is None:
        return None
    return tuple(k.unit.name for k in key) if isinstance(key, tuple) else key.unit.name


def _forward_of(log: list, root="root") -> list:
    """The actions of a logged step up to the root's pre-backward (its second wait)."""
    first = log.index(("wait", root))
    return log[: log.index(("wait", root), first + 1)]


def _runtime_log(reshard_after_forward, bucket_bytes=None) -> list:
    """Two steps of a tiny Llama (one unit per block and the root) in this process (W = 1); the
    protocol's log of the second, with units named as the runtime names them. ``bucket_bytes``
    None: the runtime's default."""
    import flashfsdp  # noqa: PLC0415
    from flashfsdp.models import Llama  # noqa: PLC0415

    torch.manual_seed(0)
    model = Llama(_config())
    for block in model.layers:
        flashfsdp.fully_shard(block, reshard_after_forward=reshard_after_forward)
    flashfsdp.fully_shard(model, reshard_after_forward=reshard_after_forward)
    if bucket_bytes is not None:
        model.set_bucket_bytes(bucket_bytes)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 32, (2, 8))
    log = None
    for step in range(2):
        if step == 1:
            ctx = model.__dict__["_flashfsdp_state"].ctx
            assert ctx.step.bucket_bytes == (DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes)
            ctx.step.log = log = []
        model(tokens).float().logsumexp(-1).mean().backward()
        optim.step()
        optim.zero_grad()
    return [(action, _name(key)) for action, key in log]


def _specs() -> list:
    """The estimator's units of the same Llama at W = 1 (the runtime's layouts)."""
    from flashfsdp.estimate.units import build_units  # noqa: PLC0415
    from flashfsdp.models import Llama  # noqa: PLC0415

    with torch.device("meta"):
        model = Llama(_config())
    return build_units(model, None, 1, None, None)


def _simulator_log(reshard: bool, bucket_bytes: int) -> list:
    from flashfsdp.sim.link import Link  # noqa: PLC0415
    from flashfsdp.sim.model import Model, Unit  # noqa: PLC0415
    from flashfsdp.sim.replay import ReplayOptions, StepReplay  # noqa: PLC0415

    root, *blocks = [Unit(s.name, s.numel, forward_s=1e-3, backward_s=2e-3, param_bytes=4, reduce_bytes=4,
                          flat_numel=sum(g.layout.gathered_size for g in s.groups),
                          reduce_numel=s.reduce_scatter_numel()) for s in _specs()]
    model = Model(root=root, blocks=tuple(blocks))
    replay = StepReplay(model, 1, Link("test link", alpha_s=1e-6, bandwidth=1e9),
                        ReplayOptions(PrefetchPolicy(), reshard_after_forward=reshard, bucket_bytes=bucket_bytes),
                        log=True)
    replay.step()
    replay.step_protocol.log.clear()
    replay.step()
    return replay.step_protocol.log


def _estimator_log(reshard_after_forward, bucket_bytes: int) -> list:
    from flashfsdp.estimate.replay import StepWalk  # noqa: PLC0415

    specs = _specs()
    resolved = resolve_reshard_after_forward(reshard_after_forward, 1)
    walk = StepWalk(specs, {s.name: resolved for s in specs}, 1, max_inflight=2, log=True, bucket_bytes=bucket_bytes)
    walk.run_step()
    walk.step.log.clear()
    walk.run_step()
    return walk.step.log


def test_the_drivers_see_the_same_bytes_per_unit():
    """What the comparison rests on: the runtime's bucket classes and bytes are the estimator's
    and the simulator's."""
    import flashfsdp  # noqa: PLC0415
    from flashfsdp.estimate.replay import StepWalk  # noqa: PLC0415
    from flashfsdp.models import Llama  # noqa: PLC0415
    from flashfsdp.runtime import bucket  # noqa: PLC0415

    model = Llama(_config())
    for block in model.layers:
        flashfsdp.fully_shard(block)
    flashfsdp.fully_shard(model)
    units = {name: module.__dict__["_flashfsdp_state"].unit
             for name, module in zip(["<root>", *(f"layers.{i}" for i in range(BLOCKS))], [model, *model.layers])}
    runtime = {name: (bucket.all_gather_class(u)[1], bucket.reduce_class(u)[1]) for name, u in units.items()}
    assert runtime == {"<root>": (2112, 2128), **{f"layers.{i}": (13_440, 13_488) for i in range(BLOCKS)}}
    assert len({bucket.all_gather_class(u)[0] for u in units.values()}) == 1  # one class (W = 1)
    specs = _specs()
    walk = StepWalk(specs, {s.name: resolve_reshard_after_forward(None, 1) for s in specs}, 1, 2, bucket_bytes=1)
    assert {s.name: (walk.all_gather_bucket(s.name)[1], walk.reduce_scatter_bucket(s.name)[1]) for s in specs} == runtime


@pytest.mark.parametrize("bucket_bytes", BUCKETS)
@pytest.mark.parametrize("reshard_after_forward", [None, True, False])
def test_runtime_simulator_and_estimator_take_the_same_actions(reshard_after_forward, bucket_bytes):
    runtime = _runtime_log(reshard_after_forward, bucket_bytes)
    size = DEFAULT_BUCKET_BYTES if bucket_bytes is None else bucket_bytes
    estimator = _estimator_log(reshard_after_forward, size)
    assert runtime == estimator
    if reshard_after_forward in (None, False):  # the simulator models the default and False
        assert runtime == _simulator_log(reshard_after_forward is None, size)
    forward = _forward_of(runtime, "<root>")
    # the default keeps the root and the last block for backward; an explicit True does not
    resharded_in_forward = {k for a, k in forward if a.startswith("reshard")}
    kept = {"<root>", f"layers.{BLOCKS - 1}"} - resharded_in_forward
    if reshard_after_forward is None:
        assert kept == {"<root>", f"layers.{BLOCKS - 1}"}
    gathered = [k for a, k in runtime if a == "unshard_together"]
    reduced = [k for a, k in runtime if a == "reduce_together"]
    if size == 0:
        assert not gathered and not reduced
    if size == TWO_BLOCKS:  # the root with the first block, then the two others
        assert gathered[:2] == [("<root>", "layers.0"), ("layers.1", "layers.2")]
        # nothing is expected after the first block: its bucket waits for the root's reduction
        assert reduced == [("layers.2", "layers.1"), ("layers.0", "<root>")]
    if size >= EVERYTHING:  # the whole forward in one all-gather, every block's reduction in one
        assert gathered[0] == ("<root>", *(f"layers.{i}" for i in range(BLOCKS)))
        # every reduction in one, the root's (at the backward's end) with the blocks'
        assert reduced == [(*(f"layers.{i}" for i in reversed(range(BLOCKS))), "<root>")]


class Recorder:
    """A driver that only records: every unit starts sharded; nothing is stale."""

    def __init__(self, names, settings=None):
        self.names = list(names)
        self.state = {n: ShardState.SHARDED for n in self.names}
        self._settings = settings or {n: UnitSettings() for n in self.names}

    def keys(self):
        return self.names

    def settings(self, name):
        return self._settings[name]

    def shard_state(self, name):
        return self.state[name]

    def unshard(self, name):
        self.state[name] = ShardState.UNSHARDED

    def wait_unshard(self, name):
        self.state[name] = ShardState.UNSHARDED

    def reshard(self, name, to_secondary=False):
        self.state[name] = ShardState.SHARDED

    def reduce(self, name):
        pass

    def finish_reductions(self):
        pass

    def is_stale(self, name):
        return self.state[name] is not ShardState.SHARDED

    def skips_backward_unshard(self, name):
        return False

    def prefetches_in_backward(self, name):
        return True


def _forward(step: StepProtocol, names, backward_follows=True) -> None:
    step.start_step(names)
    step.pre_forward(names[0])
    for name in names[1:]:
        step.pre_forward(name)
        step.post_forward(name, backward_follows)
    step.post_forward(names[0], backward_follows)


def test_explicit_values_are_followed_and_a_forward_without_backward_reshards():
    names = ["root", "a", "b"]
    explicit = {n: UnitSettings(ReshardAfterForward(True, True)) for n in names}
    x = Recorder(names, explicit)
    step = StepProtocol("root", x, log=True)
    for _ in range(2):
        _forward(step, names)
    assert all(x.state[n] is ShardState.SHARDED for n in names)  # the root and "b" too: explicit
    x = Recorder(names)
    step = StepProtocol("root", x)
    _forward(step, names, backward_follows=False)
    assert all(x.state[n] is ShardState.SHARDED for n in names)


def test_reshard_after_backward_false_keeps_the_unit_gathered():
    names = ["root", "a"]
    settings = {"root": UnitSettings(), "a": UnitSettings(reshard_after_backward=False)}
    x = Recorder(names, settings)
    step = StepProtocol("root", x)
    _forward(step, names)
    for name in reversed(names):
        step.pre_backward(name)
        step.gradients_ready(name)
        step.backward_done(name)
    assert step.end_backward([], [], lambda n: False)
    assert x.state == {"root": ShardState.SHARDED, "a": ShardState.UNSHARDED}


# ---------------------------------------------------------------------------------------- buckets


class BucketRecorder(Recorder):
    """A recording driver that answers the bucket questions: each unit's all-gather and reduction
    class and bytes (default: class "c", 10 bytes), :data:`NOTHING` or None (alone) as given."""

    def __init__(self, names, gather=None, reduce=None, settings=None):
        super().__init__(names, settings)
        self.gather, self.reduces = dict(gather or {}), dict(reduce or {})

    def all_gather_bucket(self, name):
        assert self.state[name] is ShardState.SHARDED, name  # asked only of sharded units
        return self.gather.get(name, ("c", 10))

    def unshard_together(self, names):
        assert len(names) > 1 and all(self.state[n] is ShardState.SHARDED for n in names), names
        for name in names:
            self.state[name] = ShardState.UNSHARDING

    def reduce_scatter_bucket(self, name):
        return self.reduces.get(name, ("c", 10))

    def reduce_together(self, names):
        assert len(names) > 1, names


NAMES = ["root", "a", "b", "c", "d"]


def _backward(step: StepProtocol, names, skip=()) -> bool:
    """The root's backward, then the blocks' in reverse but ``skip``, then the root's gradients
    (last, as a Llama's embedding's); the final callback ends the skipped units (as the runtime's
    ``RootContext.end_backward``: the open bucket first)."""
    step.pre_backward(names[0])
    for name in reversed(names[1:]):
        if name not in skip:
            step.pre_backward(name)
            step.gradients_ready(name)
            step.backward_done(name)
    step.gradients_ready(names[0])
    step.backward_done(names[0])
    step.flush_reductions()
    return step.end_backward(list(skip), list(skip), lambda n: False)


def _steps(x: BucketRecorder, bucket_bytes: int, steps: int = 2, policy=None, names=NAMES) -> StepProtocol:
    """``steps`` steps of forward and backward; the protocol logs the last one."""
    step = StepProtocol(names[0], x, policy, bucket_bytes=bucket_bytes)
    for i in range(steps):
        step.log = [] if i == steps - 1 else None
        _forward(step, names)
        _backward(step, names)
    return step


def _actions(log, action: str) -> list:
    return [k for a, k in log if a == action]


def test_the_first_forward_goes_unit_by_unit_then_runs_share_an_all_gather_up_to_the_byte_limit():
    first = _steps(BucketRecorder(NAMES), bucket_bytes=30, steps=1).log
    forward = _forward_of(first)
    # no order recorded yet: each unit gathered alone at its own pre-forward
    assert not _actions(forward, "unshard_together") and _actions(forward, "unshard") == NAMES
    log = _steps(BucketRecorder(NAMES), bucket_bytes=30).log
    # 30 bytes: three units of 10; the backward gathers the blocks after the last (kept) one
    assert _actions(log, "unshard_together") == [("root", "a", "b"), ("c", "d"), ("c", "b", "a")]
    assert not _actions(log, "unshard")
    # nothing is expected after "a": its bucket waits for the root's reduction, at the backward's end
    assert [(a, k) for a, k in log if a.startswith("reduce")] == [
        ("reduce_together", ("d", "c", "b")), ("reduce_together", ("a", "root"))]


def test_a_run_ends_at_a_unit_of_another_class_or_alone_and_passes_over_units_with_nothing():
    x = BucketRecorder(NAMES, gather={"b": ("other", 10), "d": None})
    log = _steps(x, bucket_bytes=100).log
    forward = _forward_of(log)
    assert _actions(forward, "unshard_together") == [("root", "a")]  # "b" is of another class
    # "b" leads no run ("c" is of another class than it), "c" neither ("d" must go alone)
    assert _actions(forward, "unshard") == ["b", "c", "d"]
    x = BucketRecorder(NAMES, gather={"b": NOTHING})
    log = _steps(x, bucket_bytes=100).log
    # "b" has nothing to gather: not in the bucket, not its end; the backward bucket skips it too
    assert _actions(log, "unshard_together") == [("root", "a", "c", "d"), ("c", "a")]
    assert _actions(log, "reduce_together") == [("d", "c", "b", "a", "root")]


def test_a_run_passes_over_units_already_unsharded():
    x = BucketRecorder(NAMES)
    step = _steps(x, bucket_bytes=100, steps=1)
    step.log = []
    step.start_step(NAMES)
    x.state["b"] = ShardState.UNSHARDED  # e.g. gathered by the user's unshard()
    step.pre_forward("root")
    assert step.log[1:3] == [("unshard_together", ("root", "a", "c", "d")), ("wait", "root")]


def test_explicit_prefetch_lists_gather_alone():
    explicit = {n: UnitSettings() for n in NAMES}
    explicit["root"].forward_prefetch = ["b"]
    x = BucketRecorder(NAMES, gather={"root": None}, settings=explicit)
    log = _steps(x, bucket_bytes=100).log
    forward = _forward_of(log)
    # the root alone (None), "b" alone (explicit), then "a" with the rest but "b" (gathered)
    assert [(a, k) for a, k in forward if a.startswith("unshard")] == [
        ("unshard", "root"), ("unshard", "b"), ("unshard_together", ("a", "c", "d"))]
    implicit = BucketRecorder(NAMES, gather={"root": None})
    log = _steps(implicit, bucket_bytes=100).log
    forward = _forward_of(log)
    assert [(a, k) for a, k in forward if a.startswith("unshard")] == [
        ("unshard", "root"), ("unshard_together", ("a", "b", "c", "d"))]


@pytest.mark.parametrize("max_inflight, prefetched", [(1, False), (2, True)])
def test_the_units_gathered_together_count_as_one_prefetch(max_inflight, prefetched):
    """The root's bucket leaves "a" and "b" prefetched: one all-gather in flight, so with
    max_inflight 2 the root's explicit target "d" still has room (with 1 it has none)."""
    settings = {n: UnitSettings() for n in NAMES}
    settings["root"].forward_prefetch = ["d"]
    x = BucketRecorder(NAMES, settings=settings)
    step = _steps(x, bucket_bytes=30, steps=1, policy=PrefetchPolicy(max_inflight=max_inflight))
    step.log = []
    step.start_step(NAMES)
    step.pre_forward("root")
    assert step.log[1] == ("unshard_together", ("root", "a", "b"))
    assert step.prefetched >= {"a", "b"}
    assert (("unshard", "d") in step.log) is prefetched


def test_reductions_flush_when_the_next_does_not_fit_or_is_of_another_class():
    def reductions(log):
        return [(a, k) for a, k in log if a.startswith("reduce")]

    # d + c fit in 25 bytes, b would not; "b" is of another class than "a" after it: alone. "a"
    # is the last block: none is expected after it, so its bucket stays open for the root's
    # gradients, which come at the end of the backward
    x = BucketRecorder(NAMES, reduce={"b": ("other", 10)})
    assert reductions(_steps(x, bucket_bytes=25).log) == [
        ("reduce_together", ("d", "c")), ("reduce", "b"), ("reduce_together", ("a", "root"))]
    # "c" must reduce alone: the bucket of "d" is issued before it
    x = BucketRecorder(NAMES, reduce={"c": None})
    assert reductions(_steps(x, bucket_bytes=100).log) == [
        ("reduce", "d"), ("reduce", "c"), ("reduce_together", ("b", "a", "root"))]
    # "c" reduces nothing: it neither joins nor ends the bucket
    x = BucketRecorder(NAMES, reduce={"c": NOTHING})
    assert reductions(_steps(x, bucket_bytes=100).log) == [("reduce_together", ("d", "b", "a", "root"))]


def test_the_open_bucket_is_issued_at_the_end_of_the_backward_and_before_finishing():
    x = BucketRecorder(NAMES)
    step = _steps(x, bucket_bytes=100, steps=1)
    _forward(step, NAMES)
    step.log = []
    # "a" and "b" run no backward: the bucket "d" and "c" opened (expecting "b") takes the root's
    # reduction and is issued by the final callback; there "a" and "b" reduce in a bucket of their
    # own (after them no unit that has not reduced is expected), issued by end_backward before the
    # reductions finish
    assert _backward(step, NAMES, skip=("a", "b"))
    reductions = [(a, k) for a, k in step.log if a.startswith("reduce") or a == "finish_reductions"]
    assert reductions == [("reduce_together", ("d", "c", "root")), ("reduce_together", ("a", "b")),
                          ("finish_reductions", None)]
    step.gradients_ready("d")  # a reduction left open (a driver's own call) ...
    step.log = []
    step.finish_reductions()  # ... is issued before the reductions finish
    assert step.log == [("reduce", "d"), ("finish_reductions", None)]


def test_units_gathered_together_that_never_run_are_resharded():
    x = BucketRecorder(NAMES)
    step = _steps(x, bucket_bytes=100)
    step.log = []
    step.start_step(NAMES)
    step.pre_forward("root")
    step.pre_forward("a")
    step.post_forward("a", backward_follows=False)  # the forward takes another branch: no c, d ...
    step.post_forward("root", backward_follows=False)
    assert step.log[1] == ("unshard_together", ("root", "a", "b", "c", "d"))
    assert set(_actions(step.log, "reshard")) == set(NAMES)  # ... b, c and d resharded with the root
    assert all(s is ShardState.SHARDED for s in x.state.values()) and not step.prefetched
    # with a backward: the end of the backward reshards them
    x = BucketRecorder(NAMES)
    step = _steps(x, bucket_bytes=100)
    step.start_step(NAMES)
    step.pre_forward("root")
    step.pre_forward("a")
    step.post_forward("a")
    step.post_forward("root")
    assert step.prefetched == {"b", "c", "d"}
    step.log = []
    assert _backward(step, ["root", "a"])
    assert set(_actions(step.log, "reshard")) == set(NAMES) and not step.prefetched
    assert all(s is ShardState.SHARDED for s in x.state.values())
