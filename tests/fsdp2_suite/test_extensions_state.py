"""State dicts and refusals of parameters with FSDP2's all-gather extensions (``runtime/extensions.py``).

A tensor-subclass parameter whose class defines ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``
keeps its subclass as its DTensor's local tensor, outside its unit's flat shard. Here, against
torch's fully_shard side by side: the sharded state dict (``model.state_dict()``) holds DTensors
over the subclass, each entry its own parameter's values (two same-shaped subclass parameters in
one unit), loads back, and round-trips through DCP. flashfsdp only: the full state dict gives
``full_tensor()`` of such a parameter; the paths that work on the flat shard (``flashfsdp.optim``,
``set_full_state_dict``, FSDP1's ``summon_full_params``) refuse it, naming the parameter; and the
combinations flashfsdp does not support (CPU offload, Shard(k != 0), ``all_gather_dtype``, one hook
only, a malformed ``fsdp_pre_all_gather`` result) raise, naming the parameter.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

from tests.fsdp2_suite.common import rank_seed
from tests.fsdp2_suite.runner import CaseSet
from tests.fsdp2_suite.test_extensions import _patched_two_tensor, _post, _pre_v2
from tests.fsdp2_suite.test_init import assert_raises
from tests.fsdp2_suite.test_state_dict import shared_tmpdir

cases = CaseSet(__name__)


def _two_linears() -> nn.Module:
    """Two Linear(8, 8) whose weights are TwoTensors (``b = 2·a``): same shapes, one unit."""
    from torch.testing._internal.two_tensor import TwoTensor  # noqa: PLC0415

    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for lin in model:
        lin.weight = nn.Parameter(TwoTensor(lin.weight.detach().clone(), lin.weight.detach() * 2))
    return model


def _parts(tensor: torch.Tensor) -> list[torch.Tensor]:
    """A (local) tensor's values as plain tensors: a TwoTensor's ``a`` and ``b``."""
    t = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return [t.a.detach().clone(), t.b.detach().clone()] if hasattr(t, "a") else [t.detach().clone()]


def _train_step(model: nn.Module, rank: int) -> torch.Tensor:
    optim = torch.optim.Adam(model.parameters(), lr=1e-1)
    rank_seed(rank)
    loss = model(torch.randn(2, 8)).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


def _check_entries(model: nn.Module, sd: dict) -> None:
    """Every state-dict entry of a parameter holds that parameter's own local values and type."""
    for name, param in model.named_parameters():
        value = sd[name]
        assert isinstance(value, DTensor), (name, type(value))
        assert type(value.to_local()) is type(param.to_local()), (name, type(value.to_local()))
        for got, want in zip(_parts(value), _parts(param), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0, msg=lambda m, name=name: f"{name}: {m}")


@cases.case(world_size=2)
def extension_sharded_state_dict(rank, world_size, impl):
    """The sharded state dict of a unit with two same-shaped TwoTensor weights (FSDP2's hooks
    patched on the class) and plain biases: DTensors whose local tensors are TwoTensors, each
    entry its own parameter's values; after a training step, loading the saved entries restores
    the parameters; the forward after it gives the first loss again."""
    with _patched_two_tensor(_pre_v2):
        model = _two_linears()
        impl.fully_shard(model)
        sd = model.state_dict()
        impl.record_types("sd", sd)
        impl.record_types("sd locals", [v.to_local() for v in sd.values()])
        _check_entries(model, sd)
        saved = {k: v.detach().clone() for k, v in sd.items()}
        before = [t for v in saved.values() for t in _parts(v)]
        first = _train_step(model, rank)
        model.load_state_dict(saved)
        _check_entries(model, saved)
        again = _train_step(model, rank)
        torch.testing.assert_close(again, first)
    return {"sd": before, "losses": [first, again]}


