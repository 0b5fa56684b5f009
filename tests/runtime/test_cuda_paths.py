"""The CUDA paths that CPU cannot exercise (`gpu` tests): a free from the host while compute still
reads the buffer, under expandable segments and a cache release; NCCL through CuPy timing out
with an error that names the collective and the unit; communicators destroyed with their group."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

from tests.harness import run_distributed

SLEEP_CYCLES = 2 * 10**9  # about 1 s of GPU time on an H100 (1.7-2 GHz)


def _free_while_compute_reads(rank, world_size):
    from flashfsdp.runtime.communicator import LocalCommunicator  # noqa: PLC0415
    from flashfsdp.runtime.unit import ShardedUnit  # noqa: PLC0415

    assert "expandable_segments:True" in os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    device = torch.device("cuda", 0)
    weight = torch.randn(64 * 2**20, device=device)  # 256 MiB: pages of their own
    expected = (weight * 2).cpu()
    unit = ShardedUnit("block", [weight], ["weight"], LocalCommunicator(), device)
    del weight
    unit.wait_unshard()
    full = unit.unsharded_param(0)
    torch.cuda.synchronize()
    reserved = torch.cuda.memory_reserved(device)
    torch.cuda._sleep(SLEEP_CYCLES)  # the compute stream reads the buffer only after this
    doubled = full.detach() * 2
    unit.reshard()  # the host frees the all-gather stream's block now
    torch.cuda.empty_cache()  # unmaps free pages after synchronising their owner stream only
    released = reserved - torch.cuda.memory_reserved(device)
    torch.cuda.synchronize()  # an unmapped read would fail here (illegal address)
    return released, torch.equal(doubled.cpu(), expected)


@pytest.mark.gpu
def test_reshard_free_is_safe_under_expandable_segments_and_empty_cache(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # the spawned rank's allocator
    ((released, correct),) = run_distributed(_free_while_compute_reads, 1, kernels=None)
    assert released >= 256 * 2**20, "empty_cache did not release the freed buffer: nothing was tested"
    assert correct


def _nccl_timeout(rank, world_size):
    from flashfsdp.runtime.nccl import CollectiveTimeout, NcclCommunicator  # noqa: PLC0415

    comm = NcclCommunicator(dist.group.WORLD, 0, timeout=0.5)
    flag = torch.ones(4, device="cuda")
    torch.cuda._sleep(3 * SLEEP_CYCLES)  # the all-reduce cannot complete before the deadline
    comm.all_reduce(flag).set_unit("layers.0")
    try:
        comm.barrier()
    except CollectiveTimeout as error:
        message = str(error)
    else:
        message = None
    again = None
    try:
        comm.all_reduce(flag)
    except CollectiveTimeout as error:
        again = str(error)
    return message, again, comm._comm is None


@pytest.mark.gpu
def test_nccl_timeout_aborts_and_names_the_collective_and_unit():
    ((message, again, aborted),) = run_distributed(_nccl_timeout, 1, kernels=None)
    assert message is not None and "all_reduce of unit 'layers.0'" in message and "0.5 s" in message
    assert again == message and aborted


def _destroyed_with_group(rank, world_size):
    from flashfsdp.runtime.nccl import NcclCommunicator  # noqa: PLC0415

    sub = dist.new_group([0])
    comm = NcclCommunicator(sub, 0)
    t = torch.arange(4.0, device="cuda")
    comm.all_reduce(t).wait()
    torch.cuda.synchronize()
    dist.destroy_process_group(sub)
    try:
        comm.all_reduce(t)
    except RuntimeError as error:
        return comm._comm is None, str(error)
    return comm._comm is None, None


@pytest.mark.gpu
def test_nccl_communicator_is_destroyed_with_its_process_group():
    ((destroyed, message),) = run_distributed(_destroyed_with_group, 1, kernels=None)
    assert destroyed and "was destroyed" in message
