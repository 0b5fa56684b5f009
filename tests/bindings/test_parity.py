"""Training parity: flashfsdp at W = 1, 2, 4 against the replicated reference and torch FSDP2."""

from __future__ import annotations

import math

import pytest
import torch

from flashfsdp import MixedPrecisionPolicy
from tests.harness import run_distributed
from tests.training import CountingCommunicator, train_flashfsdp, train_reference, train_torch_fsdp2

FP32 = dict(rtol=1e-5, atol=1e-6)
# Parameters after 5 AdamW steps: Adam divides by sqrt(v), so a summation-order difference in a
# near-zero gradient moves a weight by up to ~lr·1e-4; torch FSDP2 differs from the reference by
# the same amount (checked below).
FP32_PARAMS = dict(rtol=1e-5, atol=1e-5)


def _assert_params_close(got: dict, want: dict, **tol) -> None:
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name].float(), want[name].float(), msg=lambda m: f"{name}: {m}", **tol)


def _assert_trained_like(result: dict, ref: dict) -> None:
    """Losses at every step and the final parameters match the replicated reference (fp32)."""
    torch.testing.assert_close(result["losses"], ref["losses"], **FP32)
    _assert_params_close(result["params"], ref["params"], **FP32_PARAMS)


def _flash_and_fsdp2(rank, world_size, kind):
    flash = train_flashfsdp(kind, rank, world_size)
    fsdp2 = train_torch_fsdp2(kind, rank, world_size)
    return {"flash": flash, "fsdp2": fsdp2}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("kind", ["mlp", "llama"])
def test_matches_reference_and_fsdp2(kind, world_size):
    results = run_distributed(_flash_and_fsdp2, world_size, kind)
    ref = train_reference(kind, world_size)
    for r in results:
        torch.testing.assert_close(r["flash"]["losses"], ref["losses"], **FP32)
        _assert_params_close(r["flash"]["params"], ref["params"], **FP32_PARAMS)
        torch.testing.assert_close(r["flash"]["losses"], r["fsdp2"]["losses"], **FP32)
        _assert_params_close(r["flash"]["params"], r["fsdp2"]["params"], **FP32_PARAMS)
        _assert_params_close(r["fsdp2"]["params"], ref["params"], **FP32_PARAMS)


BF16_STEPS = 8


def _bf16(rank, world_size):
    # One batch repeated: the model memorises it and the loss falls by ~1.6 in 8 steps (on fresh
    # random tokens each step it could not fall at all).
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return {
        "flash": train_flashfsdp("llama", rank, world_size, BF16_STEPS, mp_policy=policy, repeat_batch=True),
        "fsdp2": train_torch_fsdp2("llama", rank, world_size, BF16_STEPS, mp_policy=_torch_policy(), repeat_batch=True),
    }


def _torch_policy():
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy  # noqa: PLC0415

    return TorchPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def test_bf16_param_dtype_matches_to_bf16_tolerance():
    results = run_distributed(_bf16, 2)
    ref = train_reference("llama", 2, BF16_STEPS, repeat_batch=True)
    loss_tol = 1e-2  # bf16 forward/backward vs the fp32 reference, per step (observed: < 4e-3)
    drop = ref["losses"][0] - ref["losses"][-1]
    assert drop > 1.0 and drop > 50 * loss_tol, ref["losses"]
    bf16 = dict(rtol=2e-2, atol=2e-2)
    for r in results:
        flash = r["flash"]["losses"]
        assert flash[0] - flash[-1] > 1.0, flash
        torch.testing.assert_close(flash, ref["losses"], rtol=0, atol=loss_tol)
        torch.testing.assert_close(flash, r["fsdp2"]["losses"], rtol=0, atol=1e-3)
        _assert_params_close(r["flash"]["params"], r["fsdp2"]["params"], **bf16)
        # Against the fp32 reference, elementwise AdamW steps (±lr) on near-zero gradients may
        # flip sign in bf16: each parameter must be as close to it as torch FSDP2's bf16 run is.
        for name, want in ref["params"].items():
            err = (r["flash"]["params"][name] - want).norm() / want.norm()
            err_fsdp2 = (r["fsdp2"]["params"][name] - want).norm() / want.norm()
            assert err <= 1.5 * err_fsdp2 + 1e-3, f"{name}: relative error {err:.2e}, FSDP2's {err_fsdp2:.2e}"


