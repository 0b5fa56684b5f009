"""Bad input to fully_shard and FSDPModule: a clear exception naming the module/parameter and the fix."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import flashfsdp
from flashfsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from flashfsdp.runtime.communicator import LocalCommunicator
from flashfsdp.runtime.param_tags import tag_of
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


def test_integer_parameter_is_left_replicated():
    model = nn.Linear(3, 3)
    model.count = nn.Parameter(torch.arange(2), requires_grad=False)
    fully_shard(model)
    assert model.count.shape == (2,) and tag_of(model.count) is None and tag_of(model.weight) is not None
    model(torch.zeros(1, 3)).sum().backward()
    assert model.count.tolist() == [0, 1]


def test_complex_parameter():
    model = nn.Linear(3, 3)
    model.phase = nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(TypeError, match=r"parameter 'phase' has dtype torch.complex64 and requires grad.*ignored_params"):
        fully_shard(model)


def test_integer_parameter_can_be_ignored():
    model = nn.Linear(3, 3)
    model.count = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    fully_shard(model, ignored_params=[model.count])
    assert model.count.shape == (2,)


def test_parameters_already_in_another_unit():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    fully_shard(model)
    with pytest.raises(ValueError, match=r"parameter 'weight' of Linear already belongs to the unit of an earlier "
                                         r"fully_shard call \(unit 'Sequential', where it is '0.weight'\); .*bottom-up"):
        fully_shard(model[0])


def test_a_bad_list_of_modules():
    with pytest.raises(ValueError, match=r"empty list of modules"):
        fully_shard([])
    with pytest.raises(TypeError, match=r"nn.Module or a list of them, got int"):
        fully_shard([nn.Linear(3, 3), 3])
    lin = nn.Linear(3, 3)
    with pytest.raises(ValueError, match=r"the same module appears twice"):
        fully_shard([lin, lin])


def test_tied_weight_in_two_separately_wrapped_units():
    emb, out = nn.Embedding(5, 3), nn.Linear(3, 5, bias=False)
    out.weight = emb.weight
    fully_shard(emb)
    with pytest.raises(ValueError, match=r"parameter 'weight' of Linear is shared with the unit of Embedding.*"
                                         r"fully_shard\(\[module_a, module_b\]\)"):
        fully_shard(out)


def test_a_grouped_root_is_refused_at_its_first_forward():
    a, b = nn.Linear(3, 3), nn.Linear(3, 3)
    fully_shard([a, b])
    with pytest.raises(ValueError, match=r"has no fully_shard'ed parent.*a root must be one module"):
        a(torch.zeros(1, 3))


def test_inputs_on_the_wrong_device():
    model = fully_shard(nn.Linear(3, 3))
    with pytest.raises(ValueError, match=r"forward input on meta but its parameters are on cpu: move the inputs"):
        model(torch.empty(2, 3, device="meta"))


def test_unshard_on_a_module_fully_shard_never_touched():
    with pytest.raises(ValueError, match=r"unshard: Linear is not a fully_shard'ed module; call flashfsdp.fully_shard on it first"):
        FSDPModule.unshard(nn.Linear(3, 3))


@pytest.mark.parametrize("call", [
    lambda m: FSDPModule.reshard(m),
    lambda m: FSDPModule.set_requires_gradient_sync(m, False),
    lambda m: FSDPModule.set_reshard_after_backward(m, False),
    lambda m: FSDPModule.set_reshard_after_forward(m, False),
    lambda m: FSDPModule.set_max_inflight_all_gathers(m, 1),
    lambda m: FSDPModule.set_modules_to_forward_prefetch(m, []),
    lambda m: FSDPModule.set_modules_to_backward_prefetch(m, []),
], ids=["reshard", "requires_gradient_sync", "reshard_after_backward", "reshard_after_forward",
        "max_inflight", "forward_prefetch", "backward_prefetch"])
def test_fsdp_module_methods_on_a_module_fully_shard_never_touched(call):
    # recurse=True must not silently act on the fully_shard'ed children only
    model = nn.Sequential(fully_shard(nn.Linear(3, 3)))
    with pytest.raises(ValueError, match=r"Sequential is not a fully_shard'ed module; call flashfsdp.fully_shard"):
        call(model)


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


def test_offload_policies_of_both_packages_are_accepted():
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy  # noqa: PLC0415
    from torch.distributed.fsdp import OffloadPolicy as TorchOffloadPolicy  # noqa: PLC0415

    for policy in (None, OffloadPolicy(), TorchOffloadPolicy(), CPUOffloadPolicy(), TorchCPUOffloadPolicy(False)):
        model = fully_shard(nn.Linear(3, 3), offload_policy=policy)
        model(torch.randn(2, 3)).sum().backward()
        assert all(p.grad is not None for p in model.parameters())


def test_offload_policy_of_another_type():
    with pytest.raises(TypeError, match=r"offload_policy must be None, OffloadPolicy\(\) or CPUOffloadPolicy\(\).*got 'cpu'"):
        fully_shard(nn.Linear(3, 3), offload_policy="cpu")


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


def _mesh_errors(rank, world_size):
    """The message of each bad mesh use (None where none was raised), on one spawn of W = 2."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: PLC0415

    cases = {
        "two_d": lambda: fully_shard(nn.Linear(3, 3), mesh=init_device_mesh("cpu", (2, 1))),
        # A CUDA mesh built without touching CUDA (no backend), against a CPU module.
        "device_type": lambda: fully_shard(nn.Linear(3, 3), mesh=DeviceMesh("cuda", torch.arange(2), _init_backend=False)),
        "communicator": lambda: fully_shard(nn.Linear(3, 3), mesh=init_device_mesh("cpu", (2,)),
                                            communicator=LocalCommunicator()),
    }
    messages = {}
    for name, case in cases.items():
        try:
            case()
            messages[name] = None
        except ValueError as exc:
            messages[name] = str(exc)
    return messages


