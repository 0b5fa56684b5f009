"""The FSDP2-compatible surface of fully_shard and FSDPModule: parameter names, FSDP2's defaults,
manual unshard/reshard."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor, Shard

import flashfsdp
from flashfsdp.runtime.param_tags import tag_of
from tests.harness import run_distributed
from tests.models import make_llama
from tests.training import gather_full_params, local_rows


def test_sharded_parameters_carry_fully_qualified_names():
    """Three nesting levels (attention, block, root), so grandchildren get their prefix too."""
    model = make_llama()
    names = [n for n, _ in make_llama().named_parameters()]
    for layer in model.layers:
        flashfsdp.fully_shard(layer.attention)
        flashfsdp.fully_shard(layer)
    flashfsdp.fully_shard(model)
    params = list(model.named_parameters())
    assert [n for n, _ in params] == names
    for name, param in params:
        assert tag_of(param).fqn == name
    fqns = [fqn for m in model.modules() if hasattr(m, "_flashfsdp_state")
            for g in m._flashfsdp_state.unit.groups for fqn in g.fqns]
    assert sorted(fqns) == sorted(names)
    assert "layers.1.attention.wq.weight" in fqns


def test_reshard_after_forward_none_is_fsdp2_default():
    """None: non-root units reshard after forward, the root keeps its parameters for backward."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    ref = copy.deepcopy(model)
    flashfsdp.fully_shard(model[0], reshard_after_forward=None)
    flashfsdp.fully_shard(model, reshard_after_forward=None)
    x = torch.randn(3, 4)
    out = model(x)
    assert model[0]._flashfsdp_state.unit.memory_bytes()["unsharded"] == 0
    assert model._flashfsdp_state.unit.memory_bytes()["unsharded"] > 0
    out.sum().backward()
    ref(x).sum().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)  # one process: full-shape plain tensors


def _manual_unshard(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))
    ref = copy.deepcopy(model)
    flashfsdp.fully_shard(model[0])
    flashfsdp.fully_shard(model)
    x = torch.randn(2 * world_size, 5, generator=torch.Generator().manual_seed(1))
    handle = model[0].unshard(async_op=True)
    unsharded_before_wait = isinstance(handle, flashfsdp.UnshardHandle)
    handle.wait()
    handle.wait()  # a second wait does nothing
    model.unshard()
    unsharded = [(tuple(p.shape), isinstance(p, DTensor)) for p in model.parameters()]
    out = model(local_rows(x, rank, world_size))
    out.pow(2).sum().backward()
    model.reshard()
    model[0].reshard()
    sharded = [(tuple(p.shape), tuple(p.placements), tuple(p.to_local().shape)) for p in model.parameters()]
    held = [m._flashfsdp_state.unit.memory_bytes()["unsharded"] for m in (model, model[0])]
    # The sum over ranks' rows of the squared outputs: the gradient is the sum of the ranks'.
    grads = {n: (tuple(p.grad.placements), p.grad.to_local().clone() * world_size) for n, p in model.named_parameters()}
    ref(x).pow(2).sum().backward()
    return {
        "handle": unsharded_before_wait, "unsharded": unsharded, "sharded": sharded, "held": held,
        "out": out.detach(), "want_out": ref(local_rows(x, rank, world_size)).detach(), "grads": grads,
        "ref_grads": {n: torch.chunk(p.grad, world_size, 0)[rank] for n, p in ref.named_parameters()},
        "params": gather_full_params(model), "ref_params": {n: p.detach() for n, p in ref.named_parameters()},
    }


def test_manual_unshard_async_and_reshard_around_forward():
    shapes = [(6, 5), (6,), (3, 6), (3,)]
    for rank, r in enumerate(run_distributed(_manual_unshard, 2)):
        assert r["handle"]
        assert r["unsharded"] == [(s, False) for s in shapes]  # full plain views while unsharded
        # DTensors again after reshard: rank r's dim-0 chunk (3 of 6 rows, 2 of 3 rows or 1)
        assert r["sharded"] == [(s, (Shard(0),), (len(torch.chunk(torch.empty(s), 2, 0)[rank]),) + s[1:])
                                for s in shapes]
        assert r["held"] == [0, 0]
        torch.testing.assert_close(r["out"], r["want_out"], rtol=1e-6, atol=1e-6)
        for name, (placements, grad) in r["grads"].items():
            assert placements == (Shard(0),), name
            torch.testing.assert_close(grad, r["ref_grads"][name], rtol=1e-5, atol=1e-6)
        for name, want in r["ref_params"].items():
            torch.testing.assert_close(r["params"][name], want)


def test_a_unit_without_parameters_computes_where_its_submodules_are_else_on_the_accelerator(monkeypatch):
    """FSDP2's default mesh (``mesh=None``) is on the accelerator whatever the process group's
    backend; a root with no parameters of its own computes where its blocks' tensors are, and a
    module with no tensors at all on the accelerator (the CPU where there is none)."""
    from flashfsdp.bindings import _init

    stack = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert _init.unit_device([stack], [], None) == torch.device("cpu")
    with torch.device("meta"):
        on_meta = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    empty = nn.Module()
    assert _init.unit_device([empty], [], None) == torch.device(_init.default_device_type())
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("xpu"))
    assert _init.default_device_type() == "xpu"
    assert _init.unit_device([empty], [], None) == torch.device("xpu")
    assert _init.target_device(torch.device("meta"), None) == torch.device("xpu")
    assert _init.target_device(torch.device("cpu"), None, offload=True) == torch.device("xpu")
    assert _init.unit_device([stack], [], None) == torch.device("cpu")  # its blocks' device first
    assert _init.unit_device([on_meta], [], None) == torch.device("xpu")  # materialised later: the default
