"""Port of upstream ``test/distributed/_composable/fsdp/test_fully_shard_autograd.py``.

Gradients propagate whatever the forward returns or does not use: unused forward outputs and
modules (their parameters get no gradient: ``.grad`` stays None), activations wrapped in lists,
tuples, named tuples and dicts; post-accumulate-grad hooks on the sharded parameters.

Also, beyond upstream (asked for by the suite's lead, named after the nearest upstream test with
a suffix and marked "Extension" in their docstrings): activations in dataclasses and in a
container type registered with ``torch.utils._pytree``, in-place ops on unit outputs (``h =
block(x); h += x``) and on unit inputs, and a backward through part of a unit's outputs.

Upstream's reference is an unsharded copy fed the global batch (each rank's local batch is its
slice), whose gradients are divided by W (``_reduce_1d_partial_grads``); the losses are compared
after an all-reduce of the sharded model's local loss. Upstream runs W = min(4, #GPUs); here W = 2
(``reshard_after_forward=2`` is then True; the int variant is covered at W = 4 in
``test_mixed_precision.py``).
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import functools
import itertools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel.scatter_gather import _is_namedtuple
from torch.testing._internal.common_fsdp import MLP, DoubleLinear
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer
from torch.utils import _pytree as pytree

from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)

UPSTREAM = "test/distributed/_composable/fsdp/test_fully_shard_autograd.py"
NUM_ITERS = 10


def reduce_1d_partial_grads(module: nn.Module, world_size: int) -> None:
    """Upstream's ``_reduce_1d_partial_grads``: the reference saw the global batch (sum over the
    ranks' samples); dividing by W gives the average the sharded model's reduction produces."""
    for param in module.parameters():
        if param.grad is not None:
            param.grad.div_(world_size)


def global_and_local_batch(rank: int, world_size: int, dim: int, local_batch_size: int = 2):
    global_inp = torch.rand((world_size * local_batch_size, dim))
    return global_inp, global_inp[rank * local_batch_size : (rank + 1) * local_batch_size].detach()


def train_parity(rank, world_size, impl, model, ref_model, make_loss=lambda out: out.sum(), num_iters=NUM_ITERS,
                 dim=24):
    """Upstream's loop: forward/backward the reference on the global batch and the sharded model on
    the local batch, compare the losses and the sharded parameters/gradients, step both, zero the
    gradients (to None every other step). Returns the losses and the final full parameters."""
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1)  # same on all ranks
    losses = []
    for iter_idx in range(num_iters):
        global_inp, local_inp = global_and_local_batch(rank, world_size, dim)
        step_losses = []
        for _model, inp in ((ref_model, global_inp), (model, local_inp)):
            step_losses.append(make_loss(_model(inp)))
            step_losses[-1].backward()
        reduce_1d_partial_grads(ref_model, world_size)
        dist.all_reduce(step_losses[1])  # partial -> replicated
        torch.testing.assert_close(step_losses[1], step_losses[0])
        impl.check_sharded_parity(ref_model, model)
        losses.append(step_losses[1].detach())
        for _optim in (optim, ref_optim):
            _optim.step()
            _optim.zero_grad(set_to_none=bool(iter_idx % 2))
    return {"losses": torch.stack(losses), "params": impl.full_params(model)}


# ============================================================================ TestFullyShardAutograd
def _unused_forward_output(rank, world_size, impl, reshard_after_forward):
    torch.manual_seed(42)
    local_batch_size, dim = 2, 24
    model = DoubleLinear(dim=dim, use_second_linear=True)
    ref_model = copy.deepcopy(model)
    impl.fully_shard(model.lin1, reshard_after_forward=reshard_after_forward)
    impl.fully_shard(model, reshard_after_forward=reshard_after_forward)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(1)  # same on all ranks
    losses = []
    for iter_idx in range(NUM_ITERS):
        # Both forward outputs in the loss for the first 3 iterations, only the first one after
        global_inp, local_inp = global_and_local_batch(rank, world_size, dim, local_batch_size)
        out1, out2 = model(local_inp)
        loss = (out1 * out2).sum() if iter_idx < 3 else out1.sum()
        loss.backward()
        optim.step()
        ref_out1, ref_out2 = ref_model(global_inp)
        ref_loss = (ref_out1 * ref_out2).sum() if iter_idx < 3 else ref_out1.sum()
        ref_loss.backward()
        reduce_1d_partial_grads(ref_model, world_size)
        ref_optim.step()
        dist.all_reduce(loss)  # partial -> replicated
        torch.testing.assert_close(loss, ref_loss)
        losses.append(loss.detach())
        optim.zero_grad(set_to_none=bool(iter_idx % 2))
        ref_optim.zero_grad(set_to_none=bool(iter_idx % 2))
        impl.check_sharded_parity(ref_model, model)
    return {"losses": torch.stack(losses), "params": impl.full_params(model)}


@cases.case(world_size=2)
def unused_forward_output(rank, world_size, impl):
    """Upstream: test_fully_shard_autograd.py::TestFullyShardAutograd::test_unused_forward_output
    (reshard_after_forward in {True, False}): a root returning two outputs (one from a nested
    unit), the loss using both for 3 steps and only the nested unit's afterwards: parity of
    losses, parameters and gradients (None for the unused linear once zeroed to None)."""
    return {str(raf): _unused_forward_output(rank, world_size, impl, raf) for raf in (True, False)}


@cases.case(world_size=2)
def unused_forward_output_part_of_outputs(rank, world_size, impl):
    """Extension of test_fully_shard_autograd.py::TestFullyShardAutograd::test_unused_forward_output:
    one unit returning a dict of two outputs computed by two of its linears, the loss using only
    one from the first step on (gradients zeroed to None each step): the other linear's parameters
    never get a gradient (``.grad`` None, on every rank) and Adam leaves them as they were; parity
    with the reference for the rest."""

    class TwoHeads(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.trunk = nn.Linear(dim, dim)
            self.head_used = nn.Linear(dim, dim)
            self.head_unused = nn.Linear(dim, dim)

        def forward(self, x):
            h = torch.relu(self.trunk(x))
            return {"used": self.head_used(h), "unused": self.head_unused(h)}

    out = {}
    for reshard_after_forward in (True, False):
        torch.manual_seed(42)
        dim = 24
        model = nn.Sequential(TwoHeads(dim))
        ref_model = copy.deepcopy(model)
        impl.fully_shard(model[0], reshard_after_forward=reshard_after_forward)
        impl.fully_shard(model, reshard_after_forward=reshard_after_forward)
        unused_before = {n: impl.full(p) for n, p in model.named_parameters() if "head_unused" in n}
        ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        torch.manual_seed(1)
        losses = []
        for _ in range(5):
            global_inp, local_inp = global_and_local_batch(rank, world_size, dim)
            loss = model(local_inp)["used"].sum()
            loss.backward()
            ref_loss = ref_model(global_inp)["used"].sum()
            ref_loss.backward()
            reduce_1d_partial_grads(ref_model, world_size)
            dist.all_reduce(loss)
            torch.testing.assert_close(loss, ref_loss)
            for name, p in model.named_parameters():
                if "head_unused" in name:
                    assert p.grad is None, f"{name} got a gradient though no output that uses it was backpropagated"
            impl.check_sharded_parity(ref_model, model)
            losses.append(loss.detach())
            for _optim in (optim, ref_optim):
                _optim.step()
                _optim.zero_grad(set_to_none=True)
        for name, value in unused_before.items():
            torch.testing.assert_close(impl.full(dict(model.named_parameters())[name]), value, rtol=0, atol=0)
        out[str(reshard_after_forward)] = {"losses": torch.stack(losses), "params": impl.full_params(model)}
    return out


def _unused_forward_module(rank, world_size, impl, reshard_after_forward):
    torch.manual_seed(42)
    dim = 24
    model = DoubleLinear(dim=dim, use_second_linear=False)
    ref_model = copy.deepcopy(model)
    impl.fully_shard(model.lin1, reshard_after_forward=reshard_after_forward)
    impl.fully_shard(model.lin2, reshard_after_forward=reshard_after_forward)
    impl.fully_shard(model, reshard_after_forward=reshard_after_forward)
    out = train_parity(rank, world_size, impl, model, ref_model, dim=dim)
    assert all(p.grad is None for p in model.lin2.parameters()), "the unused unit got gradients"
    return out


@cases.case(world_size=2)
def unused_forward_module(rank, world_size, impl):
    """Upstream: test_fully_shard_autograd.py::TestFullyShardAutograd::test_unused_forward_module
    (reshard_after_forward in {True, False}): a unit that never runs in forward (``lin2``): the
    others train in parity with the reference and its parameters keep ``.grad`` None."""
    return {str(raf): _unused_forward_module(rank, world_size, impl, raf) for raf in (True, False)}


# ------------------------------------------------------------------ non-tensor activations
@dataclasses.dataclass
class Activations:
    """Extension: a dataclass carrying the activation and a non-tensor field."""

    x: torch.Tensor
    step: int


class Box:
    """Extension: a user container type registered with ``torch.utils._pytree``."""

    def __init__(self, x: torch.Tensor, tag: str):
        self.x = x
        self.tag = tag


pytree.register_pytree_node(Box, lambda b: ([b.x], b.tag), lambda children, tag: Box(children[0], tag))


class ContainerBlock(nn.Module):
    """Upstream's ``Module``: runs two linears on the 0th tensor of its input container and packs
    the result back into the same container type."""

    def __init__(self, dim: int):
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.relu = nn.ReLU()

    def forward(self, inp: Any):
        if isinstance(inp, list):
            return [self._forward(inp[0])]
        if _is_namedtuple(inp):
            return type(inp)(*([self._forward(inp[0])] + list(inp[1:])))
        if isinstance(inp, tuple):
            return (self._forward(inp[0]),)
        if isinstance(inp, dict):
            return {"x": self._forward(inp["x"])}
        if isinstance(inp, Activations):
            return dataclasses.replace(inp, x=self._forward(inp.x), step=inp.step + 1)
        if isinstance(inp, Box):
            return Box(self._forward(inp.x), inp.tag)
        raise NotImplementedError(f"Unsupported input type {type(inp)}: {inp}")

    def _forward(self, x):
        return self.relu(self.lin2(self.relu(self.lin1(x))))


class ToContainerType(nn.Module):
    def __init__(self, container_type):
        super().__init__()
        self.container_type = container_type

    def forward(self, x):
        if self.container_type is list:
            return [x]
        if self.container_type is collections.namedtuple:
            nt = collections.namedtuple("NT", "x y")
            return nt(x, torch.ones_like(x))
        if self.container_type is tuple:
            return (x,)
        if self.container_type is dict:
            return {"x": x}
        if self.container_type is Activations:
            return Activations(x, 0)
        if self.container_type is Box:
            return Box(x, "box")
        raise NotImplementedError(f"Unsupported container type: {self.container_type}")


class FromContainerType(nn.Module):
    def __init__(self, container_type):
        super().__init__()
        self.container_type = container_type

    def forward(self, x):
        if self.container_type in (list, collections.namedtuple, tuple):
            return x[0]
        if self.container_type is dict:
            return x["x"]
        if self.container_type is Activations:
            assert x.step == 3, x.step
            return x.x
        if self.container_type is Box:
            assert x.tag == "box"
            return x.x
        raise NotImplementedError(f"Unsupported container type: {self.container_type}")


def _nontensor_activations(rank, world_size, impl, container_type):
    torch.manual_seed(42)
    dim = 24
    model = nn.Sequential(ToContainerType(container_type), ContainerBlock(dim), ContainerBlock(dim),
                          ContainerBlock(dim), FromContainerType(container_type))
    ref_model = copy.deepcopy(model)
    for module in model:
        impl.fully_shard(module)
    impl.fully_shard(model)
    return train_parity(rank, world_size, impl, model, ref_model, dim=dim)


def _nontensor_case(container_type, label, extension=False):
    def case(rank, world_size, impl):
        return _nontensor_activations(rank, world_size, impl, container_type)

    case.__name__ = f"nontensor_activations_{label}"
    head = ("Extension of test_fully_shard_autograd.py::TestFullyShardAutograd::test_nontensor_activations"
            if extension else
            "Upstream: test_fully_shard_autograd.py::TestFullyShardAutograd::test_nontensor_activations")
    case.__doc__ = (f"{head} (container_type={label}): activations between 3 units carried in a {label}; "
                    f"parity of losses, parameters and gradients over 10 steps (the units' pre-backward "
                    f"hooks must be found inside the container).")
    return case


for _ctype, _label in ((list, "list"), (collections.namedtuple, "namedtuple"), (tuple, "tuple"), (dict, "dict")):
    cases.case(world_size=2)(_nontensor_case(_ctype, _label))
cases.case(world_size=2)(_nontensor_case(Activations, "dataclass", extension=True))
# torch's fully_shard finds output tensors in dict/list/tuple/namedtuple/dataclass only
# (``collect_grad_tensors``): in a pytree-registered container it registers no pre-backward hook,
# the units' parameters are not all-gathered again and the backward runs on freed storage
# ("setStorage: sizes [24, 24] ... out of bounds for storage of size 0").
cases.case(world_size=2, torch_reason=(
    "torch's fully_shard does not look inside pytree-registered containers for the outputs' pre-backward "
    "hooks (collect_grad_tensors: dict/list/tuple/namedtuple/dataclass only), so backward runs on resharded "
    "parameters ('setStorage: ... storage of size 0'); flashfsdp-only behaviour"))(
    _nontensor_case(Box, "pytree_container", extension=True))


# ------------------------------------------------------------------ in-place ops on unit outputs / inputs
class Block(nn.Module):
    """Linear -> ReLU -> Linear: its output is not saved for backward, so in-place ops on it are
    legal in plain PyTorch (the reference)."""

    def __init__(self, dim: int, inplace_on_input: bool = False):
        super().__init__()
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.inplace_on_input = inplace_on_input

    def forward(self, x):
        if self.inplace_on_input:
            x.mul_(0.5)  # in place on the unit's input (the previous unit's output)
        return self.lin2(torch.relu(self.lin1(x)))


class Residual(nn.Module):
    def __init__(self, dim: int, num_blocks: int, inplace_on_input: bool):
        super().__init__()
        self.proj = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList([Block(dim, inplace_on_input) for _ in range(num_blocks)])
        self.inplace_on_input = inplace_on_input

    def forward(self, x):
        x = self.proj(x)
        for block in self.blocks:
            if self.inplace_on_input:
                x = block(x)
            else:
                h = block(x)
                h += x  # in place on the unit's output
                x = h
        return x


def _inplace(rank, world_size, impl, inplace_on_input):
    out = {}
    for reshard_after_forward in (True, False):
        torch.manual_seed(42)
        dim = 24
        model = Residual(dim, 3, inplace_on_input)
        ref_model = copy.deepcopy(model)
        impl.fully_shard(model.proj, reshard_after_forward=reshard_after_forward)
        for block in model.blocks:
            impl.fully_shard(block, reshard_after_forward=reshard_after_forward)
        impl.fully_shard(model, reshard_after_forward=reshard_after_forward)
        out[str(reshard_after_forward)] = train_parity(rank, world_size, impl, model, ref_model, num_iters=5, dim=dim)
    return out


INPLACE_TORCH_REASON = (
    "torch's fully_shard passes each unit's inputs that require grad through its "
    "RegisterPostBackwardFunction, whose outputs are views created in a custom autograd Function: an "
    "in-place op on them raises ('... is a view and is being modified inplace. This view was created "
    "inside a custom Function ...'); flashfsdp-only behaviour (its hooks leave activations untouched)")


@cases.case(world_size=2)
def nontensor_activations_inplace_on_output(rank, world_size, impl):
    """Extension of test_fully_shard_autograd.py::TestFullyShardAutograd::test_nontensor_activations
    (in-place ops on activations): residual blocks written ``h = block(x); h += x`` (an in-place add
    on each unit's output), reshard_after_forward in {True, False}: parity of losses, parameters
    and gradients over 5 steps."""
    return _inplace(rank, world_size, impl, inplace_on_input=False)


@cases.case(world_size=2, torch_reason=INPLACE_TORCH_REASON)
def nontensor_activations_inplace_on_input(rank, world_size, impl):
    """Extension of test_fully_shard_autograd.py::TestFullyShardAutograd::test_nontensor_activations
    (in-place ops on activations): each block unit scales its input in place (``x.mul_(0.5)``, the
    previous unit's output) before using it, reshard_after_forward in {True, False}: parity with
    the unsharded reference over 5 steps."""
    return _inplace(rank, world_size, impl, inplace_on_input=True)


# ============================================================================ TestFullyShardPostAccGradHook*
@cases.case(world_size=2)
def post_acc_grad_hook_runs(rank, world_size, impl):
    """Upstream: test_fully_shard_autograd.py::TestFullyShardPostAccGradHookMultiThread::test_post_acc_grad_hook_runs:
    ``register_post_accumulate_grad_hook`` on every sharded parameter (units in_proj, out_proj,
    root): each hook runs exactly once per backward."""
    param_name_to_hook_count = collections.defaultdict(int)

    def hook(param_name, param):
        param_name_to_hook_count[param_name] += 1

    torch.manual_seed(42)
    model = MLP(8)
    for module in (model.in_proj, model.out_proj, model):
        impl.fully_shard(module)
    for param_name, param in model.named_parameters():
        param.register_post_accumulate_grad_hook(functools.partial(hook, param_name))
    inp = torch.randn((2, 8))
    model(inp).sum().backward()
    param_names = {param_name for param_name, _ in model.named_parameters()}
    assert param_names == set(param_name_to_hook_count), (
        f"hooks ran for {sorted(param_name_to_hook_count)}, expected all of {sorted(param_names)}")
    assert all(count == 1 for count in param_name_to_hook_count.values()), dict(param_name_to_hook_count)
    return impl.full_grads(model)


@cases.case(world_size=2)
def post_acc_grad_hook_optim_parity(rank, world_size, impl):
    """Upstream: test_fully_shard_autograd.py::TestFullyShardPostAccGradHookMultiProcess::test_post_acc_grad_hook_optim_parity:
    a Transformer whose optimizer (one AdamW + StepLR per parameter) runs in post-accumulate-grad
    hooks on the sharded parameters matches the same model stepped normally: losses and local
    shards equal (``torch.equal``) over 10 steps."""
    torch.manual_seed(42)
    model_args = ModelArgs(dropout_p=0.0)
    model = Transformer(model_args)
    ref_model = copy.deepcopy(model)
    for module in itertools.chain(ref_model.layers, [ref_model]):
        impl.fully_shard(module)
    optim_kwargs = {"lr": 1e-2, "foreach": False}
    ref_optim = torch.optim.AdamW(ref_model.parameters(), **optim_kwargs)
    lr_scheduler_kwargs = {"step_size": 5}
    ref_lr_scheduler = torch.optim.lr_scheduler.StepLR(ref_optim, **lr_scheduler_kwargs)
    for module in itertools.chain(model.layers, [model]):
        impl.fully_shard(module)
    param_to_optim, param_to_lr_scheduler = {}, {}
    for param in model.parameters():
        param_to_optim[param] = torch.optim.AdamW([param], **optim_kwargs)
        param_to_lr_scheduler[param] = torch.optim.lr_scheduler.StepLR(param_to_optim[param], **lr_scheduler_kwargs)

    def optim_hook(param):
        param_to_optim[param].step()
        param_to_optim[param].zero_grad()
        param_to_lr_scheduler[param].step()

    for param in model.parameters():
        param.register_post_accumulate_grad_hook(optim_hook)
    torch.manual_seed(42 + rank)
    inp = torch.randint(0, model_args.vocab_size, (2, 16))
    losses = []
    for _ in range(NUM_ITERS):
        ref_loss = ref_model(inp).sum()
        ref_loss.backward()
        ref_optim.step()
        ref_optim.zero_grad()
        ref_lr_scheduler.step()
        loss = model(inp).sum()
        loss.backward()
        assert torch.equal(ref_loss, loss), (ref_loss, loss)
        for (name, ref_param), param in zip(ref_model.named_parameters(), model.parameters()):
            assert torch.equal(impl.local(ref_param), impl.local(param)), f"{name} differs"
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "params": impl.full_params(model)}


test_case = cases.pytest_tests()
