"""Port of upstream ``test/distributed/fsdp/test_fsdp_state_dict.py`` and the FSDP1 parts of
``test_fsdp_optim_state.py``: ``state_dict_type`` FULL_STATE_DICT (``rank0_only``,
``offload_to_cpu``) and SHARDED_STATE_DICT through ``torch.distributed.checkpoint``, loading
into a freshly wrapped model, ``optim_state_dict`` / ``optim_state_dict_to_load``, NO_SHARD's
full state dict and ``buffer_dtype``. Full state dicts are compared with torch's FSDP1's (keys,
order, values); sharded ones (torch: ShardedTensor, flashfsdp: DTensor) by what they load.
"""

from __future__ import annotations

import copy
import shutil
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from tests.fsdp1_suite.common import (
    FP32, FSDP, Block, api, batch, full_params, make_net, reference_step, replicate, train_against_reference,
    wrap,
)
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)
EXP_AVG_REASON = ("torch 2.13's FSDP1 on CPU gives (and loads) a full Adam exp_avg other than the replicated "
                  "reference's "
                  "(exp_avg_sq and step match)")


def _trained(rank, world_size, impl, seed: int = 0, steps: int = 2, **kwargs):
    """A nested wrapped Net after ``steps`` Adam steps (checked against the reference) and its optimizer."""
    model = make_net(seed)
    ref = replicate(model)
    fsdp_model = wrap(impl, model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, **kwargs)
    optim = torch.optim.Adam(fsdp_model.parameters(), lr=1e-2)
    train_against_reference(rank, world_size, impl, model, fsdp_model, ref, steps=steps)
    for step in range(steps):  # the state the optimizer keeps
        fsdp_model(batch(step, rank, world_size)[0]).sum().backward()
        optim.step()
        optim.zero_grad()
    return fsdp_model, optim


def _shared_dir() -> str:
    box = [tempfile.mkdtemp(prefix="fsdp1_sd_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _full_rank0(rank, world_size, impl, offload_to_cpu: bool):
    """test_state_dict_rank0_offload_save_load: rank 0 gets the unwrapped model's keys in order (on
    the CPU with ``offload_to_cpu``); the other ranks get nothing."""
    fsdp_model, _ = _trained(rank, world_size, impl)
    config = api(impl).FullStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=True)
    with FSDP(impl).state_dict_type(fsdp_model, api(impl).StateDictType.FULL_STATE_DICT, config):
        sd = fsdp_model.state_dict()
    if rank != 0:
        assert sd == {}, list(sd)
        return {}
    assert list(sd) == list(make_net().state_dict()), list(sd)
    assert all(v.device.type == "cpu" for v in sd.values())
    return dict(sd)


@cases.case()
def full_state_dict_rank0(rank, world_size, impl):
    return _full_rank0(rank, world_size, impl, offload_to_cpu=False)


@cases.case(torch_reason="torch 2.13's FSDP1 dies (SIGSEGV) in FULL_STATE_DICT with offload_to_cpu=True on CPU")
def full_state_dict_rank0_offload(rank, world_size, impl):
    return _full_rank0(rank, world_size, impl, offload_to_cpu=True)


@cases.case()
def full_state_dict_load(rank, world_size, impl):
    """test_state_dict_load_into_local_module / save-load: the default (FULL) state dict of a trained
    model loaded into a freshly wrapped one on every rank gives the same parameters."""
    fsdp_model, _ = _trained(rank, world_size, impl)
    sd = fsdp_model.state_dict()
    fresh = wrap(impl, make_net(seed=5), auto_wrap_policy=ModuleWrapPolicy({Block}))
    fresh.load_state_dict(sd)
    got, want = full_params(impl, fresh), full_params(impl, fsdp_model)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    return got


@cases.case()
def sharded_state_dict_dcp(rank, world_size, impl):
    """test_fsdp_state_dict SHARDED_STATE_DICT: ``dcp.save`` of the sharded state dict, ``dcp.load``
    into another wrapped model's, ``load_state_dict``: the same parameters."""
    fsdp_model, _ = _trained(rank, world_size, impl)
    sharded = api(impl).StateDictType.SHARDED_STATE_DICT
    path = _shared_dir()
    try:
        with FSDP(impl).state_dict_type(fsdp_model, sharded):
            dcp.save(fsdp_model.state_dict(), checkpoint_id=path)
        fresh = wrap(impl, make_net(seed=5), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True)
        with FSDP(impl).state_dict_type(fresh, sharded):
            sd = fresh.state_dict()
            assert sorted(sd) == sorted(make_net().state_dict()), sorted(sd)
            dcp.load(sd, checkpoint_id=path)
            fresh.load_state_dict(sd)
    finally:
        dist.barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    got, want = full_params(impl, fresh), full_params(impl, fsdp_model)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0)
    return got


