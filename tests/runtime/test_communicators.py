"""Communicators: the single-rank one, the process-group one on gloo, NCCL through CuPy (GPU), and
the NCCL communicators' teardown with their process group (on CPU, around a stand-in for CuPy's)."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from flashfsdp.runtime import nccl
from flashfsdp.runtime.communicator import LocalCommunicator
from flashfsdp.runtime.process_group import ProcessGroupCommunicator
from flashfsdp_dev.ranks import single_process_group
from tests.harness import run_distributed


def test_local_communicator_is_the_identity_collective():
    comm = LocalCommunicator()
    out, inp = torch.zeros(4), torch.arange(4.0)
    comm.all_gather_into_tensor(out, inp).wait()
    assert torch.equal(out, inp)
    comm.reduce_scatter_tensor(out, inp * 2, op="avg").wait()
    assert torch.equal(out, inp * 2)
    with pytest.raises(ValueError, match="reduce op must be one of"):
        comm.all_reduce(out, op="prod")
    with pytest.raises(ValueError, match="world_size"):
        comm.all_gather_into_tensor(torch.zeros(5), inp)


def test_local_communicator_work_completes_when_issued():
    comm = LocalCommunicator()
    before = time.perf_counter()
    work = comm.reduce_scatter_tensor(torch.empty(4), torch.arange(4.0))
    after = time.perf_counter()
    assert before <= work.completion_time() <= after
    assert work.is_completed()


def _completion_times(rank, world_size):
    comm = ProcessGroupCommunicator()
    n = 1000
    issuers = {
        "all_gather": lambda: comm.all_gather_into_tensor(torch.empty(world_size * n), torch.ones(n)),
        "reduce_scatter": lambda: comm.reduce_scatter_tensor(torch.empty(n), torch.ones(world_size * n)),
        "reduce_scatter_avg": lambda: comm.reduce_scatter_tensor(torch.empty(n), torch.ones(world_size * n), op="avg"),
    }
    times = {}
    for name, issue in issuers.items():
        comm.barrier()
        issued = time.perf_counter()
        work = issue()
        work.track_completion()
        while not work.is_completed():
            time.sleep(1e-4)
        seen = time.perf_counter()
        time.sleep(0.02)  # the consumer computes before it waits: not part of the collective
        work.wait()
        times[name] = (issued, work.completion_time(), seen)
    untracked = comm.all_gather_into_tensor(torch.empty(world_size * n), torch.ones(n))
    untracked.wait()
    times["untracked"] = untracked.completion_time()
    return times


def test_gloo_work_reports_when_it_completed_not_when_it_was_waited_on():
    for times in run_distributed(_completion_times, 2):
        assert times.pop("untracked") is None
        for name, (issued, completed, seen) in times.items():
            assert completed is not None, name
            assert issued <= completed <= seen, name


def _collectives(rank, world_size):
    comm = ProcessGroupCommunicator()
    S = 3
    flat = torch.full((world_size * S,), -1.0)
    flat[rank * S : (rank + 1) * S] = rank + 1
    comm.all_gather_into_tensor(flat, flat[rank * S : (rank + 1) * S]).wait()  # in place
    inp = torch.arange(world_size * S, dtype=torch.float32) * (rank + 1)
    summed, averaged = torch.empty(S), torch.empty(S)
    comm.reduce_scatter_tensor(summed, inp, op="sum").wait()
    comm.reduce_scatter_tensor(averaged, inp, op="avg").wait()
    top = torch.tensor([float(rank)])
    comm.all_reduce(top, op="max").wait()
    b = torch.tensor([rank * 10.0])
    comm.broadcast(b, src=world_size - 1).wait()
    comm.barrier()
    return flat, summed, averaged, top, b


@pytest.mark.parametrize("world_size", [2, 4])
def test_process_group_communicator_on_gloo(world_size):
    results = run_distributed(_collectives, world_size)
    k = sum(range(1, world_size + 1))
    for rank, (flat, summed, averaged, top, b) in enumerate(results):
        assert torch.equal(flat, torch.arange(1, world_size + 1).float().repeat_interleave(3))
        want = torch.arange(rank * 3, rank * 3 + 3).float() * k
        torch.testing.assert_close(summed, want)
        torch.testing.assert_close(averaged, want / world_size)
        assert top.item() == world_size - 1 and b.item() == (world_size - 1) * 10


def test_process_group_communicator_needs_a_process_group():
    with pytest.raises(RuntimeError, match="torch.distributed is not initialised"):
        ProcessGroupCommunicator()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on machines without CUDA")
def test_nccl_communicator_without_cuda_says_why():
    from flashfsdp.runtime.nccl import NcclCommunicator

    with pytest.raises(RuntimeError, match=r"needs a CUDA device.*communicator='process_group'"):
        NcclCommunicator()


def _nccl_single_gpu(rank, world_size):
    import torch.distributed as dist

    from flashfsdp.runtime.nccl import NcclCommunicator

    comm = NcclCommunicator(dist.group.WORLD, 0)
    flat = torch.arange(8.0, device="cuda")
    out = torch.empty(8, device="cuda")
    comm.all_gather_into_tensor(out, flat).wait()
    red = torch.empty(8, device="cuda")
    comm.reduce_scatter_tensor(red, flat * 2, op="sum").wait()
    torch.cuda.synchronize()
    return out.cpu(), red.cpu()


@pytest.mark.gpu
def test_nccl_communicator_on_one_gpu():
    ((out, red),) = run_distributed(_nccl_single_gpu, 1)
    assert torch.equal(out, torch.arange(8.0)) and torch.equal(red, torch.arange(8.0) * 2)


# ------------------------------------------------------------------ NCCL teardown with the group
class _CupyStandIn:
    """Stands for CuPy's NcclCommunicator (no CUDA here): records what the teardown calls on it."""

    def __init__(self):
        self.calls = []

    def destroy(self):
        self.calls.append("destroy")

    def abort(self):
        self.calls.append("abort")

    def check_async_error(self):
        pass


