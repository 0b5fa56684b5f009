"""Launch plans: FlattenPlan / UnflattenPlan give the ops' results and errors, keep their table
while nothing it depends on changes, and build it again when the tensors or the buffer move."""

import pytest
import torch

import flashfsdp.kernels as kernels
from flashfsdp.kernels import FlattenPlan, UnflattenPlan, dispatch
from tests.kernels.spec import (
    DTYPE_PAIRS,
    assert_same,
    dtype_id,
    expected_flatten,
    expected_unflatten,
    many_small_tensors,
    nan_buffer,
    random_tensor,
)

BACKENDS = ("triton", "reference")


@pytest.fixture(params=BACKENDS)
def backend(request):
    """The dispatcher forced onto one backend (the Triton interpreter on CPU by default)."""
    if request.param == "triton" and dispatch.triton_device_type() is None:
        pytest.skip("triton cannot be imported")
    with dispatch.use_backend(request.param):
        yield request.param


def _with_gaps(device, in_dtype):
    """Tensors of mixed shapes with a None entry, a gap and an empty tensor: (tensors, offsets,
    numels, numel of the flat buffer)."""
    tensors = [random_tensor((5, 7), in_dtype, device, seed=1), None, random_tensor((0,), in_dtype, device),
               random_tensor((33,), in_dtype, device, seed=2), random_tensor((8,), in_dtype, device, seed=3)]
    offsets = [40, 4, 0, 80, 120]
    numels = [35, 9, 0, 33, 8]
    return tensors, offsets, numels, 131


@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=dtype_id)
def test_flatten_plan_is_the_op(backend, device, dtypes):
    in_dtype, out_dtype = dtypes
    tensors, offsets, numels, numel = _with_gaps(device, in_dtype)
    plan = FlattenPlan(tensors, offsets, numels=numels)
    for scale in (1.0, 0.125, 3.0):
        out, expected = nan_buffer(numel, out_dtype, device), nan_buffer(numel, out_dtype, device)
        assert plan.run(out, scale) is out
        kernels.flatten(tensors, offsets, expected, scale=scale, numels=numels)
        assert_same(out, expected)
        assert_same(out, expected_flatten(tensors, offsets, numel, out_dtype, scale))
    assert plan.builds == (1 if backend == "triton" else 0)


@pytest.mark.parametrize("dtypes", DTYPE_PAIRS, ids=dtype_id)
def test_unflatten_plan_is_the_op(backend, device, dtypes):
    flat_dtype, out_dtype = dtypes
    flat = random_tensor((200,), flat_dtype, device, seed=4)
    shapes = [(3, 5), (0,), (64,), (2, 2, 2)]
    offsets = [3, 0, 100, 20]  # the last one overlaps the first's range: reading twice is fine
    outs = [torch.full(shape, float("nan"), dtype=out_dtype, device=device) for shape in shapes]
    plan = UnflattenPlan(offsets, outs)
    for seed in (4, 5):
        flat = random_tensor((200,), flat_dtype, device, seed=seed)  # a new buffer every run
        assert plan.run(flat) is None
        for out, expected in zip(outs, expected_unflatten(flat, offsets, [(s, out_dtype) for s in shapes])):
            assert_same(out, expected)
    assert plan.builds == (1 if backend == "triton" else 0)


def test_many_small_tensors_one_table(backend, device):
    tensors, offsets, numel = many_small_tensors(device, count=120)
    plan = FlattenPlan(tensors, offsets)
    out = nan_buffer(numel, torch.float32, device)
    for _ in range(3):
        plan.run(out.fill_(float("nan")))
        assert_same(out, expected_flatten(tensors, offsets, numel, torch.float32))
    outs = [torch.empty_like(t) for t in tensors]
    back = UnflattenPlan(offsets, outs)
    back.run(out)
    back.run(out)
    for t, o in zip(tensors, outs):
        assert_same(o, t.float().to(t.dtype))
    assert (plan.builds, back.builds) == ((1, 1) if backend == "triton" else (0, 0))