@cases.case(torch_reason=EXP_AVG_REASON)
def optim_full_state_dict(rank, world_size, impl):
    """test_fsdp_optim_state: the full optimizer state dict, keyed by the unwrapped names, holds
    the replicated reference's Adam state."""
    model = make_net()
    ref = replicate(model)
    fsdp_model = wrap(impl, model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True)
    optim, ref_optim = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (fsdp_model, ref))
    for step in range(2):
        local, whole = batch(step, rank, world_size)
        fsdp_model(local).sum().backward()
        reference_step(ref, whole, world_size)
        for opt in (optim, ref_optim):
            opt.step()
            opt.zero_grad()
    osd = FSDP(impl).optim_state_dict(fsdp_model, optim)
    assert sorted(osd["state"]) == sorted(n for n, _ in ref.named_parameters()), list(osd["state"])
    for name, param in ref.named_parameters():
        for key, value in ref_optim.state[param].items():
            torch.testing.assert_close(osd["state"][name][key].float(), value.float(), **FP32,
                                       msg=lambda m, k=f"{name}.{key}": f"{k}: {m}")
    return {n: {k: v.float() for k, v in e.items()} for n, e in osd["state"].items()}


@cases.case(torch_reason=EXP_AVG_REASON)
def optim_full_state_dict_to_load(rank, world_size, impl):
    """``optim_state_dict_to_load`` of the full optimizer state dict into a new optimizer over a
    model loaded with the same state dict: the next step is the same as the original's."""
    fsdp_model, optim = _trained(rank, world_size, impl)
    cls = FSDP(impl)
    osd = copy.deepcopy(cls.optim_state_dict(fsdp_model, optim))  # as if saved and read back
    fresh = wrap(impl, make_net(seed=5), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True)
    fresh.load_state_dict(fsdp_model.state_dict())
    fresh_optim = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    fresh_optim.load_state_dict(cls.optim_state_dict_to_load(fresh, fresh_optim, osd))
    for model, opt in ((fsdp_model, optim), (fresh, fresh_optim)):
        model(batch(7, rank, world_size)[0]).sum().backward()
        opt.step()
    got, want = full_params(impl, fresh), full_params(impl, fsdp_model)
    for name in want:
        torch.testing.assert_close(got[name], want[name], **FP32)
    return got


@cases.case()
def optim_sharded_state_dict_roundtrip(rank, world_size, impl):
    """SHARDED_STATE_DICT optimizer state: back into a new optimizer through
    ``optim_state_dict_to_load``, the next step is the same."""
    fsdp_model, optim = _trained(rank, world_size, impl)
    cls, sharded = FSDP(impl), api(impl).StateDictType.SHARDED_STATE_DICT
    with cls.state_dict_type(fsdp_model, sharded):
        osd = cls.optim_state_dict(fsdp_model, optim)
        new_optim = torch.optim.Adam(fsdp_model.parameters(), lr=1e-2)
        new_optim.load_state_dict(cls.optim_state_dict_to_load(fsdp_model, new_optim, osd))
    before = full_params(impl, fsdp_model)
    fsdp_model(batch(7, rank, world_size)[0]).sum().backward()
    new_optim.step()
    after = full_params(impl, fsdp_model)
    assert any(not torch.equal(before[n], after[n]) for n in before)
    return after


@cases.case()
def no_shard_sharded_is_full(rank, world_size, impl):
    """test_fsdp_state_dict NO_SHARD: SHARDED_STATE_DICT gives the full state dict, with a warning."""
    fsdp_model, _ = _trained(rank, world_size, impl, sharding_strategy=api(impl).ShardingStrategy.NO_SHARD)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with FSDP(impl).state_dict_type(fsdp_model, api(impl).StateDictType.SHARDED_STATE_DICT):
            sd = fsdp_model.state_dict()
    assert any("full_state_dict will be returned" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert list(sd) == list(make_net().state_dict())
    return {k: v.to_local() if hasattr(v, "to_local") else v for k, v in sd.items()}


@cases.case()
def buffer_dtype_restored(rank, world_size, impl):
    """test_fsdp_mixed_precision buffers: ``buffer_dtype`` casts the buffers for compute; the full
    state dict has them in their original dtype."""
    mp = api(impl).MixedPrecision(buffer_dtype=torch.float16)
    fsdp_model = wrap(impl, make_net(), auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=mp)
    fsdp_model(batch(0, rank, world_size)[0])
    assert all(b.dtype == torch.float16 for b in fsdp_model.buffers())
    sd = fsdp_model.state_dict()
    assert all(sd[f"blocks.{i}.scale"].dtype == torch.float32 for i in range(2))
    return dict(sd)


test_case = cases.pytest_tests()
