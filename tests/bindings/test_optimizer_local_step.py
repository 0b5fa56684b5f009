"""Stock element-wise optimizers step the local tensors of flashfsdp's DTensor parameters
(``bindings/optimizer_local_step.py``): the same bits and the same state types as FSDP2's DTensor step.

Each case trains the same model with torch's FSDP2 and with flashfsdp on W = 2 gloo ranks, same
seeds and inputs, and requires bit-equal parameters, an equal ``optimizer.state_dict()`` (keys,
value types, placements, local values), and — read by a per-optimizer step-pre-hook, which runs
after the global ones — that flashfsdp's step saw plain tensors where it may and DTensors where it
must not hand them over, while FSDP2's saw DTensors.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

from tests.harness import run_distributed

W = 2
OPTIMIZERS = {
    "sgd_momentum": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01)),
    "sgd_foreach": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, foreach=True)),
    "adam": (torch.optim.Adam, dict(lr=1e-2)),
    "adam_amsgrad": (torch.optim.Adam, dict(lr=1e-2, amsgrad=True, weight_decay=0.1)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1)),
    "adamw_foreach": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, foreach=True)),
    "adamw_fused": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, fused=True)),
    "adamax": (torch.optim.Adamax, dict(lr=1e-2)),
    "adagrad": (torch.optim.Adagrad, dict(lr=1e-2)),
    "adadelta": (torch.optim.Adadelta, dict(lr=0.5)),
    "rmsprop": (torch.optim.RMSprop, dict(lr=1e-2, momentum=0.5, centered=True)),
    "nadam": (torch.optim.NAdam, dict(lr=1e-2, decoupled_weight_decay=True, weight_decay=0.1)),
    "radam": (torch.optim.RAdam, dict(lr=1e-2)),
    "asgd": (torch.optim.ASGD, dict(lr=1e-2)),
}


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        # 5 rows: uneven chunks over W = 2 (3 and 2 rows)
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 5), nn.Linear(5, 8)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class _SubclassedAdam(torch.optim.Adam):
    """A user's subclass: it may override ``step``, so it steps the DTensors."""


def _sharded(impl: str) -> nn.Module:
    api = torch.distributed.fsdp if impl == "torch" else __import__("flashfsdp")
    torch.manual_seed(0)
    model = _Model()
    for layer in model.layers:
        api.fully_shard(layer)
    return api.fully_shard(model)


def _seen_types(optimizer) -> list:
    """Record, at every step, the types of each group's parameters as the step sees them."""
    seen = []
    optimizer.register_step_pre_hook(
        lambda opt, args, kwargs: seen.append([sorted({type(p).__name__ for p in g["params"]})
                                               for g in opt.param_groups]))
    return seen


def _train(impl: str, make_optimizer, extra_group: bool = False, steps: int = 3, between=None,
           before_step=None) -> dict:
    model = _sharded(impl)
    params = list(model.parameters())
    groups = [{"params": params}]
    if extra_group:  # a DTensor that no unit owns: its group must step DTensors
        mesh = next(iter(params)).device_mesh
        torch.manual_seed(1)
        extra = nn.Parameter(distribute_tensor(torch.randn(4), mesh, [Replicate()]))
        groups.append({"params": [extra]})
    optimizer = make_optimizer(groups)
    seen = _seen_types(optimizer)
    torch.manual_seed(2 + dist.get_rank())
    for _ in range(steps):
        x = torch.randn(4, 8)
        loss = model(x).pow(2).sum()
        if extra_group:
            loss = loss + (extra.to_local() * x[0, :4]).sum()
        loss.backward()
        if before_step is not None:
            before_step(params)
        optimizer.step()
        optimizer.zero_grad()
        if between is not None:
            between(optimizer)
    state = optimizer.state_dict()
    return {
        "params": [p.to_local().clone() for p in optimizer.param_groups[0]["params"]],
        "param_types": sorted({type(p).__name__ for g in optimizer.param_groups for p in g["params"]}),
        "state": {i: {k: _describe(v) for k, v in s.items()} for i, s in state["state"].items()},
        "seen": seen,
        "grads_cleared": all(p._local_tensor.grad is None for p in params),  # (to_local() is not the leaf)
    }


def _describe(v):
    if isinstance(v, DTensor):
        return ("DTensor", tuple(v.placements), tuple(v.shape), v.to_local().clone())
    if isinstance(v, torch.Tensor):
        return ("Tensor", tuple(v.shape), v.clone())
    return ("value", v)


def _all_optimizers(rank: int, world_size: int) -> dict:
    out = {}
    for name, (cls, kwargs) in OPTIMIZERS.items():
        out[name] = {impl: _train(impl, lambda groups: cls(groups, **kwargs)) for impl in ("torch", "flashfsdp")}
    return out


@pytest.fixture(scope="module")
def optimizers():
    return run_distributed(_all_optimizers, W, timeout=400)


