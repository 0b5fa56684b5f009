"""Bad input to fully_shard and FSDPModule: a clear exception naming the module/parameter and the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import flashfsdp
from flashfsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from tests.harness import run_distributed


def test_fully_shard_twice_on_one_module():
    model = nn.Linear(3, 3)
    fully_shard(model)
    with pytest.raises(ValueError, match="already fully_shard'ed; call fully_shard once per module"):
        fully_shard(model)


def test_parameters_on_several_devices():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3, device="meta"))
    with pytest.raises(ValueError, match=r"parameters on several devices .*module.to\(device\)"):
        fully_shard(model)


def test_integer_parameter():
    model = nn.Linear(3, 3)
    model.count = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    with pytest.raises(TypeError, match=r"parameter 'count' has dtype torch.int64.*ignored_params"):
        fully_shard(model)


def test_integer_parameter_can_be_ignored():
    model = nn.Linear(3, 3)
    model.count = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    fully_shard(model, ignored_params=[model.count])
    assert model.count.shape == (2,)


def test_parameters_already_in_another_unit():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    fully_shard(model)
    with pytest.raises(ValueError, match=r"parameter 'weight' already belongs to another unit .*bottom-up"):
        fully_shard(model[0])


def test_inputs_on_the_wrong_device():
    model = fully_shard(nn.Linear(3, 3))
    with pytest.raises(ValueError, match=r"forward input on meta but its parameters are on cpu: move the inputs"):
        model(torch.empty(2, 3, device="meta"))


def test_unshard_on_a_module_fully_shard_never_touched():
    with pytest.raises(ValueError, match=r"unshard: Linear is not a fully_shard'ed module; call flashfsdp.fully_shard on it first"):
        FSDPModule.unshard(nn.Linear(3, 3))


def test_prefetch_list_with_a_plain_module():
    model = fully_shard(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="not a fully_shard'ed module"):
        model.set_modules_to_forward_prefetch([nn.Linear(3, 3)])


def test_world_size_above_one_without_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match=r"WORLD_SIZE=2 but torch.distributed is not initialised"):
        fully_shard(nn.Linear(3, 3))


def test_single_rank_without_process_group_works(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    model = fully_shard(nn.Linear(3, 3))
    model(torch.randn(2, 3)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


def test_cpu_offload_is_refused_clearly():
    with pytest.raises(NotImplementedError, match="CPUOffloadPolicy is not supported yet"):
        fully_shard(nn.Linear(3, 3), offload_policy=CPUOffloadPolicy())


def test_unknown_communicator():
    with pytest.raises(ValueError, match="communicator must be one of"):
        fully_shard(nn.Linear(3, 3), communicator="mpi")


def test_bad_mixed_precision_dtype():
    with pytest.raises(TypeError, match="MixedPrecisionPolicy.param_dtype must be a floating"):
        MixedPrecisionPolicy(param_dtype=torch.int32)


def test_mesh_of_the_wrong_type():
    with pytest.raises(TypeError, match="mesh must be a torch.distributed DeviceMesh"):
        fully_shard(nn.Linear(3, 3), mesh="cpu")


def test_clip_grad_norm_bad_arguments():
    model = fully_shard(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="max_norm must be > 0"):
        flashfsdp.clip_grad_norm_(model, 0.0)
    with pytest.raises(ValueError, match="norm_type must be > 0"):
        flashfsdp.clip_grad_norm_(model, 1.0, norm_type=-1)


def test_all_gather_with_grad_needs_a_dimension():
    with pytest.raises(ValueError, match="at least one dimension"):
        flashfsdp.all_gather_with_grad(torch.tensor(1.0))


def _two_d_mesh(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (1, 1))
    try:
        fully_shard(nn.Linear(3, 3), mesh=mesh)
    except ValueError as exc:
        return str(exc)
    return None


def test_mesh_that_is_not_one_dimensional():
    (message,) = run_distributed(_two_d_mesh, 1)
    assert message is not None and "mesh must be a 1-D DeviceMesh, got 2" in message


def test_max_inflight_must_be_a_non_negative_integer():
    model = fully_shard(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="max_inflight must be an integer >= 0"):
        model.set_max_inflight_all_gathers(-1)


def test_reshard_after_forward_int_must_divide_the_world_size():
    fully_shard(nn.Linear(3, 3), reshard_after_forward=1)  # W = 1 here: 1 is both "all ranks" and "none"
    with pytest.raises(ValueError, match=r"reshard_after_forward=2 must be a group size that divides the world size 1"):
        fully_shard(nn.Linear(3, 3), reshard_after_forward=2)
    with pytest.raises(TypeError, match="reshard_after_forward must be a bool or an int"):
        fully_shard(nn.Linear(3, 3), reshard_after_forward="yes")
