"""Buckets (``FSDPModule.set_bucket_bytes``, ``runtime/bucket.py``): small units that run back to back
share their all-gathers and reduce-scatters, with FSDP2's values and types, and every per-unit API
still acting per unit.

The model is the shape FSDP2's users report as CPU-bound (pytorch/pytorch#173680): layers of a
``Linear``, a 4-float gate and a ``LayerNorm``, every module ``fully_shard``ed, then each layer and
the root. Collectives are counted from the flight recorder (``flashfsdp.runtime.flight``), which
records every collective flashfsdp issues.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import flashfsdp
from flashfsdp.runtime import flight
from flashfsdp.runtime.flat_param import FlatParam
from flashfsdp.runtime.states import ShardState
from tests.harness import run_distributed

LAYERS = 4
D = 16


class _Gate(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4) * 0.1)

    def forward(self, x):
        return torch.sigmoid(self.weight.sum()) * x


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear, self.gate, self.norm = nn.Linear(D, D), _Gate(), nn.LayerNorm(D)

    def forward(self, x):
        return self.norm(x + self.gate(torch.relu(self.linear(x))))


class _Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleDict({f"l{i}": _Layer() for i in range(LAYERS)})
        self.head = nn.Linear(D, 1)

    def forward(self, x):
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x).square().mean()


def _sharded(api, bucket_bytes=None, **kwargs):
    torch.manual_seed(0)
    model = _Gated()
    for layer in model.layers.values():
        for sub in (layer.linear, layer.gate, layer.norm):
            api.fully_shard(sub, **kwargs)
        api.fully_shard(layer, **kwargs)
    api.fully_shard(model, **kwargs)
    if bucket_bytes is not None:
        model.set_bucket_bytes(bucket_bytes)
    return model


def _per_step_collectives() -> list[dict]:
    """The flight recorder's collectives by step (a root's forward starts a step), by kind."""
    steps: dict[int, dict] = {}
    for e in flight.entries():
        if e.kind in ("all_gather", "reduce_scatter", "all_reduce"):
            by_kind = steps.setdefault(e.step, {})
            by_kind[e.kind] = by_kind.get(e.kind, 0) + 1
    return [steps[s] for s in sorted(steps)]


def _train(rank, world_size, impl: str, bucket_bytes=None, steps: int = 3) -> dict:
    api = torch.distributed.fsdp if impl == "torch" else flashfsdp
    model = _sharded(api, bucket_bytes)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    flight.configure(4096)
    g = torch.Generator().manual_seed(rank)
    losses, grads = [], []
    for _ in range(steps):
        loss = model(torch.randn(8, D, generator=g))
        loss.backward()
        grads.append({n: p.grad.to_local().clone() for n, p in model.named_parameters()})
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    counts = _per_step_collectives() if impl == "flashfsdp" else []
    flight.configure()
    return {"losses": torch.stack(losses), "grads": grads,
            "params": {n: (type(p).__name__, tuple(p.placements), p.to_local().detach().clone())
                       for n, p in model.named_parameters()},
            "state": {k: {kk: (type(vv).__name__, vv.to_local().clone() if hasattr(vv, "to_local") else vv)
                          for kk, vv in v.items()} for k, v in opt.state_dict()["state"].items()},
            "collectives": counts}


def _runs(rank, world_size):
    return {"fsdp2": _train(rank, world_size, "torch"), "buckets": _train(rank, world_size, "flashfsdp"),
            "units": _train(rank, world_size, "flashfsdp", bucket_bytes=0),
            "small": _train(rank, world_size, "flashfsdp", bucket_bytes=3000)}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_runs, 2)


def _assert_equal(got: dict, want: dict, what: str) -> None:
    assert torch.equal(got["losses"], want["losses"]), what
    for g, w in zip(got["grads"], want["grads"]):
        for name in w:
            assert torch.equal(g[name], w[name]), (what, name)
    for name, (kind, placements, value) in want["params"].items():
        assert got["params"][name][:2] == (kind, placements), (what, name)
        assert torch.equal(got["params"][name][2], value), (what, name)
    for index, entries in want["state"].items():
        for key, (kind, value) in entries.items():
            assert got["state"][index][key][0] == kind, (what, index, key)
            assert torch.equal(torch.as_tensor(got["state"][index][key][1]), torch.as_tensor(value)), (what, index, key)


def test_buckets_give_fsdp2s_values_and_types_at_two_ranks(runs):
    """Losses, gradients, parameters and AdamW state bit for bit as FSDP2's, with buckets of the
    default size, of a few units, and without."""
    for r in runs:
        for name in ("buckets", "units", "small"):
            _assert_equal(r[name], r["fsdp2"], name)


def test_buckets_cut_the_collectives_per_step(runs):
    """Without buckets: an all-gather per unit with parameters in forward, and in backward but for
    the root (kept from its forward) and the units whose backward reads no parameter (each gate:
    its backward reads the saved sigmoid; the first linear: its input needs no gradient); a
    reduce-scatter per unit. With the default 4 MiB, the whole model is one bucket: from the
    second step (the first has no recorded forward order) two all-gathers (the forward; the
    backward's) and one reduce-scatter."""
    units_with_params = 3 * LAYERS + 1
    backward = units_with_params - 1 - LAYERS - 1
    for r in runs:
        units = r["units"]["collectives"]
        assert units[1:] == [{"all_gather": units_with_params + backward, "reduce_scatter": units_with_params}] * 2
        assert r["buckets"]["collectives"][1:] == [{"all_gather": 2, "reduce_scatter": 1}] * 2
        # the first step gathers its forward unit by unit, its backward in one bucket
        assert r["buckets"]["collectives"][0] == {"all_gather": units_with_params + 1, "reduce_scatter": 1}
        small = r["small"]["collectives"][1]  # buckets of about one layer (2,384 bytes gathered at W = 2)
        assert 2 < small["all_gather"] < 2 * units_with_params - 1 and 1 < small["reduce_scatter"] < units_with_params


def _four_ranks(rank, world_size):
    return {"buckets": _train(rank, world_size, "flashfsdp"), "units": _train(rank, world_size, "flashfsdp", 0)}


def test_at_four_ranks_buckets_stay_within_the_summation_order():
    """At W = 4 a bucket's reduce-scatter may sum the ranks in another order than a unit's own
    (another buffer size): the values agree to fp32 rounding of a 4-term sum."""
    for r in run_distributed(_four_ranks, 4):
        torch.testing.assert_close(r["buckets"]["losses"], r["units"]["losses"], rtol=1e-6, atol=1e-7)
        for name, (_, _, value) in r["units"]["params"].items():
            torch.testing.assert_close(r["buckets"]["params"][name][2], value, rtol=1e-5, atol=1e-6)


def _per_unit_apis(rank, world_size) -> dict:
    out = {}
    model = _sharded(flashfsdp)
    layers = list(model.layers.values())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, D)
    model(x).backward()  # the first step records the order
    opt.step()
    opt.zero_grad()
    # a unit told to keep its parameters after forward keeps them; the others of its bucket reshard
    layers[1].linear.set_reshard_after_forward(False)
    loss = model(x)
    out["kept"] = layers[1].linear._flashfsdp_state.unit.state is ShardState.UNSHARDED
    out["others"] = [s.unit.state.name for s in (layers[0].linear._flashfsdp_state, layers[1].gate._flashfsdp_state)]
    loss.backward()
    out["after_backward"] = all(m._flashfsdp_state.unit.state is ShardState.SHARDED for m in model.modules()
                                if "_flashfsdp_state" in m.__dict__)
    layers[1].linear.set_reshard_after_forward(True)
    opt.zero_grad()
    # unshard()/reshard() of one unit act on it alone
    layers[2].gate.unshard()
    out["unsharded_alone"] = [m._flashfsdp_state.unit.state.name for m in (layers[2].gate, layers[2].linear)]
    layers[2].gate.reshard()
    # gradient accumulation without sync: no reduction until the synced micro-batch
    flight.configure(4096)
    model.set_requires_gradient_sync(False)
    model(x).backward()
    model(x).backward()
    model.set_requires_gradient_sync(True)
    model(x).backward()
    out["reduce_scatters"] = [sum(1 for e in flight.entries() if e.kind == "reduce_scatter" and e.step == s)
                              for s in (1, 2, 3)]
    flight.configure()
    # post-accumulate-grad hooks on the sharded parameters run, once per reduction
    calls = []
    layers[0].gate.weight.register_post_accumulate_grad_hook(lambda p: calls.append(p.grad is not None))
    opt.zero_grad()
    model(x).backward()
    out["hook_calls"] = calls
    return out


