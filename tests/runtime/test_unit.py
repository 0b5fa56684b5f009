"""ShardedUnit and FlatParam driven directly (no nn.Module) over the single-rank communicator.

Every state transition of a unit: SHARDED → UNSHARDING → UNSHARDED → SHARDED, the post-forward
slice (SECONDARY), a reduction in flight (PendingReduce) and its accumulation, a no-sync
accumulation in ``reduce_dtype``, a compacted reduction of a partly frozen group, and adopting
converted parameters; plus the streams on CPU (no-ops) and the stale-gather check.
"""

from __future__ import annotations

import weakref

import pytest
import torch

from flashfsdp.runtime.communicator import LocalCommunicator
from flashfsdp.runtime.flat_param import shards_written
from flashfsdp.runtime.reduce import ReduceLayout
from flashfsdp.runtime.states import ShardState
from flashfsdp.runtime.streams import streams_for
from flashfsdp.runtime.unit import ShardedUnit


def _params(*shapes, requires_grad=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(*s, generator=g), requires_grad=requires_grad) for s in shapes]


def _unit(params, **kwargs):
    return ShardedUnit("u", params, [f"p{i}" for i in range(len(params))], LocalCommunicator(),
                       torch.device("cpu"), **kwargs)


def test_unshard_reshard_cycle_gives_the_parameters_as_views_of_one_buffer():
    params = _params((3, 5), (7,), (2, 2, 2))
    unit = _unit(params)
    group = unit.groups[0]
    assert unit.state is ShardState.SHARDED and not group.is_unsharded
    result = unit.unshard()
    assert unit.state is ShardState.UNSHARDING and unit.unshard() is result  # issued once
    unit.wait_unshard()
    assert unit.state is ShardState.UNSHARDED
    for i, p in enumerate(params):
        view = unit.unsharded_param(i)
        assert view.shape == p.shape and torch.equal(view, p)
        assert view.untyped_storage().data_ptr() == group.unsharded_flat.untyped_storage().data_ptr()
    unit.reshard()
    assert unit.state is ShardState.SHARDED and not group.is_unsharded
    assert unit.memory_bytes()["unsharded"] == 0
    unit.wait_unshard()  # re-materialised in place: the same tensor objects hold the values again
    assert all(torch.equal(unit.unsharded_param(i), p) for i, p in enumerate(params))


def test_reduction_in_flight_then_accumulated_with_norm_and_flag():
    params = _params((4, 3), (5,))
    unit = _unit(params)
    unit.wait_unshard()
    for i, p in enumerate(params):
        unit.unsharded_param(i).grad = torch.full(p.shape, float(i + 1))
    pending = unit.reduce_grads()
    assert len(pending) == 1 and all(unit.unsharded_param(i).grad is None for i in range(2))
    pending[0].finish()
    group = unit.groups[0]
    want = torch.cat([torch.full((12,), 1.0), torch.full((5,), 2.0)])
    got = torch.cat([unit.sharded_param(i).grad.reshape(-1) for i in range(2)])
    assert [unit.sharded_param(i).grad.shape for i in range(2)] == [p.shape for p in params]
    assert torch.equal(got, want)
    sq_norm, nonfinite, _ = group.grad_stats
    assert sq_norm.item() == pytest.approx((want ** 2).sum().item()) and not nonfinite
    group.release_unused_grad()
    assert group.sharded_grad is not None  # the parameters' gradients still refer to it
    for i in range(2):
        unit.sharded_param(i).grad = None
    group.release_unused_grad()
    assert group.sharded_grad is None  # zero_grad(set_to_none=True) frees it


def test_a_released_gradient_keeps_its_tensors_unless_something_holds_them():
    """zero_grad(set_to_none=True) frees the gradient memory; the next reduction fills the same
    gradient tensors again ([Note: kept gradient DTensors]) unless something still holds one or a
    view of one, which then keeps its values (a new buffer is made)."""
    params = _params((4, 3), (5,))
    unit = _unit(params)
    group = unit.groups[0]

    def step(value):
        unit.wait_unshard()
        for i, p in enumerate(params):
            unit.unsharded_param(i).grad = torch.full(p.shape, value)
        unit.reduce_grads()[0].finish()
        unit.reshard()
        return [unit.sharded_param(i).grad for i in range(2)]

    def zero_grad():
        for i in range(2):
            unit.sharded_param(i).grad = None
        group.release_unused_grad()

    first = [weakref.ref(g) for g in step(1.0)]
    zero_grad()
    assert group.sharded_grad is None and group._spare_grad[0].untyped_storage().nbytes() == 0  # freed
    second = step(2.0)
    assert all(ref() is g for ref, g in zip(first, second))  # the same tensors, the new values
    assert torch.equal(second[1], torch.full((5,), 2.0))
    held, view = second[0], second[1].view(-1)[:2]  # kept past zero_grad: a gradient, a view of one
    del second
    zero_grad()
    assert group._spare_grad is None
    third = step(3.0)
    assert third[0] is not held and torch.equal(third[0], torch.full((4, 3), 3.0))
    assert torch.equal(held, torch.full((4, 3), 2.0)) and torch.equal(view, torch.full((2,), 2.0))


