"""flashfsdp.sim.replay: the runtime's step replayed through the runtime's own state machines."""

from __future__ import annotations

from flashfsdp.runtime.schedule import PrefetchPolicy
from flashfsdp.runtime.states import ShardState, TrainingState
from flashfsdp.sim.replay import MemoryLog, ReplayOptions, StepReplay
from tests.sim.common import LINK, W
from tests.sim.common import model as _model


class _Recording(StepReplay):
    """Notes every unit's (ShardState, TrainingState) at the start of each compute span."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: dict[tuple[str, str], dict] = {}

    def _compute(self, seconds: float, kind: str, unit: str) -> None:
        self.seen[kind, unit] = {name: (st.shard, st.training) for name, st in self.states.items()}
        super()._compute(seconds, kind, unit)


def _second_step(**options) -> _Recording:
    replay = _Recording(_model(n_blocks=3, loss_s=0.001, optimizer_s=0.001), W, LINK,
                        ReplayOptions(PrefetchPolicy(), **options))
    replay.step()  # records the execution order
    replay.seen.clear()
    replay.step()
    return replay


def test_units_move_through_the_runtime_states():
    seen = _second_step().seen
    UNSHARDED, SHARDED = ShardState.UNSHARDED, ShardState.SHARDED
    during = seen["forward", "layers.1"]
    assert during["layers.1"] == (UNSHARDED, TrainingState.FORWARD)
    assert during["<root>"] == (UNSHARDED, TrainingState.FORWARD)  # the root's forward spans its blocks'
    assert during["layers.0"] == (SHARDED, TrainingState.IDLE)  # resharded after its forward
    assert during["layers.2"][0] is not SHARDED  # prefetched
    # the last block keeps its parameters for the backward (keep_for_backward)
    assert seen["loss", ""]["layers.2"] == (UNSHARDED, TrainingState.IDLE)
    assert seen["loss", ""]["layers.1"] == (SHARDED, TrainingState.IDLE)
    during = seen["backward", "layers.1"]
    assert during["layers.1"] == (UNSHARDED, TrainingState.PRE_BACKWARD)
    assert during["layers.2"] == (SHARDED, TrainingState.POST_BACKWARD)
    assert during["<root>"] == (UNSHARDED, TrainingState.PRE_BACKWARD)  # its post-backward comes after the blocks'
    assert during["layers.0"][0] is not SHARDED  # prefetched
    assert set(seen["optimizer", ""].values()) == {(SHARDED, TrainingState.IDLE)}


def test_without_reshard_after_forward_every_unit_stays_unsharded_through_the_loss():
    seen = _second_step(reshard_after_forward=False).seen
    assert {shard for shard, _ in seen["loss", ""].values()} == {ShardState.UNSHARDED}


def test_memory_log_peak():
    log = MemoryLog()
    a = log.alloc(0.0, 100)
    b = log.alloc(1.0, 50)
    log.free(1.0, a)  # at equal times frees go first
    log.alloc(2.0, 30)
    log.free(3.0, b)
    log.free(3.0, 12345)  # an id of an earlier step: ignored
    assert log.peak() == 100
    assert MemoryLog().peak() == 0