def _assert_equal_runs(got: dict, want: dict, what: str) -> None:
    assert got["param_types"] == want["param_types"] == ["DTensor"], what
    assert len(got["params"]) == len(want["params"])
    for i, (a, b) in enumerate(zip(got["params"], want["params"])):
        assert torch.equal(a, b), f"{what}: parameter {i} differs from FSDP2's (max {float((a - b).abs().max())})"
    assert got["state"].keys() == want["state"].keys(), what
    for index, entries in want["state"].items():
        assert got["state"][index].keys() == entries.keys(), f"{what}: state {index}"
        for key, w in entries.items():
            g = got["state"][index][key]
            assert g[:-1] == w[:-1] if isinstance(w[-1], torch.Tensor) else g == w, f"{what}: state {index}.{key}"
            if isinstance(w[-1], torch.Tensor):
                assert torch.equal(g[-1], w[-1]), f"{what}: state {index}.{key} values differ from FSDP2's"
    assert got["grads_cleared"], f"{what}: a local tensor kept the .grad it was given for the step"


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_same_bits_and_state_types_as_fsdp2(optimizers, name):
    for rank, result in enumerate(optimizers):
        got, want = result[name]["flashfsdp"], result[name]["torch"]
        _assert_equal_runs(got, want, f"{name}, rank {rank}")
        assert want["seen"] == [[["DTensor"]]] * 3, "FSDP2's step sees DTensors"
        assert got["seen"] == [[["Tensor"]]] * 3, f"{name}: flashfsdp's step did not get the local tensors"


def _edge_cases(rank: int, world_size: int) -> dict:
    adam = lambda groups: torch.optim.Adam(groups, lr=1e-2)  # noqa: E731
    out = {"mixed": {impl: _train(impl, adam, extra_group=True) for impl in ("torch", "flashfsdp")},
           # between steps: the state reloaded (new state dicts), a state value replaced, a group added
           "changed": {impl: _train(impl, adam, extra_group=True, steps=4, between=_change_between_steps)
                       for impl in ("torch", "flashfsdp")},
           "subclass": _train("flashfsdp", lambda groups: _SubclassedAdam(groups, lr=1e-2), steps=1),
           # before steps 2 and 3: a gradient set to None, then gradients replaced by new DTensors
           "grads": {impl: _train(impl, adam, steps=4, before_step=_change_grads()) for impl in ("torch", "flashfsdp")}}
    # A step that raises (here in the closure, after the parameters were handed over) leaves the
    # local tensors in param_groups; the next step puts the parameters back first.
    model = _sharded("flashfsdp")
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()

    def closure():
        raise RuntimeError("closure failed")

    with pytest.raises(RuntimeError, match="closure failed"):
        optimizer.step(closure)
    during = sorted({type(p).__name__ for p in optimizer.param_groups[0]["params"]})
    optimizer.step()
    after = sorted({type(p).__name__ for p in optimizer.param_groups[0]["params"]})
    out["raised"] = (during, after, sorted({type(k).__name__ for k in optimizer.state}),
                     all(isinstance(v, DTensor) for s in optimizer.state.values() for k, v in s.items() if k != "step"))
    return out


def _change_between_steps(optimizer) -> None:
    """After step 1 reload the optimizer's state, after step 2 replace the first parameter's
    ``exp_avg`` by a new tensor (halved), after step 3 add a group: each time what the hand-over
    kept from the last step no longer holds."""
    steps = int(next(iter(optimizer.state.values()))["step"])
    if steps == 1:
        optimizer.load_state_dict(optimizer.state_dict())
    elif steps == 2:
        first = optimizer.param_groups[0]["params"][0]
        optimizer.state[first]["exp_avg"] = optimizer.state[first]["exp_avg"] * 0.5
    elif steps == 3:
        extra = optimizer.param_groups[-1]["params"].pop()
        optimizer.add_param_group({"params": [extra], "lr": 1e-3})


def _change_grads():
    """A ``before_step`` that, before the second step, sets the first parameter's ``.grad`` to None
    (the step skips it) and, before the third, replaces two gradients by new DTensors of the same
    placements (not the unit's own gradient objects)."""
    calls = []

    def change(params):
        calls.append(None)
        if len(calls) == 2:
            params[0].grad = None
        elif len(calls) == 3:
            params[1].grad = params[1].grad * 0.5
            params[2].grad = params[2].grad.clone()
    return change


@pytest.fixture(scope="module")
def edge_cases():
    return run_distributed(_edge_cases, W, timeout=300)


def test_a_group_with_a_dtensor_no_unit_owns_steps_dtensors(edge_cases):
    for rank, result in enumerate(edge_cases):
        got, want = result["mixed"]["flashfsdp"], result["mixed"]["torch"]
        _assert_equal_runs(got, want, f"mixed groups, rank {rank}")
        assert got["seen"] == [[["Tensor"], ["DTensor"]]] * 3, got["seen"]


def test_what_changes_between_steps_is_seen(edge_cases):
    for rank, result in enumerate(edge_cases):
        got, want = result["changed"]["flashfsdp"], result["changed"]["torch"]
        _assert_equal_runs(got, want, f"state reloaded, replaced and a group added between steps, rank {rank}")
        assert got["seen"][:3] == [[["Tensor"], ["DTensor"]]] * 3 and got["seen"][3] == [["Tensor"], [], ["DTensor"]]


def test_gradients_set_to_none_or_replaced_are_stepped_as_on_fsdp2(edge_cases):
    for rank, result in enumerate(edge_cases):
        got, want = result["grads"]["flashfsdp"], result["grads"]["torch"]
        _assert_equal_runs(got, want, f"gradients set to None and replaced, rank {rank}")
        assert got["seen"] == [[["Tensor"]]] * 4, got["seen"]


def test_a_subclass_steps_dtensors(edge_cases):
    for result in edge_cases:
        assert result["subclass"]["seen"] == [[["DTensor"]]]


def test_a_step_that_raised_is_put_back_at_the_next_step(edge_cases):
    for result in edge_cases:
        during, after, state_keys, states_are_dtensors = result["raised"]
        assert during == ["Tensor"], "the closure raised after the hand-over: torch ran no post-hook"
        assert after == ["DTensor"] and state_keys == ["DTensor"] and states_are_dtensors