def _triton_only():
    if dispatch.triton_device_type() is None:
        pytest.skip("triton cannot be imported")
    return dispatch.use_backend("triton")


def test_a_tensor_moved_to_new_storage_is_rebuilt(device):
    with _triton_only():
        outs = [torch.zeros(8, device=device), torch.zeros(16, device=device)]
        plan = UnflattenPlan([0, 8], outs)
        flat = torch.arange(24.0, device=device)
        plan.run(flat)
        old = outs[1].data_ptr()
        outs[1].set_(torch.zeros(16, device=device))  # the plan's object, other memory
        assert outs[1].data_ptr() != old
        plan.run(flat)
        assert plan.builds == 2
        assert_same(outs[1], flat[8:].clone())
        sources = [torch.ones(4, device=device), torch.full((4,), 2.0, device=device)]
        packing = FlattenPlan(sources, [0, 4])
        out = torch.empty(8, device=device)
        packing.run(out)
        sources[0].set_(torch.full((4,), 7.0, device=device))
        packing.run(out)
        assert packing.builds == 2 and out.tolist() == [7.0] * 4 + [2.0] * 4


def test_the_caller_list_is_copied(device):
    with _triton_only():
        outs = [torch.zeros(4, device=device)]
        plan = UnflattenPlan([0], outs)
        outs.append(torch.zeros(4, device=device))  # not the plan's
        plan.run(torch.ones(4, device=device))
        assert outs[0].tolist() == [1.0] * 4 and outs[1].tolist() == [0.0] * 4


def test_flat_buffer_at_another_alignment_is_rebuilt(device):
    with _triton_only():
        outs = [torch.zeros(40, dtype=torch.bfloat16, device=device), torch.zeros(7, device=device)]
        plan = UnflattenPlan([0, 40], outs)
        base = random_tensor((60,), torch.float32, device, seed=6)
        plan.run(base[:48])
        plan.run(random_tensor((60,), torch.float32, device, seed=7)[:48])  # new address, same alignment
        assert plan.builds == 1
        shifted = base[1:49]  # 4 bytes off: no longer 16-byte aligned
        plan.run(shifted)
        assert plan.builds == 2
        for out, expected in zip(outs, expected_unflatten(shifted, [0, 40], [((40,), torch.bfloat16),
                                                                                ((7,), torch.float32)])):
            assert_same(out, expected)


def _same_error(plan_call, op_call):
    with pytest.raises((TypeError, ValueError, RuntimeError)) as expected:
        op_call()
    with pytest.raises(expected.type) as raised:
        plan_call()
    assert str(raised.value) == str(expected.value)


@pytest.mark.parametrize("bad", ["dtype", "numel", "device", "noncontiguous", "2-d", "not a tensor"])
def test_a_wrong_flat_buffer_raises_the_ops_error(backend, device, bad):
    outs = [torch.zeros(8, device=device), torch.zeros(4, dtype=torch.float16, device=device)]
    plan, packing = UnflattenPlan([0, 8], outs), FlattenPlan(outs, [0, 8])
    good = torch.zeros(12, device=device)
    plan.run(good)
    packing.run(good)
    wrong = {"dtype": torch.zeros(12, dtype=torch.int32, device=device), "numel": torch.zeros(10, device=device),
             "device": torch.zeros(12, device="meta"), "noncontiguous": torch.zeros(24, device=device)[::2],
             "2-d": torch.zeros(3, 4, device=device), "not a tensor": [0.0] * 12}[bad]
    _same_error(lambda: plan.run(wrong), lambda: kernels.unflatten(wrong, [0, 8], outs))
    _same_error(lambda: packing.run(wrong), lambda: kernels.flatten(outs, [0, 8], wrong))
    plan.run(good)  # the kept table still serves the good buffer
    packing.run(good)
    assert (plan.builds, packing.builds) == ((1, 1) if backend == "triton" else (0, 0))


