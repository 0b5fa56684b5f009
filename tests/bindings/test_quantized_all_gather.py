"""MixedPrecisionPolicy(all_gather_dtype=torch.int8): ZeRO++ qwZ all-gathers.

The unsharded parameters are exactly deq(q(master)) of every rank's shard (W = 1 and W = 2 gloo),
the all-gather carries int8 (values + scales: 0.508x of bf16's bytes), gradients keep their
reduce-scatter dtype, losses stay close to the bf16 run's, and bad input is refused naming
``all_gather_dtype``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import flashfsdp
from flashfsdp import MixedPrecisionPolicy
from flashfsdp.kernels import reference
from flashfsdp.kernels.quantize import packed_nbytes
from flashfsdp.runtime.communicator import LocalCommunicator
from flashfsdp.runtime.unit import ShardedUnit
from tests.harness import run_distributed
from tests.training import CountingCommunicator, make_model, train_flashfsdp, units_of

INT8 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, all_gather_dtype=torch.int8)
BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


class RecordingCommunicator(CountingCommunicator):
    """Also records each all-gather's (input dtype, input bytes); declares int8 all-gathers."""

    all_gather_dtypes = (torch.int8,)

    def __init__(self, inner):
        super().__init__(inner)
        self.all_gathers: list[tuple[torch.dtype, int]] = []

    def all_gather_into_tensor(self, out, inp):
        self.all_gathers.append((inp.dtype, inp.numel() * inp.element_size()))
        return super().all_gather_into_tensor(out, inp)


def expected_unsharded(group, world_size: int) -> list[torch.Tensor]:
    """Each parameter as deq(q(every rank's master shard)) gives it, in ``param_dtype`` (reference
    kernels): rank r's dequantised shard holds the parameter's dim-0 chunk r at its offset."""
    shard = group.sharded_flat.detach().float()
    full = torch.empty(world_size * shard.numel())
    if world_size > 1:
        dist.all_gather_into_tensor(full, shard)
    else:
        full.copy_(shard)
    chunk = packed_nbytes(shard.numel())
    packed = torch.cat([reference.quantize_int8(c, torch.empty(chunk, dtype=torch.int8)) for c in full.chunk(world_size)])
    shards = reference.dequantize_int8(packed, torch.empty(full.numel(), dtype=group.param_dtype),
                                       chunks=world_size).chunk(world_size)
    lay = group.layout
    return [torch.cat([shards[r][lay.offsets[i] : lay.offsets[i] + lay.local_numel(r, i)] for r in range(world_size)])
            .view(shape) for i, shape in enumerate(lay.shapes)]


def check_unsharded_is_dequantised_master(model: nn.Module, world_size: int) -> int:
    """Unshard every unit; assert its parameters equal deq(q(master)) exactly; return the groups seen."""
    seen = 0
    for module in model.modules():
        state = module.__dict__.get("_flashfsdp_state")
        if state is None or module is not state.modules[0]:
            continue
        module.unshard()
        for group in state.unit.groups:
            for got, want in zip(group.unsharded_params, expected_unsharded(group, world_size), strict=True):
                assert torch.equal(got, want), state.unit.name
            seen += 1
        module.reshard()
    return seen


def _two_ranks(rank, world_size):
    from flashfsdp.runtime.process_group import ProcessGroupCommunicator  # noqa: PLC0415

    comm = RecordingCommunicator(ProcessGroupCommunicator())
    model = make_model("llama")
    for unit in units_of("llama", model):
        flashfsdp.fully_shard(unit, mp_policy=INT8, communicator=comm)
    groups = check_unsharded_is_dequantised_master(model, world_size)
    sizes = [(g.layout.shard_size, g.param_dtype) for m in model.modules()
             if m.__dict__.get("_flashfsdp_state") is not None for g in m._flashfsdp_state.unit.groups]
    before = len(comm.all_gathers)
    with flashfsdp.profile() as prof:  # the profile's byte counters count what the wire carries
        model(torch.randint(0, 64, (2, 8))).sum().backward()
    counted = sum(v for k, v in prof.summary()["counters"].items() if k.startswith("all_gather_bytes_"))
    wire = world_size * sum(nbytes for _, nbytes in comm.all_gathers[before:])
    int8 = train_flashfsdp("llama", rank, world_size, steps=4, mp_policy=INT8, communicator=comm)
    bf16 = train_flashfsdp("llama", rank, world_size, steps=4, mp_policy=BF16)
    return {"groups": groups, "all_gathers": comm.all_gathers, "reduce_scatter_dtypes": comm.reduce_scatter_dtypes,
            "int8": int8["losses"], "bf16": bf16["losses"], "sizes": sizes, "counted": counted, "wire": wire}