@cases.case(world_size=2)
def extension_dcp_round_trip(rank, world_size, impl):
    """``dcp.save`` of that sharded state dict, a training step, ``dcp.load`` (TwoTensor allowed
    by the loader) and ``load_state_dict``: the parameters (both inner tensors) are the saved ones."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415
    from torch.testing._internal.two_tensor import TwoTensor  # noqa: PLC0415

    with _patched_two_tensor(_pre_v2), shared_tmpdir() as tmp:
        model = _two_linears()
        impl.fully_shard(model)
        saved = [t for p in model.parameters() for t in _parts(p)]
        dcp.save(model.state_dict(), checkpoint_id=os.path.join(tmp, "ext"))
        loss = _train_step(model, rank)
        sd = model.state_dict()
        with torch.serialization.safe_globals([TwoTensor]):
            dcp.load(sd, checkpoint_id=os.path.join(tmp, "ext"))
        model.load_state_dict(sd)
        loaded = [t for p in model.parameters() for t in _parts(p)]
        for got, want in zip(loaded, saved, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    return {"saved": saved, "loss": loss}


FULL_REASON = "flashfsdp's get_full_state_dict / full_unit_params (torch has neither)"


@cases.case(world_size=2, torch_reason=FULL_REASON)
def extension_full_state_dict(rank, world_size, impl):
    """``get_full_state_dict`` (rank 0 only or every rank, on the CPU or the device) and
    ``full_unit_params``: a TwoTensor weight's full value is a TwoTensor equal to the unwrapped
    model's (both inner tensors), not the zero slot of the flat shard; plain entries as usual."""
    from flashfsdp.bindings.state_dict.full import full_unit_params  # noqa: PLC0415

    with _patched_two_tensor(_pre_v2):
        model = _two_linears()
        ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
        impl.fully_shard(model)
        first = impl.api.get_full_state_dict(model, cpu_offload=True, rank0_only=False)
        assert first.keys() == ref.keys(), first.keys()
        for key, value in ref.items():
            for a, b in zip(_parts(first[key]), _parts(value), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0, msg=lambda m, key=key: f"{key}: {m}")
        _train_step(model, rank)  # values that moved, on both inner tensors
        got = impl.api.get_full_state_dict(model, cpu_offload=True, rank0_only=False)
        for key in ref:
            assert (type(got[key]).__name__ == "TwoTensor") == key.endswith("weight"), (key, type(got[key]))
        for rank0_only, cpu_offload in ((True, True), (False, False)):
            other = impl.api.get_full_state_dict(model, cpu_offload=cpu_offload, rank0_only=rank0_only)
            assert other.keys() == (got.keys() if rank == 0 or not rank0_only else set()), other.keys()
            for key, value in other.items():
                for a, b in zip(_parts(value), _parts(got[key]), strict=True):
                    torch.testing.assert_close(a, b, rtol=0, atol=0)
        state = model._flashfsdp_state
        fulls = full_unit_params(state, torch.device("cpu"))
        names = [n for n, _ in model.named_parameters()]
        for i, value in fulls.items():
            for a, b in zip(_parts(value), _parts(got[names[i]]), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        for name, param in model.named_parameters():
            full = param.full_tensor()
            for a, b in zip(_parts(got[name]), _parts(full), strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
            assert all(t.abs().sum() > 0 for t in _parts(got[name])), name
    return {}


REFUSAL_REASON = "flashfsdp's own paths over the flat shard (flashfsdp.optim, set_full_state_dict, FSDP1 wrapper)"


@cases.case(world_size=2, torch_reason=REFUSAL_REASON)
def extension_flat_shard_paths_refused(rank, world_size, impl):
    """What works on the unit's flat shard refuses a TwoTensor parameter (its slot there is
    zero), naming it: ``flashfsdp.optim``'s AdamW and SGD at ``step``, ``set_full_state_dict``
    (before any broadcast), FSDP1's ``summon_full_params``; the parameters are unchanged after."""
    import flashfsdp.optim  # noqa: PLC0415
    from flashfsdp import FullyShardedDataParallel as FSDP  # noqa: PLC0415

    with _patched_two_tensor(_pre_v2):
        model = _two_linears()
        ref = {k: v.detach().clone() for k, v in model.state_dict().items()}
        impl.fully_shard(model)
        before = [t for p in model.parameters() for t in _parts(p)]
        rank_seed(rank)
        model(torch.randn(2, 8)).sum().backward()
        for cls in (flashfsdp.optim.AdamW, flashfsdp.optim.SGD):
            optim = cls(model.parameters(), lr=1e-1)
            assert_raises(NotImplementedError, optim.step, cls.__name__, "'0.weight'", "TwoTensor", "torch.optim")
        assert_raises(NotImplementedError, lambda: impl.api.set_full_state_dict(model, ref),
                      "set_full_state_dict", "'0.weight'", "sharded state dict")
        for got, want in zip([t for p in model.parameters() for t in _parts(p)], before, strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        wrapped = FSDP(_two_linears(), use_orig_params=True)

        def summon():
            with FSDP.summon_full_params(wrapped):
                pass

        assert_raises(NotImplementedError, summon, "summon_full_params", "'0.weight'", "TwoTensor")
    return {}


@contextlib.contextmanager
def _one_hook(name: str):
    """TwoTensor with only ``fsdp_pre_all_gather`` or only ``fsdp_post_all_gather``."""
    from torch.testing._internal.two_tensor import TwoTensor  # noqa: PLC0415

    setattr(TwoTensor, name, _pre_v2 if name == "fsdp_pre_all_gather" else _post)
    try:
        yield
    finally:
        delattr(TwoTensor, name)


ERRORS_REASON = "flashfsdp's refusals of extension cases it does not support (torch runs some of them)"


@cases.case(world_size=2, torch_reason=ERRORS_REASON)
def extension_unsupported_refused(rank, world_size, impl):
    """A TwoTensor weight with FSDP2's hooks is refused at ``fully_shard``, naming it, with CPU
    offload and with a Shard(1) placement; one hook only (either) is refused too; with
    ``all_gather_dtype=torch.int8`` the first forward refuses it; built on the meta device,
    ``to_empty`` refuses to convert it (the subclass is kept from ``fully_shard`` on)."""
    with _patched_two_tensor(_pre_v2):
        assert_raises(ValueError, lambda: impl.fully_shard(_two_linears(), offload_policy=impl.CPUOffloadPolicy()),
                      "'0.weight'", "CPU offload")
        assert_raises(ValueError, lambda: impl.fully_shard(_two_linears(), shard_placement_fn=lambda p: Shard(p.ndim - 1)),
                      "'0.weight'", "dim 1", "Shard(0)")
        model = impl.fully_shard(_two_linears(), mp_policy=impl.MixedPrecisionPolicy(
            param_dtype=torch.bfloat16, all_gather_dtype=torch.int8))
        assert_raises(ValueError, lambda: model(torch.randn(2, 8)), "'0.weight'", "all_gather_dtype")
        with torch.device("meta"):
            model = impl.fully_shard(_two_linears())
        assert_raises(ValueError, lambda: model.to_empty(device="cpu"), "'0.weight'", "TwoTensor",
                      "before fully_shard")
    for name in ("fsdp_pre_all_gather", "fsdp_post_all_gather"):
        with _one_hook(name):
            assert_raises(ValueError, lambda: impl.fully_shard(_two_linears()), "'0.weight'", name, "both")
    return {}


def _patch_plain(model: nn.Module, pre, post=None) -> None:
    """Patch ``pre`` (and ``post``) on the first weight's local tensor after fully_shard."""
    local = model[0].weight._local_tensor
    local.fsdp_pre_all_gather = pre.__get__(local)
    if post is not None:
        local.fsdp_post_all_gather = post.__get__(local)


@cases.case(world_size=2, torch_reason=ERRORS_REASON)
def extension_bad_hooks_refused(rank, world_size, impl):
    """Hooks monkey-patched on a plain local tensor, checked at the first forward, naming the
    parameter: only ``fsdp_pre_all_gather``; a result that is not ``(tuple of tensors, metadata)``
    (a bare tensor, a tuple of non-tensors, an empty tuple); a signature of another arity."""
    def post(self, outputs, metadata, param_dtype, *, out=None):
        return None if out is not None else (outputs[0], ())

    bad = {
        "bare tensor": lambda self, mesh: self,
        "non-tensors": lambda self, mesh: ((1, 2), None),
        "empty": lambda self, mesh: ((), None),
    }
    torch.manual_seed(0)
    model = impl.fully_shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    _patch_plain(model, lambda self, mesh: ((self,), None))
    assert_raises(ValueError, lambda: model(torch.randn(2, 8)), "'0.weight'", "fsdp_pre_all_gather only")
    for what, pre in bad.items():
        model = impl.fully_shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
        _patch_plain(model, pre, post)
        err = assert_raises(TypeError, lambda: model(torch.randn(2, 8)), "'0.weight'", "(all_gather_inputs, metadata)")
        assert what and err
    model = impl.fully_shard(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)))
    _patch_plain(model, lambda self, mesh, extra: ((self,), None), post)
    assert_raises(TypeError, lambda: model(torch.randn(2, 8)), "'0.weight'", "2 parameters")
    return {}


test_case = cases.pytest_tests()