def _bf16_reduce(rank, world_size):
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy  # noqa: PLC0415

    from flashfsdp.runtime.process_group import ProcessGroupCommunicator  # noqa: PLC0415

    comm = CountingCommunicator(ProcessGroupCommunicator())
    # max_norm far above the norm: nothing is clipped, but the gradient norm is reported (AdamW
    # alone would hide a wrongly scaled gradient: its step does not depend on the scale).
    flash = train_flashfsdp("mlp", rank, world_size, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),
                            communicator=comm, max_norm=1e6)
    fsdp2 = train_torch_fsdp2("mlp", rank, world_size, mp_policy=TorchPolicy(reduce_dtype=torch.bfloat16))
    return {"flash": flash, "fsdp2": fsdp2, "dtypes": set(comm.reduce_scatter_dtypes)}


def test_bf16_reduce_dtype_with_fp32_params_at_four_ranks():
    """fp32 compute, bf16 gradient reduce-scatter (pre-divide 2, post-divide 2 at W = 4)."""
    results = run_distributed(_bf16_reduce, 4)
    ref = train_reference("mlp", 4, max_norm=1e6)
    for r in results:
        assert r["dtypes"] == {torch.bfloat16}
        torch.testing.assert_close(r["flash"]["norms"], ref["norms"], rtol=1e-2, atol=0)
        # bf16 gradients shift the loss by < 3e-4 (FSDP2's too); the first steps move it by ~0.06.
        torch.testing.assert_close(r["flash"]["losses"], ref["losses"], rtol=0, atol=1e-3)
        torch.testing.assert_close(r["flash"]["losses"], r["fsdp2"]["losses"], rtol=0, atol=1e-3)
        for name, want in ref["params"].items():
            # AdamW moves a weight by about lr wherever a bf16-rounded gradient flips sign.
            for other in (want, r["fsdp2"]["params"][name]):
                err = (r["flash"]["params"][name] - other).norm() / other.norm()
                assert err < 2e-2, f"{name}: relative error {err:.2e}"


NORM_TYPES = (1.0, 3.0, math.inf)


def _two_rank_mlp_runs(rank, world_size):
    """Several short MLP trainings at W = 2 in one spawn (each is cheap, a spawn is not)."""
    from flashfsdp.runtime.process_group import ProcessGroupCommunicator  # noqa: PLC0415

    return {
        "accumulate": train_flashfsdp("mlp", rank, world_size, grad_accum=4,
                                      communicator=CountingCommunicator(ProcessGroupCommunicator())),
        "keep_unsharded": train_flashfsdp("mlp", rank, world_size, grad_accum=4,
                                          keep_unsharded_between_micro_batches=True),
        "mesh": train_flashfsdp("mlp", rank, world_size, use_mesh=True),
        "clip": {nt: train_flashfsdp("mlp", rank, world_size, 3, max_norm=0.05, norm_type=nt) for nt in NORM_TYPES},
    }


@pytest.fixture(scope="module")
def two_rank_mlp_runs():
    return run_distributed(_two_rank_mlp_runs, 2)


def test_gradient_accumulation_without_sync_equals_big_batch(two_rank_mlp_runs):
    ref = train_reference("mlp", 2, grad_accum=4)
    for r in two_rank_mlp_runs:
        _assert_trained_like(r["accumulate"], ref)
        # No gradient communication in the 3 micro-batches without sync; in the synced one the
        # gradients accumulated in the 5 units (3 blocks, the one-bias unit, the root) share one
        # reduce-scatter: the small MLP fits in one bucket (5 steps of 4 micro-batches).
        assert r["accumulate"]["reduce_scatters"] == [0, 0, 0, 1] * 5


