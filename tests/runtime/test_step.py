"""One step protocol, three drivers: the runtime (on tensors), the overlap simulator (on costs) and
the estimator (on bytes) run ``runtime/step.py``'s StepProtocol, and for the same model and
settings it takes the same actions in the same order: which unit is unsharded, waited for,
prefetched, resharded (to the full shard or the post-forward one), reduced, and when the
reductions finish. Compared on the steady step (the second: the first records the order).

Also the protocol's decisions themselves, on a driver that only records (``Recorder``): the root
and the last block keep their parameters after forward by default, an explicit value is
followed exactly, ``reshard_after_backward=False`` keeps a unit gathered, and a forward without
backward reshards what it gathered.
"""

from __future__ import annotations

import pytest
import torch

from flashfsdp.runtime.schedule import PrefetchPolicy
from flashfsdp.runtime.states import ShardState
from flashfsdp.runtime.step import ReshardAfterForward, StepProtocol, UnitSettings, resolve_reshard_after_forward

BLOCKS = 3


def _runtime_log(reshard_after_forward) -> list:
    """Two steps of a tiny Llama (one unit per block and the root) in this process (W = 1); the
    protocol's log of the second, with units named as the runtime names them."""
    import flashfsdp  # noqa: PLC0415
    from flashfsdp.models import Llama, LlamaConfig  # noqa: PLC0415

    torch.manual_seed(0)
    model = Llama(LlamaConfig(dim=16, n_layers=BLOCKS, n_heads=2, multiple_of=8, max_seq_len=8, vocab_size=32))
    for block in model.layers:
        flashfsdp.fully_shard(block, reshard_after_forward=reshard_after_forward)
    flashfsdp.fully_shard(model, reshard_after_forward=reshard_after_forward)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens = torch.randint(0, 32, (2, 8))
    log = None
    for step in range(2):
        if step == 1:
            ctx = model.__dict__["_flashfsdp_state"].ctx
            ctx.step.log = log = []
        model(tokens).float().logsumexp(-1).mean().backward()
        optim.step()
        optim.zero_grad()
    return [(action, None if key is None else key.unit.name) for action, key in log]


def _names() -> list[str]:
    return ["<root>"] + [f"layers.{i}" for i in range(BLOCKS)]


def _simulator_log(reshard: bool) -> list:
    from flashfsdp.sim.link import Link  # noqa: PLC0415
    from flashfsdp.sim.model import Model, Unit  # noqa: PLC0415
    from flashfsdp.sim.replay import ReplayOptions, StepReplay  # noqa: PLC0415

    root, *blocks = [Unit(name, numel=1000, forward_s=1e-3, backward_s=2e-3) for name in _names()]
    model = Model(root=root, blocks=tuple(blocks))
    replay = StepReplay(model, 1, Link("test link", alpha_s=1e-6, bandwidth=1e9),
                        ReplayOptions(PrefetchPolicy(), reshard_after_forward=reshard), log=True)
    replay.step()
    replay.step_protocol.log.clear()
    replay.step()
    return replay.step_protocol.log


def _estimator_log(reshard_after_forward) -> list:
    from flashfsdp.estimate.replay import StepWalk  # noqa: PLC0415
    from flashfsdp.estimate.units import unit_spec  # noqa: PLC0415

    specs = [unit_spec(name, [torch.empty(4, 4, device="meta", requires_grad=True)], 1, None, None)
             for name in _names()]
    resolved = resolve_reshard_after_forward(reshard_after_forward, 1)
    walk = StepWalk(specs, {s.name: resolved for s in specs}, 1, max_inflight=2, log=True)
    walk.run_step()
    walk.step.log.clear()
    walk.run_step()
    return walk.step.log


@pytest.mark.parametrize("reshard_after_forward", [None, True, False])
def test_runtime_simulator_and_estimator_take_the_same_actions(reshard_after_forward):
    runtime = _runtime_log(reshard_after_forward)
    estimator = _estimator_log(reshard_after_forward)
    assert runtime == estimator
    if reshard_after_forward is None:  # the simulator models the default (not an explicit value)
        assert runtime == _simulator_log(True)
    # the default keeps the root and the last block for backward; an explicit True does not
    resharded_in_forward = {k for a, k in runtime[: runtime.index(("wait", "<root>"), 1)] if a.startswith("reshard")}
    kept = {"<root>", f"layers.{BLOCKS - 1}"} - resharded_in_forward
    if reshard_after_forward is None:
        assert kept == {"<root>", f"layers.{BLOCKS - 1}"}


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