def _communicator_over(group) -> nccl.NcclCommunicator:
    """An NcclCommunicator over ``group`` with its watchdog and teardown bookkeeping as built by the
    constructor, and a stand-in where the constructor would create CuPy's communicator on a GPU."""
    comm = nccl.NcclCommunicator.__new__(nccl.NcclCommunicator)
    comm.group, comm.rank, comm.world_size, comm.device = group, 0, 1, torch.device("cpu")
    comm._comm = _CupyStandIn()
    comm._start(timeout_s=60.0)
    return comm


@pytest.fixture
def no_live_communicators():
    assert not list(nccl._live)
    yield
    nccl.destroy_communicators()  # stops the watchdog threads of those a failed test left


def test_nccl_communicator_goes_with_its_group_without_patching_torch(no_live_communicators):
    torch_destroy = (dist.destroy_process_group, dist.distributed_c10d.destroy_process_group)
    with single_process_group():
        sub = dist.new_group([0])
        on_world, on_sub = _communicator_over(dist.group.WORLD), _communicator_over(sub)
        cupy_world, cupy_sub = on_world._comm, on_sub._comm
        assert (dist.destroy_process_group, dist.distributed_c10d.destroy_process_group) == torch_destroy
        assert nccl._exit_release_registered
        dist.destroy_process_group(sub)
        assert on_sub.group_destroyed() and not on_world.group_destroyed()
        with pytest.raises(RuntimeError, match="was destroyed"):  # found at its next collective
            on_sub.all_reduce(torch.zeros(1))
        assert cupy_sub.calls == ["destroy"] and on_sub not in nccl._live
        with pytest.raises(RuntimeError, match="was destroyed"):
            on_sub.all_reduce(torch.zeros(1))
        assert cupy_sub.calls == ["destroy"]
        assert on_world._live_comm() is cupy_world and cupy_world.calls == []
    # leaving the block destroyed the default group: its communicator goes when found so
    assert on_world.group_destroyed() and nccl.release_destroyed() == 1
    assert cupy_world.calls == ["destroy"] and not list(nccl._live)


def test_destroy_communicators_releases_them_on_request(no_live_communicators):
    with single_process_group():
        sub = dist.new_group([0])
        on_world, on_sub, on_sub_too = (_communicator_over(g) for g in (dist.group.WORLD, sub, sub))
        assert nccl.destroy_communicators(sub) == 2 and not on_sub.group_destroyed()
        assert on_sub._comm is None and on_sub_too._comm is None and on_world._comm is not None
        with pytest.raises(RuntimeError, match="destroy_communicators released it"):
            on_sub._live_comm()
        assert nccl.destroy_communicators(sub) == 0
        on_sub2 = _communicator_over(sub)
        assert nccl.destroy_communicators() == 2  # every one
        assert on_world._comm is None and on_sub2._comm is None and not list(nccl._live)


def test_at_exit_the_communicators_of_destroyed_groups_go_without_waiting(no_live_communicators):
    with single_process_group():
        sub, other = dist.new_group([0]), dist.new_group([0])
        busy, idle, kept = _communicator_over(sub), _communicator_over(sub), _communicator_over(other)
        cupy_busy, cupy_idle, cupy_kept = busy._comm, idle._comm, kept._comm
        busy._watchdog.register("all_reduce", lambda: False)  # in flight, never completes
        dist.destroy_process_group(sub)
        nccl._release_at_exit()
        assert cupy_busy.calls == ["abort"] and cupy_idle.calls == ["destroy"]
        assert cupy_kept.calls == [] and list(nccl._live) == [kept]  # its group is still there