def test_a_reduction_with_no_gradient_to_add_to_becomes_the_gradient_shard():
    """[Note: reduced in place]: with no gradient held, the reduce-scatter's output is the
    gradient shard's memory (no second S-element buffer beside it); with one, it is added into
    that gradient; and a reduce_dtype other than the master dtype reduces into its own buffer."""
    params = _params((4, 3), (5,))
    unit = _unit(params)
    group = unit.groups[0]

    def reduce(value):
        unit.wait_unshard()
        for i, p in enumerate(params):
            unit.unsharded_param(i).grad = torch.full(p.shape, value)
        (pending,) = unit.reduce_grads()
        output = pending.output
        pending.finish()
        return output

    output = reduce(1.0)
    assert group.sharded_grad.untyped_storage().data_ptr() == output.untyped_storage().data_ptr()
    assert torch.equal(unit.sharded_param(1).grad, torch.full((5,), 1.0))
    output = reduce(2.0)  # a gradient is held: accumulated into it, from a buffer of its own
    assert group.sharded_grad.untyped_storage().data_ptr() != output.untyped_storage().data_ptr()
    assert torch.equal(unit.sharded_param(0).grad, torch.full((4, 3), 3.0))

    mixed = _unit(_params((6,)), param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
    mixed.wait_unshard()
    mixed.unsharded_param(0).grad = torch.ones(6, dtype=torch.bfloat16)
    (pending,) = mixed.reduce_grads()
    output = pending.output
    pending.finish()
    assert mixed.groups[0].sharded_grad.untyped_storage().data_ptr() != output.untyped_storage().data_ptr()
    assert torch.equal(mixed.sharded_param(0).grad, torch.ones(6))


def test_no_sync_accumulation_runs_in_reduce_dtype():
    params = _params((6,))
    unit = _unit(params, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    unit.wait_unshard()
    small = torch.full((6,), 2.0 ** -9, dtype=torch.bfloat16)
    for _ in range(3):
        unit.unsharded_param(0).grad = torch.ones(6, dtype=torch.bfloat16) if _ == 0 else small.clone()
        unit.accumulate_unsharded_grads()
        assert unit.unsharded_param(0).grad is None and unit.has_unsharded_grads()
    unit.reduce_grads()[0].finish()
    # 1 + 2·2^-9 is exact in fp32 and would round to 1 in bf16
    assert torch.equal(unit.sharded_param(0).grad, torch.full((6,), 1.0 + 2 * 2.0 ** -9))


def test_partly_frozen_group_reduces_only_its_trainable_parameters():
    params = _params((50,), (3,), (40,))
    unit = _unit(params)
    unit.sharded_param(0).requires_grad_(False)
    unit.sharded_param(2).requires_grad_(False)
    group = unit.groups[0]
    sub = group.reduce_layout()  # the reduce-scatter packs the trainable parameter only
    assert sub is not None and sub.shapes == ((3,),) and sub.shard_size < group.layout.shard_size
    rlayout = ReduceLayout.of(group)
    assert rlayout.keep == (1,) and rlayout.segment < group.layout.shard_size
    unit.wait_unshard()
    unit.groups[0].sync_requires_grad()
    unit.unsharded_param(1).grad = torch.tensor([1.0, 2.0, 3.0])
    unit.reduce_grads()[0].finish()
    assert unit.sharded_param(0).grad is None and unit.sharded_param(2).grad is None
    assert torch.equal(unit.sharded_param(1).grad, torch.tensor([1.0, 2.0, 3.0]))


def test_gathered_parameters_go_stale_when_the_shard_is_written():
    unit = _unit(_params((4,)))
    unit.wait_unshard()
    assert not unit.gathered_is_stale()
    with torch.no_grad():
        unit.sharded_param(0).add_(1)  # an in-place update of a sharded parameter (foreach optimizers)
    assert unit.gathered_is_stale()
    unit.reshard()
    unit.wait_unshard()
    assert not unit.gathered_is_stale()
    shards_written()  # an optimizer step that bumps no version counter (fused)
    assert unit.gathered_is_stale()


def test_adopt_takes_converted_parameters_back_into_the_flat_storage():
    params = _params((3, 2), (4,))
    unit = _unit(params)
    sharded = [unit.sharded_param(i) for i in range(2)]
    converted = [torch.nn.Parameter(p.detach().double()) for p in sharded]
    assert unit.adopt(converted)
    group = unit.groups[0]
    assert group.dtype == torch.float64 and group.param_dtype == torch.float64
    for i, p in enumerate(converted):
        assert unit.sharded_param(i) is p and p.dtype == torch.float64
        assert p.untyped_storage().data_ptr() == group.sharded_flat.untyped_storage().data_ptr()
    unit.wait_unshard()
    assert torch.equal(unit.unsharded_param(0), params[0].detach().double())
    unit.reshard()
    with pytest.raises(ValueError, match="converted to torch.float16"):
        unit.adopt([torch.nn.Parameter(p.detach().half()) for p in converted])


def test_cpu_streams_are_no_ops():
    streams = streams_for(torch.device("cpu"))
    assert streams.all_gather is None and streams.reduce_scatter is None
    assert streams.record() is None
    with streams.use(streams.all_gather):
        pass
    streams.hold_until_passed(None, [torch.zeros(1)])
    streams.release_held()
    streams.wait_for_reduce_scatter("u")


def test_post_forward_slice_is_kept_and_gathered_from():
    """hpZ: after forward the unit keeps its slice for the post-forward group (SECONDARY) and the
    backward's unshard gathers from it (here a group of one rank: the slice is the whole buffer)."""
    params = _params((5, 3))
    unit = _unit(params, post_forward_comm=LocalCommunicator())
    unit.wait_unshard()
    unit.reshard(to_secondary=True)
    assert unit.state is ShardState.SECONDARY and unit.memory_bytes()["secondary"] > 0
    assert not unit.groups[0].is_unsharded
    unit.wait_unshard()
    assert unit.state is ShardState.UNSHARDED and torch.equal(unit.unsharded_param(0), params[0])
    unit.reshard()
    assert unit.state is ShardState.SHARDED and unit.memory_bytes()["secondary"] == 0
