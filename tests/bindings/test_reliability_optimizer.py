"""An optimizer built before fully_shard holds parameters the model no longer uses: its step raises.
flashfsdp's step hooks are one pre- and one post-hook for the process, acting only for optimizers
that hold its parameters."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from flashfsdp import fully_shard
from flashfsdp.bindings import optimizer_check, optimizer_hooks, optimizer_local_step


def _step(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    optim.zero_grad()


def _sharded_model() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0])
    return fully_shard(model)


def test_optimizer_built_before_fully_shard_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    fully_shard(model[0])
    fully_shard(model)
    with pytest.raises(RuntimeError, match=r"SGD.step: the optimizer holds 4 parameter\(s\) that fully_shard replaced "
                                           r"by sharded pieces, e.g. param_groups\[0\]\['params'\]\[0\] of shape \(4, 4\), "
                                           r"taken over by the unit of Linear; .*Build the optimizer after fully_shard"):
        _step(model, optim)


def test_parameters_listed_before_fully_shard_of_a_submodule_only():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    params = list(model.parameters())
    fully_shard(model[1])  # only the second layer's parameters are replaced
    optim = torch.optim.Adam(params)
    model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=r"Adam.step: the optimizer holds 2 parameter\(s\) .*param_groups\[0\]\['params'\]\[2\] "
                                           r"of shape \(2, 4\)"):
        optim.step()


def test_optimizer_built_after_fully_shard_scans_once_per_change_of_its_groups(monkeypatch):
    model = _sharded_model()
    optim = torch.optim.SGD(model[0].parameters(), lr=0.1)
    scans = []
    real = optimizer_check.check_optimizer
    monkeypatch.setattr(optimizer_check, "check_optimizer", lambda o: scans.append(o) or real(o))
    for _ in range(3):
        _step(model, optim)
    assert scans == [optim]
    optim.add_param_group({"params": list(model[1].parameters())})
    _step(model, optim)
    _step(model, optim)
    assert scans == [optim, optim]


def test_a_stale_parameter_added_later_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    stale = model[1].weight
    fully_shard(model[0])
    fully_shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, optim)
    optim.param_groups[0]["params"].append(stale)  # same list, one more entry: scanned again
    with pytest.raises(RuntimeError, match=r"holds 1 parameter\(s\) .*\['params'\]\[4\] of shape \(2, 4\)"):
        _step(model, optim)


def test_one_step_hook_each_way_acting_only_for_optimizers_of_flashfsdp_parameters(monkeypatch):
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks  # noqa: PLC0415

    model = _sharded_model()
    ours = [h for h in _global_optimizer_pre_hooks.values() if h.__module__.startswith("flashfsdp")]
    theirs = [h for h in _global_optimizer_post_hooks.values() if h.__module__.startswith("flashfsdp")]
    assert len(ours) == 1 and len(theirs) == 1
    calls = []
    for module, name in [(optimizer_hooks, "close_init_windows"), (optimizer_hooks, "shards_written"),
                         (optimizer_local_step, "pre_step"), (optimizer_local_step, "post_step")]:
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _n=name, _r=real: calls.append(_n) or _r(*a))
    other = nn.Linear(4, 2)  # a second model, not sharded: its optimizer runs nothing of flashfsdp's
    foreign = torch.optim.SGD(other.parameters(), lr=0.1)
    other(torch.randn(2, 4)).sum().backward()
    foreign.step()
    assert calls == []
    _step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert calls == ["close_init_windows", "pre_step", "shards_written", "post_step"]