def _reduce_scatters(rank, world_size):
    """The gloo reduce-scatter (an all-to-all and a local sum) against torch's own, on random
    values, fp32 and bf16; and the max (torch's all-reduce path); the inputs are left unchanged."""
    comm = ProcessGroupCommunicator()
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        inp = torch.randn(world_size * 1000, generator=torch.Generator().manual_seed(rank)).to(dtype)
        before = inp.clone()
        mine, torchs = torch.empty(1000, dtype=dtype), torch.empty(1000, dtype=dtype)
        comm.reduce_scatter_tensor(mine, inp, op="sum").wait()
        torch.distributed.reduce_scatter_tensor(torchs, inp.clone())
        out[str(dtype)] = (mine, torchs, torch.equal(inp, before))
    peak, top = torch.empty(1000), torch.empty(1000)
    values = torch.randn(world_size * 1000, generator=torch.Generator().manual_seed(10 + rank))
    comm.reduce_scatter_tensor(peak, values, op="max").wait()
    torch.distributed.all_reduce(values, op=torch.distributed.ReduceOp.MAX)
    top.copy_(values[rank * 1000 : (rank + 1) * 1000])
    out["max"] = (peak, top)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_reduce_scatter_equals_torchs(world_size):
    """Bit for bit at W = 2 (one addition per element either way); at W = 3 within the rounding of
    another summation order (fp32), one bf16 step (bf16: summed in fp32, rounded once)."""
    for r in run_distributed(_reduce_scatters, world_size):
        for dtype, (mine, torchs, untouched) in ((k, v) for k, v in r.items() if k != "max"):
            assert untouched, dtype
            if world_size == 2:
                assert torch.equal(mine, torchs), dtype
            else:
                tol = 1e-6 if dtype == "torch.float32" else 1e-2
                torch.testing.assert_close(mine.float(), torchs.float(), rtol=tol, atol=tol)
        assert torch.equal(*r["max"])


# ------------------------------------------------------------------ all-to-all (ZeRO++ qgZ's hops)
def test_local_all_to_all_copies_and_checks_sizes():
    comm = LocalCommunicator()
    inp, out = torch.arange(6, dtype=torch.int8), torch.zeros(6, dtype=torch.int8)
    comm.all_to_all_single(out, inp, label="qgZ intra").wait()
    assert torch.equal(out, inp)
    with pytest.raises(ValueError, match="same size"):
        comm.all_to_all_single(torch.zeros(5, dtype=torch.int8), inp)
    with pytest.raises(TypeError, match="dtypes differ"):
        comm.all_to_all_single(torch.zeros(6), inp)
    with pytest.raises(ValueError, match="overlap"):
        comm.all_to_all_single(inp, inp)


def _all_to_all(rank, world_size):
    from flashfsdp.runtime import flight  # noqa: PLC0415

    comm = ProcessGroupCommunicator()
    n = 3  # int8 chunks of 3 bytes: chunk j of rank r holds 10·r + j
    inp = torch.tensor([10 * rank + j for j in range(world_size) for _ in range(n)], dtype=torch.int8)
    out = torch.empty_like(inp)
    comm.all_to_all_single(out, inp, label="qgZ intra").wait()
    with pytest.raises(ValueError, match="multiple of the world size"):
        comm.all_to_all_single(torch.empty(5, dtype=torch.int8), torch.empty(5, dtype=torch.int8))
    kinds = [(e.kind, e.nbytes) for e in flight.entries()]
    return out.tolist(), kinds


@pytest.mark.parametrize("world_size", [2, 3])
def test_process_group_all_to_all_on_gloo(world_size):
    """Rank r receives chunk r of every rank, in rank order; the flight recorder names the hop
    and the bytes this rank sent."""
    results = run_distributed(_all_to_all, world_size)
    for rank, (out, kinds) in enumerate(results):
        assert out == [10 * j + rank for j in range(world_size) for _ in range(3)]
        assert ("all_to_all (qgZ intra)", 3 * world_size) in kinds


def test_a_communicator_without_all_to_all_says_so():
    class Partial(LocalCommunicator):
        all_to_all_single = LocalCommunicator.__mro__[1].all_to_all_single

    with pytest.raises(NotImplementedError, match="Partial has no all_to_all_single"):
        Partial().all_to_all_single(torch.zeros(2), torch.zeros(2))


def _nccl_all_to_all(rank, world_size):
    comm = nccl.NcclCommunicator()
    inp = torch.arange(8, dtype=torch.int8, device="cuda")
    out = torch.zeros_like(inp)
    comm.all_to_all_single(out, inp, label="qgZ inter").wait()
    torch.cuda.synchronize()
    return out.cpu()


@pytest.mark.gpu
def test_nccl_all_to_all_on_one_gpu():
    (out,) = run_distributed(_nccl_all_to_all, 1)
    assert torch.equal(out, torch.arange(8, dtype=torch.int8))