def test_per_unit_apis_act_per_unit_with_buckets():
    for r in run_distributed(_per_unit_apis, 2):
        assert r["kept"] and r["others"] == ["SHARDED", "SHARDED"]
        assert r["after_backward"]
        assert r["unsharded_alone"] == ["UNSHARDED", "SHARDED"]
        assert r["reduce_scatters"] == [0, 0, 1]
        assert r["hook_calls"] == [True]


def _memory(rank, world_size, bucket_bytes) -> dict:
    """The most unsharded bytes held at once (sampled after every allocation of an unsharded
    buffer, over two steps), and what is held after each step."""
    model = _sharded(flashfsdp, bucket_bytes)
    states = [m._flashfsdp_state for m in model.modules() if "_flashfsdp_state" in m.__dict__]
    held = [0]
    original = FlatParam.alloc_unsharded

    def alloc_and_sample(self, *args, **kwargs):  # instrumentation: the real allocation first
        original(self, *args, **kwargs)
        held[0] = max(held[0], sum(s.unit.memory_bytes()["unsharded"] for s in states))

    FlatParam.alloc_unsharded = alloc_and_sample
    after = []
    try:
        for _ in range(2):
            model(torch.randn(4, D)).backward()
            after.append(sum(s.unit.memory_bytes()["unsharded"] for s in states))
    finally:
        FlatParam.alloc_unsharded = original
    return {"peak": held[0], "after": after}


