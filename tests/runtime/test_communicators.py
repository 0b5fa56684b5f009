"""Communicators: the single-rank one, the process-group one on gloo, NCCL through CuPy (GPU)."""

from __future__ import annotations

import time

import pytest
import torch

from flashfsdp.runtime.communicator import LocalCommunicator
from flashfsdp.runtime.process_group import ProcessGroupCommunicator
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
