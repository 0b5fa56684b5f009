"""Port of upstream ``test/distributed/_composable/fsdp/test_fully_shard_frozen.py``.

Training with frozen parameters (``requires_grad_(False)``) before and after ``fully_shard``:
parity with the replicated reference (upstream's ``replicate``/DDP; here :func:`average_grads`),
frozen parameters get no ``.grad`` and the optimizer does not move them, the reduce-scatters carry
the trainable parameters only, and each unit's reduce-scatter is issued during the backward (not
all at the end of it).

Upstream checks the last point by counting calls of FSDP2's private
``RegisterPostBackwardFunction.backward``; here the same behaviour is observed from outside: the
reduce-scatters issued before the gradient reaches an early unit's output (a tensor hook) —
every trainable unit after it has reduced by then (:func:`assert_reduced_during_backward`).

Upstream runs W = min(4, #GPUs) with ``reshard_after_forward`` in {False, True, 2}; here W = 2,
where 2 means True (the int variant runs at W = 4 in ``test_mixed_precision.py``).
"""

from __future__ import annotations

import copy
import itertools

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._composable import checkpoint
from torch.testing._internal.common_fsdp import MLP

from tests.fsdp2_suite.common import average_grads, rank_seed, train_step
from tests.fsdp2_suite.runner import CaseSet
from tests.fsdp2_suite.test_mixed_precision import ReduceScatterCall, record_reduce_scatters

cases = CaseSet(__name__)

UPSTREAM = "test/distributed/_composable/fsdp/test_fully_shard_frozen.py"


# ============================================================================ helpers
def mark_grad_arrival(tensor: torch.Tensor, events: list, label: str) -> None:
    """Append ``label`` to ``events`` when the gradient of ``tensor`` is computed."""
    if tensor.requires_grad:
        tensor.register_hook(lambda grad: events.append(label))


def assert_reduced_during_backward(events: list, num_expected: int, where: str,
                                   marker: str = "unit_output_grad") -> None:
    """At least ``num_expected`` reduce-scatters precede ``marker`` (the gradient reaching an early
    unit's output) in ``events``: the units after it reduced inside the autograd backward, not in
    the end-of-backward callback (upstream: ``backward_count >= num_units - 1``)."""
    assert marker in events, f"{where}: the gradient never reached the marked unit's output"
    before = events[: events.index(marker)]
    got = sum(isinstance(e, ReduceScatterCall) for e in before)
    assert got >= num_expected, (
        f"{where}: {got} reduce-scatters were issued before the gradient reached the marked unit's output, "
        f"expected at least {num_expected} (the later units' post-backward must run during backward)")


def _forward_backward(impl, model, inp, events: list, marked: nn.Module, reference: bool) -> torch.Tensor:
    """Forward ``model(inp).sum()`` and backward. The replicated reference's gradients are then
    averaged over the ranks; for the sharded model, the gradient reaching ``marked``'s output and
    each reduce-scatter are logged in ``events`` (:func:`assert_reduced_during_backward`)."""
    if reference:
        loss = model(inp).sum()
        loss.backward()
        average_grads(model)
        return loss
    marked_out = []
    handle = marked.register_forward_hook(lambda m, a, out: marked_out.append(out))
    loss = model(inp).sum()
    handle.remove()
    mark_grad_arrival(marked_out[0], events, "unit_output_grad")
    with record_reduce_scatters(impl, events):
        loss.backward()
    return loss


def full_value(impl, param: torch.Tensor) -> torch.Tensor:
    """The full value of ``param``, sharded or not (a root unit that no backward reached after its
    forward — a no-grad forward, or a frozen first unit — keeps its unsharded parameters, in FSDP2
    as in flashfsdp); collective when sharded."""
    return impl.full(param).detach().clone() if impl.is_sharded(param) else param.detach().clone()


def trainable_local_numel(impl, params) -> int:
    """Elements of ``params`` held on this rank (their local shards)."""
    return sum(impl.local(p).numel() for p in params)