def test_reshard_after_backward_false_keeps_parameters_for_the_next_micro_batch(two_rank_mlp_runs):
    ref = train_reference("mlp", 2, grad_accum=4)
    for r in two_rank_mlp_runs:
        assert r["keep_unsharded"]["unsharded_after_no_sync"] == [True] * 15
        _assert_trained_like(r["keep_unsharded"], ref)


def test_one_dimensional_mesh_trains_like_the_reference(two_rank_mlp_runs):
    ref = train_reference("mlp", 2)
    for r in two_rank_mlp_runs:
        _assert_trained_like(r["mesh"], ref)


@pytest.mark.parametrize("norm_type", NORM_TYPES)
def test_clip_grad_norm_of_other_orders_matches_torch(two_rank_mlp_runs, norm_type):
    ref = train_reference("mlp", 2, 3, max_norm=0.05, norm_type=norm_type)
    for r in two_rank_mlp_runs:
        got = r["clip"][norm_type]
        torch.testing.assert_close(got["norms"], ref["norms"], **FP32)
        assert all(n > 0.05 for n in ref["norms"])  # every step clipped
        _assert_params_close(got["params"], ref["params"], **FP32_PARAMS)


def _clip(rank, world_size, kind):
    return train_flashfsdp(kind, rank, world_size, max_norm=0.05)


@pytest.mark.parametrize("kind", ["mlp", "llama"])
def test_clip_grad_norm_matches_torch(kind):
    results = run_distributed(_clip, 2, kind)
    ref = train_reference(kind, 2, max_norm=0.05)
    for r in results:
        torch.testing.assert_close(r["norms"], ref["norms"], **FP32)
        _assert_params_close(r["params"], ref["params"], **FP32_PARAMS)


def _checkpointed(rank, world_size, kind):
    return {mode: train_flashfsdp(kind, rank, world_size, checkpoint=mode) for mode in (True, "reentrant")}


@pytest.mark.parametrize("kind", ["mlp", "llama"])
def test_activation_checkpointing(kind):
    """Non-reentrant and reentrant ``torch.utils.checkpoint`` around every block."""
    results = run_distributed(_checkpointed, 2, kind)
    ref = train_reference(kind, 2)
    for r in results:
        _assert_trained_like(r[True], ref)
        _assert_trained_like(r["reentrant"], ref)


def _no_reshard(rank, world_size):
    return train_flashfsdp("llama", rank, world_size, reshard_after_forward=False)


def test_reshard_after_forward_false():
    results = run_distributed(_no_reshard, 2)
    ref = train_reference("llama", 2)
    for r in results:
        _assert_trained_like(r, ref)