@pytest.fixture(scope="module")
def mesh_errors():
    return run_distributed(_mesh_errors, 2)


def test_two_dimensional_mesh_without_dim_names(mesh_errors):
    for messages in mesh_errors:  # HSDP needs to know which dim replicates (more cases: test_hsdp.py)
        assert messages["two_d"] is not None and "mesh_dim_names" in messages["two_d"]


def test_mesh_of_another_device_type_than_the_module(mesh_errors):
    for messages in mesh_errors:
        assert messages["device_type"] is not None
        assert "mesh is of device type 'cuda' but the module's parameters are on cpu" in messages["device_type"]


def test_communicator_that_does_not_match_the_mesh(mesh_errors):
    for rank, messages in enumerate(mesh_errors):
        assert messages["communicator"] == (
            f"fully_shard: communicator LocalCommunicator has world size 1 and rank 0, but the mesh's group has "
            f"world size 2 and this process is its rank {rank}; pass a communicator over the mesh's group, or "
            f"communicator='auto' to build one"
        )


def test_max_inflight_must_be_a_non_negative_integer():
    model = fully_shard(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="max_inflight must be an integer >= 0"):
        model.set_max_inflight_all_gathers(-1)


def _two_units():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    fully_shard(model[0])
    return fully_shard(model)


def test_max_inflight_on_a_non_root_before_the_first_forward():
    model = _two_units()
    model[0].set_max_inflight_all_gathers(0)
    for _ in range(2):  # refused at every forward, not only the first
        with pytest.raises(ValueError, match=r"set_max_inflight_all_gathers was called on '0' \(Linear\), which is "
                                             r"not the root: .*call it on the root module \(Sequential\)"):
            model(torch.randn(2, 3))


def test_max_inflight_on_a_non_root_after_the_first_forward():
    model = _two_units()
    model(torch.randn(2, 3))
    with pytest.raises(ValueError, match=r"'0' is not the root \(its root is Sequential\); .*call it on the root"):
        model[0].set_max_inflight_all_gathers(0)
    model.set_max_inflight_all_gathers(0)  # the root may
    model(torch.randn(2, 3)).sum().backward()


def test_reshard_after_forward_int_must_divide_the_world_size():
    fully_shard(nn.Linear(3, 3), reshard_after_forward=1)  # W = 1 here: 1 is both "all ranks" and "none"
    with pytest.raises(ValueError, match=r"reshard_after_forward=2 must be a group size that divides the world size 1"):
        fully_shard(nn.Linear(3, 3), reshard_after_forward=2)
    with pytest.raises(TypeError, match="reshard_after_forward must be a bool, an int or None"):
        fully_shard(nn.Linear(3, 3), reshard_after_forward="yes")