def test_bad_scale_and_bad_lists_raise_the_ops_error(backend, device):
    tensors = [torch.ones(4, device=device)]
    out = torch.zeros(4, device=device)
    plan = FlattenPlan(tensors, [0])
    plan.run(out)
    _same_error(lambda: plan.run(out, float("inf")), lambda: kernels.flatten(tensors, [0], out, scale=float("inf")))
    _same_error(lambda: plan.run(out, "1"), lambda: kernels.flatten(tensors, [0], out, scale="1"))
    _same_error(lambda: FlattenPlan(tensors, [0, 4]).run(out), lambda: kernels.flatten(tensors, [0, 4], out))
    _same_error(lambda: UnflattenPlan([2], tensors).run(out), lambda: kernels.unflatten(out, [2], tensors))
    _same_error(lambda: UnflattenPlan([0], [None]).run(out), lambda: kernels.unflatten(out, [0], [None]))


def test_a_buffer_that_reaches_the_tensors_is_checked_in_full(backend, device):
    storage = torch.zeros(64, device=device)
    outs = [storage[0:8], storage[16:24]]
    plan = UnflattenPlan([0, 8], outs)
    plan.run(torch.arange(16.0, device=device))
    overlapping = storage[4:20]  # covers part of both outputs
    _same_error(lambda: plan.run(overlapping), lambda: kernels.unflatten(overlapping, [0, 8], outs))
    between = storage[32:48]  # the same storage, past the outputs' bytes: fine
    between.copy_(torch.arange(16.0, device=device))
    plan.run(between)
    assert outs[1].tolist() == list(range(8, 16))
    # flatten's in-place case: a tensor that is exactly its own range of the buffer
    packing = FlattenPlan([storage[40:48]], [8])
    packing.run(storage[32:48])
    packing.run(storage[32:48])
    assert storage[40:48].tolist() == list(range(8, 16)) and storage[32:40].tolist() == [0.0] * 8
    assert packing.builds == (1 if backend == "triton" else 0)


def test_noncontiguous_and_float64_lists_give_the_ops_results(backend, device):
    flat = random_tensor((40,), torch.float32, device, seed=8)
    strided = torch.zeros(6, 4, device=device).t()  # not contiguous
    for outs in ([strided, torch.zeros(3, device=device)], [torch.zeros(24, dtype=torch.float64, device=device)]):
        plan = UnflattenPlan([0, 30][: len(outs)], outs)
        plan.run(flat)
        plan.run(flat)
        expected = expected_unflatten(flat, [0, 30], [(o.shape, o.dtype) for o in outs])
        for out, value in zip(outs, expected):
            assert_same(out, value)
        packing = FlattenPlan(outs, [0, 30][: len(outs)])
        result = packing.run(torch.empty(40, device=device), 0.5)
        assert_same(result, expected_flatten(outs, [0, 30], 40, torch.float32, 0.5))


def test_runs_are_counted_per_backend(backend, device):
    dispatch.reset_backend_counts()
    plan = UnflattenPlan([0], [torch.zeros(4, device=device)])
    plan.run(torch.ones(4, device=device))
    plan.run(torch.ones(4, device=device))
    assert dispatch.backend_counts() == {("unflatten", backend, device.type): 2}


def test_prepare_keeps_a_table_on_any_backend_and_is_current_sees_changes(backend, device):
    outs = [torch.zeros(8, device=device), torch.zeros(8, dtype=torch.bfloat16, device=device)]
    plan, packing = UnflattenPlan([0, 8], outs), FlattenPlan(outs, [0, 8])
    flat = torch.zeros(16, device=device)
    assert not plan.is_current(flat) and not packing.is_current(flat)
    assert plan.prepare(flat) and packing.prepare(flat)
    assert plan.is_current(flat) and packing.is_current(torch.zeros(16, device=device))
    assert not plan.is_current(torch.zeros(17, device=device)) and not plan.is_current("flat")
    outs[0].set_(torch.zeros(8, device=device))
    assert not plan.is_current(flat) and not packing.is_current(flat)
    assert not UnflattenPlan([0], [torch.zeros(4, 2, device=device).t()]).prepare(flat)  # non-contiguous
    assert (plan.builds, packing.builds) == (1, 1)