def _cuda_w1(rank, world_size, communicator):
    import torch.nn as nn  # noqa: PLC0415

    import flashfsdp  # noqa: PLC0415
    from tests.models import make_mlp  # noqa: PLC0415

    from flashfsdp.kernels import dispatch  # noqa: PLC0415

    dispatch.reset_backend_counts()
    model, ref = make_mlp().cuda(), make_mlp().cuda()
    for unit in model.units():
        flashfsdp.fully_shard(unit, communicator=communicator)
    losses = []
    for m in (model, ref):
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        out = []
        for step in range(5):
            x = torch.randn(4, 7, generator=torch.Generator().manual_seed(step)).cuda()
            loss = m(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            out.append(loss.item())
        losses.append(out)
    assert isinstance(model, nn.Module)
    return losses, dispatch.backend_counts()


@pytest.mark.gpu
@pytest.mark.parametrize("communicator", ["nccl", "process_group"])
def test_cuda_single_rank_matches_unsharded(communicator):
    backend = "nccl" if communicator == "process_group" else "gloo"  # CuPy NCCL needs only the store
    ((flash, ref), counts) = run_distributed(_cuda_w1, 1, communicator, kernels=None, backend=backend)[0]
    torch.testing.assert_close(flash, ref, rtol=1e-5, atol=1e-6)
    for op in ("flatten", "accumulate_grad_shard"):  # copy-in and packing; the reduced gradient
        assert counts.get((op, "triton", "cuda")), f"{op} did not run its Triton kernel on CUDA: {counts}"
    assert not any(key[1:] == ("reference", "cuda") for key in counts), counts


def _hpz(rank, world_size):
    return train_flashfsdp("llama", rank, world_size, reshard_after_forward=2)


def test_reshard_after_forward_to_a_smaller_group_hpz():
    results = run_distributed(_hpz, 4)
    ref = train_reference("llama", 4)
    for r in results:
        _assert_trained_like(r, ref)


def _hpz_memory(rank, world_size):
    import flashfsdp  # noqa: PLC0415
    from tests.models import make_llama  # noqa: PLC0415

    model = make_llama()
    for block in model.layers:
        flashfsdp.fully_shard(block, reshard_after_forward=2)
    flashfsdp.fully_shard(model)
    logits = model(torch.randint(0, 64, (1, 8)))
    unit = model.layers[0]._flashfsdp_state.unit
    after_forward = unit.memory_bytes()
    sub = unit.post_forward_comm
    logits.sum().backward()
    return after_forward, unit.memory_bytes(), sub.world_size, unit.groups[0].layout.gathered_size


def test_hpz_keeps_one_slice_of_the_group_between_forward_and_backward():
    for after_forward, after_backward, k, gathered in run_distributed(_hpz_memory, 4):
        assert k == 2  # the post-forward group: 2 of the 4 ranks, each keeps half the gathered fp32 buffer
        assert after_forward["unsharded"] == 0 and after_forward["secondary"] == gathered // 2 * 4
        assert after_backward["secondary"] == 0 and after_backward["unsharded"] == 0


def _forward_without_backward(rank, world_size):
    import flashfsdp  # noqa: PLC0415
    from tests.models import make_llama  # noqa: PLC0415

    model = make_llama(seed=0)
    for block in model.layers:
        flashfsdp.fully_shard(block, reshard_after_forward=2)
    flashfsdp.fully_shard(model)
    tokens = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    model(tokens)  # grad enabled, no backward: the root stays unsharded, the blocks keep hpZ slices
    flashfsdp.set_full_state_dict(model, make_llama(seed=1).state_dict())  # new master weights
    with torch.no_grad():
        return model(tokens)


def test_forward_without_backward_leaves_nothing_stale():
    from tests.models import make_llama  # noqa: PLC0415

    want = make_llama(seed=1)(torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0)))
    for fresh in run_distributed(_forward_without_backward, 4):
        torch.testing.assert_close(fresh, want, rtol=1e-5, atol=1e-5)


def test_clip_grad_norm_reads_gradients_changed_without_a_version_bump():
    """torch's GradScaler.unscale_ (``_amp_foreach_non_finite_check_and_unscale_``) and in-place ops
    through ``.grad.data`` change gradients without bumping their version counters: the norm is
    the one of the gradients as they are now, not the one the reduction saw."""
    import flashfsdp  # noqa: PLC0415
    from tests.models import loss_fn, make_batch  # noqa: PLC0415
    from tests.training import make_model, units_of  # noqa: PLC0415

    model = make_model("mlp")
    for unit in units_of("mlp", model):
        flashfsdp.fully_shard(unit)
    x, y = make_batch("mlp", 0, 4)
    loss_fn("mlp", model(x), y).backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    torch._amp_foreach_non_finite_check_and_unscale_(grads, torch.zeros(1), torch.tensor(0.25))
    grads[0].data.mul_(3.0)
    want = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads]))
    got = flashfsdp.clip_grad_norm_(model, max_norm=1e9)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