# ============================================================================ TestFullyShardFrozen
def _train_mixed_requires_grad_per_group(rank, world_size, impl, reshard_after_forward,
                                         use_activation_checkpointing, freeze_after_init):
    torch.manual_seed(42)
    num_mlps, lin_dim = 3, 32
    model = nn.Sequential(*[MLP(lin_dim, torch.device("cpu")) for _ in range(num_mlps)])
    # Train biases only (e.g. like BitFit)
    if not freeze_after_init:
        for name, param in model.named_parameters():
            if "bias" not in name:
                param.requires_grad_(False)
    ref_model = copy.deepcopy(model)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for mlp in model:
        if use_activation_checkpointing:
            checkpoint(mlp)
        impl.fully_shard(mlp, reshard_after_forward=reshard_after_forward)
    impl.fully_shard(model, reshard_after_forward=reshard_after_forward)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    if freeze_after_init:
        for name, param in itertools.chain(model.named_parameters(), ref_model.named_parameters()):
            if "bias" not in name:
                param.requires_grad_(False)
    frozen_before = {n: impl.local(p).clone() for n, p in model.named_parameters() if "bias" not in n}
    # Upstream: each reduce-scatter output has the local numel of one MLP's biases. flashfsdp packs
    # the chunks of its trainable group at 16-byte-aligned offsets in its shard: allow that
    # alignment (at most 3 fp32 elements after each of the 2 biases), nothing more.
    expected_numel = trainable_local_numel(impl, [p for n, p in model[0].named_parameters() if "bias" in n])
    slack = 0 if impl.name == "torch" else 3 * 2

    rank_seed(rank)
    losses, numel_mismatches = [], []
    for iter_idx in range(10):
        inp = torch.randn((8, lin_dim))
        step_losses = []
        for _model, _optim in ((ref_model, ref_optim), (model, optim)):
            _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            events = []
            step_losses.append(_forward_backward(impl, _model, inp, events, model[0], reference=_model is ref_model))
            _optim.step()
        rs = [e for e in events if isinstance(e, ReduceScatterCall)]
        assert len(rs) == num_mlps, f"iteration {iter_idx}: {len(rs)} reduce-scatters, expected one per MLP"
        # Checked last (collected here), so that a mismatch still lets the parity checks run
        numel_mismatches += [
            f"iteration {iter_idx}: a reduce-scatter output has {call.numel} elements, expected "
            f"{expected_numel} (the trainable biases only){' + padding' if slack else ''}"
            for call in rs if not expected_numel <= call.numel <= expected_numel + slack]
        # The post-backward of MLPs 1..2 runs in the backward (that of MLP 0 may run at the end:
        # its input does not require grad)
        assert_reduced_during_backward(events, num_mlps - 1, f"iteration {iter_idx}")
        impl.check_sharded_parity(ref_model, model)
        torch.testing.assert_close(step_losses[1], step_losses[0])
        losses.append(step_losses[1].detach())
    # Frozen parameters: no gradient, not moved by the optimizer
    for name, param in model.named_parameters():
        if "bias" not in name:
            assert not param.requires_grad, f"{name} requires grad again"
            assert param.grad is None, f"frozen {name} has a gradient"
            torch.testing.assert_close(impl.local(param), frozen_before[name], rtol=0, atol=0)
    if numel_mismatches:
        raise AssertionError(f"{len(numel_mismatches)} reduce-scatters carried more than the trainable "
                             f"parameters; the first: {numel_mismatches[0]}")
    return {"losses": torch.stack(losses), "params": impl.full_params(model)}


def _per_group_case(freeze_after_init: bool, use_activation_checkpointing: bool):
    def case(rank, world_size, impl):
        return {str(raf): _train_mixed_requires_grad_per_group(rank, world_size, impl, raf,
                                                                use_activation_checkpointing, freeze_after_init)
                for raf in (False, True)}

    case.__name__ = ("train_mixed_requires_grad_per_group" + ("_freeze_after_init" if freeze_after_init else "")
                     + ("_ac" if use_activation_checkpointing else ""))
    when = "after fully_shard (on the sharded parameters)" if freeze_after_init else "before fully_shard"
    case.__doc__ = (
        f"Upstream: test_fully_shard_frozen.py::TestFullyShardFrozen::test_train_mixed_requires_grad_per_group "
        f"(freeze_after_init={freeze_after_init}, use_activation_checkpointing={use_activation_checkpointing}, "
        f"reshard_after_forward in {{False, True}}): 3 MLP units training their biases only, the weights "
        f"frozen {when}: parity with the reference per step, each reduce-scatter carries the biases only, "
        f"the units after the first reduce during backward, the frozen weights keep .grad None and their "
        f"values.")
    return case


for _freeze_after_init, _ac in itertools.product((False, True), (False, True)):
    cases.case(world_size=2, per_unit_collectives=True)(_per_group_case(_freeze_after_init, _ac))