def test_memory_grows_by_at_most_the_bucket_bytes():
    """Units gathered together are held together: the most unsharded bytes at once exceed the
    unit-by-unit schedule's by at most the bucket size; after each step nothing stays unsharded."""
    (units,) = run_distributed(_memory, 1, 0)
    for bucket_bytes in (3000, 4 * 2**20):
        (r,) = run_distributed(_memory, 1, bucket_bytes)
        assert r["after"] == units["after"] == [0, 0]
        assert units["peak"] <= r["peak"] <= units["peak"] + bucket_bytes, (bucket_bytes, r, units)
    assert r["peak"] > units["peak"]  # the whole model at once with 4 MiB


def test_set_bucket_bytes_refuses_bad_values_and_non_roots(monkeypatch):
    model = _sharded(flashfsdp)
    with pytest.raises(TypeError, match="bucket_bytes must be an int"):
        model.set_bucket_bytes(1.5)
    with pytest.raises(TypeError, match="bucket_bytes must be an int"):
        model.set_bucket_bytes(True)
    with pytest.raises(ValueError, match="bucket_bytes must be >= 0"):
        model.set_bucket_bytes(-1)
    layer = model.layers["l0"]
    layer.set_bucket_bytes(0)  # not known yet to be a non-root: refused at the first forward
    with pytest.raises(ValueError, match="set_bucket_bytes was called on 'layers.l0'.*not the root"):
        model(torch.randn(2, D))
    model = _sharded(flashfsdp)
    model(torch.randn(2, D)).backward()
    with pytest.raises(ValueError, match="'layers.l0' is not the root"):
        model.layers["l0"].set_bucket_bytes(0)
    monkeypatch.setenv("FLASHFSDP_BUCKET_BYTES", "lots")
    with pytest.raises(ValueError, match="FLASHFSDP_BUCKET_BYTES='lots': must be a whole number of bytes"):
        _sharded(flashfsdp)(torch.randn(2, D))


def test_the_environment_sets_the_default(monkeypatch):
    monkeypatch.setenv("FLASHFSDP_BUCKET_BYTES", "0")
    model = _sharded(flashfsdp)
    model(torch.randn(2, D)).backward()
    assert model._flashfsdp_state.ctx.step.bucket_bytes == 0
    monkeypatch.delenv("FLASHFSDP_BUCKET_BYTES")
    model = _sharded(flashfsdp, bucket_bytes=1234)
    model(torch.randn(2, D)).backward()
    assert model._flashfsdp_state.ctx.step.bucket_bytes == 1234
    assert os.environ.get("FLASHFSDP_BUCKET_BYTES") is None


def test_a_profile_names_each_bucket_by_its_units():
    model = _sharded(flashfsdp)
    model(torch.randn(2, D)).backward()
    with flashfsdp.profile("cpu") as prof:
        model(torch.randn(2, D)).backward()
    # W = 1: the shards are cast straight into place; one bucket per phase (the backward's without
    # the units whose backward reads no parameter: the gates, the first linear)
    gathers = [s.unit for s in prof.spans if s.kind == "copy_in" and s.unit.endswith("units)")]
    assert gathers == ["<root> .. layers.l3.norm (13 units)", "layers.l3.norm .. layers.l0.norm (7 units)"]
    # the root's gradients (the head's) are ready first, the first layer's last
    packs = [s.unit for s in prof.spans if s.kind == "pack"]
    assert packs == ["<root> .. layers.l0.linear (13 units)"]
    assert [s.unit for s in prof.spans if s.kind == "accumulate"] == ["<root> .. layers.l0.linear (13 units)"]