def test_two_ranks_gather_int8_and_train_like_bf16():
    """W = 2 gloo: unsharded parameters == deq(q(master)) bit for bit; every all-gather sends
    packed int8 (S values + a scale per 256); the reduce-scatter stays in bf16 (param_dtype);
    4 AdamW steps' losses within 1% of the bf16 run's."""
    results = run_distributed(_two_ranks, 2)
    for r in results:
        assert r["groups"] >= 3
        assert r["all_gathers"] and {dtype for dtype, _ in r["all_gathers"]} == {torch.int8}
        assert {nbytes for _, nbytes in r["all_gathers"]} == {packed_nbytes(s) for s, _ in r["sizes"]}
        assert set(r["reduce_scatter_dtypes"]) == {torch.bfloat16}
        assert r["counted"] == r["wire"] > 0
        torch.testing.assert_close(r["int8"], r["bf16"], rtol=1e-2, atol=0)
        assert r["int8"] != r["bf16"]  # the quantisation is really applied


def _secondary(rank, world_size):
    return [train_flashfsdp("mlp", rank, world_size, steps=2, mp_policy=INT8, reshard_after_forward=value)["losses"]
            for value in (True, 2)]


def test_post_forward_sharding_keeps_the_dequantised_values():
    """W = 4, reshard_after_forward=2 (hpZ): the backward gathers the dequantised values kept after
    forward within pairs of ranks, the very values an int8 re-gather of the unchanged master gives:
    the same losses as resharding fully."""
    for full, pairs in run_distributed(_secondary, 4):
        assert full == pairs


def test_one_rank_forward_backward_uses_dequantised_weights():
    """W = 1: the forward sees deq(q(master)) in bf16, the gradients reach the fp32 master."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 40), nn.Tanh(), nn.Linear(40, 3))
    flashfsdp.fully_shard(model, mp_policy=INT8)
    assert check_unsharded_is_dequantised_master(model, 1) == 1
    model(torch.randn(5, 300)).float().sum().backward()
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("value, error, pattern", [
    (torch.float16, ValueError, r"all_gather_dtype must be torch.int8 or None, got torch.float16; .* param_dtype"),
    (torch.uint8, ValueError, r"all_gather_dtype must be torch.int8 or None, got torch.uint8"),
    ("int8", TypeError, r"all_gather_dtype must be torch.int8 or None, got 'int8'"),
])
def test_policy_refuses_other_dtypes(value, error, pattern):
    with pytest.raises(error, match=pattern):
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, all_gather_dtype=value)


def test_policy_needs_a_floating_param_dtype():
    with pytest.raises(ValueError, match=r"all_gather_dtype=torch.int8 needs a floating param_dtype"):
        MixedPrecisionPolicy(all_gather_dtype=torch.int8)
    with pytest.raises(TypeError, match=r"MixedPrecisionPolicy.param_dtype must be a floating"):
        MixedPrecisionPolicy(param_dtype=torch.int32, all_gather_dtype=torch.int8)


def test_communicator_without_int8_is_refused():
    """A custom communicator that does not list torch.int8 in all_gather_dtypes: fully_shard says
    what to do instead of all-gathering bytes it may not carry."""
    with pytest.raises(ValueError, match=r"all_gather_dtype=torch.int8 but its communicator CountingCommunicator "
                                         r"does not all-gather int8; .*all_gather_dtypes"):
        flashfsdp.fully_shard(nn.Linear(4, 4), mp_policy=INT8, communicator=CountingCommunicator(LocalCommunicator()))


def test_unsupported_device_is_refused():
    with pytest.raises(ValueError, match=r"unit 'u': all_gather_dtype=torch.int8 needs CPU or CUDA tensors, the unit is on mps"):
        ShardedUnit("u", [torch.zeros(4)], ["w"], LocalCommunicator(), torch.device("mps"),
                    param_dtype=torch.bfloat16, all_gather_dtype=torch.int8)
    with pytest.raises(ValueError, match=r"unit 'u': all_gather_dtype must be torch.int8 or None"):
        ShardedUnit("u", [torch.zeros(4)], ["w"], LocalCommunicator(), torch.device("cpu"), all_gather_dtype=torch.half)


def test_torch_policy_converts_without_quantisation():
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy  # noqa: PLC0415

    model = flashfsdp.fully_shard(nn.Linear(4, 4), mp_policy=TorchPolicy(param_dtype=torch.bfloat16))
    assert model._flashfsdp_state.unit.all_gather_dtype is None


@pytest.mark.gpu
def test_cuda_unit_dequantises_on_the_all_gather_stream():
    """On a GPU (W = 1): copy-in quantises and the wait dequantises with the compiled kernels (the
    gpu fixture checks that no CUDA call took the reference), the unsharded parameters equal
    deq(q(master)) computed by the reference, and a step trains."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(300, 40), nn.Tanh(), nn.Linear(40, 3)).cuda()
    flashfsdp.fully_shard(model, mp_policy=INT8)
    model.unshard()
    for group in model._flashfsdp_state.unit.groups:
        shard = group.sharded_flat.detach()
        packed = reference.quantize_int8(shard, torch.empty(packed_nbytes(shard.numel()), dtype=torch.int8, device="cuda"))
        want = reference.dequantize_int8(packed, torch.empty_like(group.unsharded_flat))
        assert torch.equal(group.unsharded_flat, want)
    model.reshard()
    model(torch.randn(5, 300, device="cuda")).float().sum().backward()
    assert all(p.grad is not None and bool(p.grad.isfinite().all()) for p in model.parameters())