def _train_mixed_requires_grad_across_groups(rank, world_size, impl, reshard_after_forward, unfreeze_params):
    torch.manual_seed(42)
    num_linears, lin_dim = 6, 32
    modules = []
    for _ in range(num_linears):
        modules += [nn.Linear(lin_dim, lin_dim), nn.ReLU()]
    model = nn.Sequential(*modules)
    ref_model = copy.deepcopy(model)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            impl.fully_shard(module, reshard_after_forward=reshard_after_forward)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    linears = [m for m in model if isinstance(m, nn.Linear)]
    ref_linears = [m for m in ref_model if isinstance(m, nn.Linear)]

    def set_requires_grad(lins, requires_grad):
        # Interleave frozen -> non-frozen -> ... linears (upstream's loop indexes ``seq[i % 2]``,
        # i.e. always freezes the first linear; its docstring's interleaving is what is done here)
        for i, lin in enumerate(lins):
            if i % 2 == 0:
                lin.requires_grad_(requires_grad)

    set_requires_grad(linears, False)  # after fully_shard: on the sharded parameters
    set_requires_grad(ref_linears, False)
    frozen_before = {n: full_value(impl, p) for n, p in model.named_parameters() if not p.requires_grad}
    num_iters, no_grad_iter_idx = 3, 1
    torch.manual_seed(42 + rank)
    inp = torch.randn((8, lin_dim))
    out = {"losses": []}
    for iter_idx in range(num_iters):
        last = iter_idx == num_iters - 1
        if unfreeze_params and last:  # unfreeze on the last step (some kinds of fine-tuning)
            set_requires_grad(linears, True)
            set_requires_grad(ref_linears, True)
        step_losses = []
        events = []
        for _model, _optim in ((ref_model, ref_optim), (model, optim)):
            if iter_idx == no_grad_iter_idx:
                with torch.no_grad():
                    step_losses.append(_model(inp).sum())
                continue
            # marks the output of linears[1] (that of the frozen linears[0] needs no grad)
            step_losses.append(_forward_backward(impl, _model, inp, events, linears[1], reference=_model is ref_model))
            _optim.step()
            _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
        torch.testing.assert_close(step_losses[1], step_losses[0])
        out["losses"].append(step_losses[1].detach())
        if iter_idx != no_grad_iter_idx:
            trainable_after = sum(1 for lin in linears[2:] if lin.weight.requires_grad)
            assert_reduced_during_backward(events, trainable_after, f"iteration {iter_idx}")
        if not (unfreeze_params and last):
            for name, param in model.named_parameters():
                if name in frozen_before:
                    assert param.grad is None, f"frozen {name} has a gradient"
                    torch.testing.assert_close(full_value(impl, param), frozen_before[name], rtol=0, atol=0)
    # After the last step: parameters equal to the reference's (no gradients left after zero_grad)
    out["params"] = {}
    for (name, ref_p), p in zip(ref_model.named_parameters(), model.parameters()):
        out["params"][name] = full_value(impl, p)
        torch.testing.assert_close(out["params"][name], ref_p.detach(), rtol=1e-5, atol=1e-5,
                                   msg=lambda m, name=name: f"{name}: {m}")
    out["losses"] = torch.stack(out["losses"])
    return out


@cases.case(world_size=2, per_unit_collectives=True)
def train_mixed_requires_grad_across_groups(rank, world_size, impl):
    """Upstream: test_fully_shard_frozen.py::TestFullyShardFrozen::test_train_mixed_requires_grad_across_groups
    (unfreeze_params=False, reshard_after_forward in {False, True}): 6 Linear units (each its own
    root), every other one frozen after fully_shard, 3 steps with a no-grad forward in the middle:
    loss parity, parameter parity, the frozen units keep .grad None and their values, the trainable
    units after the first reduce during backward."""
    return {str(raf): _train_mixed_requires_grad_across_groups(rank, world_size, impl, raf, False)
            for raf in (False, True)}


@cases.case(world_size=2, per_unit_collectives=True)
def train_mixed_requires_grad_across_groups_unfreeze(rank, world_size, impl):
    """Upstream: test_fully_shard_frozen.py::TestFullyShardFrozen::test_train_mixed_requires_grad_across_groups
    (unfreeze_params=True, reshard_after_forward in {False, True}): the same, with the frozen units
    unfrozen (``requires_grad_(True)`` on the sharded parameters) before the last step: they train
    from then on (parity with the reference, which is unfrozen too)."""
    return {str(raf): _train_mixed_requires_grad_across_groups(rank, world_size, impl, raf, True)
            for raf in (False, True)}


class MultiForwardModule(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer_0, self.layer_no_grad, self.layer_with_grad = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5)
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x):
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(F.relu(self.layer_with_grad(x)))
            # The same unit runs again, with gradients disabled
            with torch.no_grad():
                x += F.relu(self.layer_with_grad(x))
        return x


@cases.case(world_size=2)
def multi_forward_mixed_requires_grad(rank, world_size, impl):
    """Upstream: test_fully_shard_frozen.py::TestFullyShardFrozen::test_multi_forward_mixed_requires_grad
    (reshard_after_forward in {True, False}): a frozen and a trainable unit each run several times
    in one forward (also under no_grad, with an in-place add on the frozen unit's output): loss
    parity over 10 steps, the frozen unit keeps .grad None."""
    out = {}
    for reshard_after_forward in (True, False):
        torch.manual_seed(42)
        model = MultiForwardModule()
        ref_model = copy.deepcopy(model)
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        for module in model.modules():
            if isinstance(module, nn.Linear):
                impl.fully_shard(module, reshard_after_forward=reshard_after_forward)
        impl.fully_shard(model, reshard_after_forward=reshard_after_forward)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        rank_seed(rank)
        losses = []
        for iter_idx in range(10):
            inp = torch.randn((8, 5))
            step_losses = [train_step(_model, _optim, inp, average=_model is ref_model, set_to_none=iter_idx % 2 == 0)
                           for _model, _optim in ((ref_model, ref_optim), (model, optim))]
            torch.testing.assert_close(step_losses[1], step_losses[0])
            losses.append(step_losses[1])
        impl.check_sharded_parity(ref_model, model)
        assert all(p.grad is None for p in model.layer_no_grad.parameters())
        out[str(reshard_after_forward)] = {"losses": torch.stack(losses), "params": impl.full_params(model)}
    return out


test_case = cases.pytest_tests()
