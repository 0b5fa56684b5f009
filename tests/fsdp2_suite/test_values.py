"""FSDP2 semantics whose values a drop-in must reproduce exactly, compared with torch's FSDP2.

No single upstream file: the all-reduce hook's tensor (``_fsdp_collectives.foreach_reduce`` hands
the hook the reduce-scatter output: each parameter's padded dim-0 chunk back to back, averaged)
and meta-device initialisation (FSDP2 initialises its
DTensor parameters with DTensor's random ops, so ``reset_parameters()`` after ``to_empty()`` draws
per shard from the seed: the values are not the unsharded model's). W = 2 on gloo, both
implementations; the runner compares the values and the logged types.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.testing._internal.common_fsdp import MLP

from tests.fsdp2_suite.common import rank_seed
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)


class Uneven(nn.Module):
    """Dim-0 sizes W does not divide (7, 5, 3: FSDP2 pads their chunks) and a layer that the
    forward skips when told (no gradient on any rank)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.skipped = nn.Linear(6, 7), nn.Linear(7, 5), nn.Linear(5, 3)

    def forward(self, x, skip: bool = True):
        h = self.b(torch.relu(self.a(x)))
        return h if skip else self.skipped(h)


def _hook_training(impl, rank: int, *, force_sum: bool = False, unused: bool = False, steps: int = 3) -> dict:
    """``Uneven`` sharded as one unit with a hook that records what it gets and clamps it in
    place (so the accumulated gradient is what the hook left); Adam steps. Returns the recorded
    tensors, the losses and the full parameters."""
    torch.manual_seed(0)
    model = impl.fully_shard(Uneven())
    if force_sum:
        model.set_force_sum_reduction_for_comms(True)
    if unused:
        model.set_reduce_scatter_unused_params(True)
    seen = []

    def hook(output: torch.Tensor) -> None:
        seen.append(output.detach().clone())
        output.clamp_(-0.05, 0.05)

    model.set_all_reduce_hook(hook)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    rank_seed(rank)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 6)).pow(2).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    impl.record_types("hook outputs", seen)
    return {"seen": seen, "losses": losses, "params": impl.full_params(model)}


@cases.case()
def all_reduce_hook_tensor(rank, world_size, impl):
    """The hook gets FSDP2's reduce output: the padded chunks of the parameters that got a
    gradient (not the skipped layer's), back to back, the average over the ranks; its in-place
    clamp is what trains."""
    out = _hook_training(impl, rank)
    chunks = [4 * 6, 4, 3 * 7, 3]  # a (7 rows -> 4 per rank), b (5 -> 3): weight and bias
    assert [t.numel() for t in out["seen"]] == [sum(chunks)] * 3, [t.numel() for t in out["seen"]]
    return out


@cases.case()
def all_reduce_hook_tensor_force_sum(rank, world_size, impl):
    """Under ``set_force_sum_reduction_for_comms(True)`` the hook gets the sum over the ranks (the
    division follows it)."""
    return _hook_training(impl, rank, force_sum=True)


@cases.case()
def all_reduce_hook_tensor_unused_params(rank, world_size, impl):
    """With ``set_reduce_scatter_unused_params(True)`` the skipped layer's chunks (zeros) are in
    the hook's tensor too."""
    out = _hook_training(impl, rank, unused=True)
    assert [t.numel() for t in out["seen"]] == [24 + 4 + 21 + 3 + 2 * 5 + 2] * 3, [t.numel() for t in out["seen"]]
    return out


@cases.case()
def meta_init_values_and_types(rank, world_size, impl):
    """A model built on the meta device (uneven dims), fully_shard'ed, ``to_empty``, then
    initialised from a seed by ``reset_parameters()`` and ``trunc_normal_`` (rejection sampling):
    the parameters are DTensors (types compared) holding FSDP2's values (DTensor's random ops,
    each rank drawing its chunk), and a training step from there gives FSDP2's loss."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(6, 7), nn.LayerNorm(7), MLP(7), nn.Linear(7, 5))
    impl.fully_shard(model[2])
    impl.fully_shard(model)
    model.to_empty(device="cpu")
    torch.manual_seed(1)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    nn.init.trunc_normal_(model[3].weight, std=0.5, a=-0.4, b=0.4)
    assert {type(p).__name__ for p in model.parameters()} == {"DTensor"}, {type(p) for p in model.parameters()}
    impl.record_types("after init", [p.data for p in model.parameters()])
    impl.record_types("after init (parameters)", list(model.parameters()))
    values = impl.full_params(model)
    rank_seed(rank)
    loss = model(torch.randn(3, 6)).sum()
    loss.backward()
    return {"values": values, "loss": loss.detach()}


def _eval_counting(impl, model, inp, tag: str) -> dict:
    """A no-grad forward of ``model``: its output, the all-gathers it issued, the parameters' types
    after it (logged)."""
    with torch.no_grad(), impl.count_collectives() as counted:
        out = model(inp)
    impl.record_types(tag, list(model.parameters()))
    return {"out": out, "all_gathers": counted.all_gather}


@cases.case(per_unit_collectives=True)
def eval_without_reshard_after_forward(rank, world_size, impl):
    """``set_reshard_after_forward(False)``, then no-grad evaluation forwards: the first gathers
    every unit, the second none (the units stayed unsharded, the parameters FSDP2's plain unsharded
    tensors); ``requires_grad_(False)`` on a block's (unsharded) parameters afterwards freezes it
    for the next training step (no gradient, its values kept), ``load_state_dict`` then writes the
    shards and the next evaluation sees the loaded values."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    for block in (model[0], model[2]):
        impl.fully_shard(block)
    impl.fully_shard(model)
    model.set_reshard_after_forward(False)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    rank_seed(rank)
    inp = torch.randn(4, 8)
    model(inp).pow(2).sum().backward()
    optim.step()
    optim.zero_grad()
    evals = [_eval_counting(impl, model, inp, f"after eval {i}") for i in range(2)]
    assert [e["all_gathers"] for e in evals] == [3, 0], [e["all_gathers"] for e in evals]
    model[2].requires_grad_(False)
    frozen = impl.full_params(model[2])
    loss = model(inp).pow(2).sum()
    loss.backward()
    assert all(p.grad is None for p in model[2].parameters()), "the block frozen after the eval got gradients"
    optim.step()
    optim.zero_grad()
    after = impl.full_params(model[2])
    for name, value in frozen.items():
        torch.testing.assert_close(after[name], value, rtol=0, atol=0, msg=lambda m, n=name: f"frozen {n}: {m}")
    impl.record_types("after training", list(model.parameters()))
    evals.append(_eval_counting(impl, model, inp, "after training, eval"))
    state = {k: torch.full_like(v, 0.25) for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    evals.append(_eval_counting(impl, model, inp, "after load_state_dict, eval"))
    return {"evals": evals, "loss": loss.detach(), "params": impl.full_params(model)}


test_case = cases.pytest_tests()
