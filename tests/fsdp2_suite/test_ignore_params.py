"""Port of upstream ``test/distributed/_composable/fsdp/test_fully_shard_ignore_params.py``.

``ignored_params``: parameters a ``fully_shard`` call leaves alone (not sharded, not moved, their
gradients not reduced), so that another data-parallel wrapper (DDP) can manage them.

Upstream's one test wraps part of a model with FSDP (ignoring a submodule's parameters) and the
whole model with DDP (ignoring the parameters FSDP manages), and compares with a DDP-only
reference. Its ``isinstance(module, FSDPModule)`` and ``DTensor.full_tensor()`` checks go
through ``impl.FSDPModule`` and ``impl.full``. Upstream's unused ``X``/``Y`` modules are not ported.

``extra_ignored_params_not_sharded_not_reduced`` has no upstream test: it checks the documented
meaning of ``ignored_params`` with different inputs per rank (the ignored parameters' gradients
stay local, the others are averaged and sharded).
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.experimental import implicit_replication
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.testing._internal.common_fsdp import MLP

from tests.fsdp2_suite.common import FP32, rank_seed
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)

UPSTREAM = "test/distributed/_composable/fsdp/test_fully_shard_ignore_params.py"


# ============================================================================ upstream's model and helpers
class C(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin_c = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_c(x)


class B(nn.Module):
    def __init__(self, dim: int, subtrahend: torch.Tensor) -> None:
        super().__init__()
        self.lin_b = nn.Linear(dim, dim)
        self.module_c = C(dim)
        self.subtrahend = nn.Parameter(subtrahend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin_b(self.module_c(x)) - self.subtrahend


class A(nn.Module):
    def __init__(self, dim: int, addend: torch.Tensor, subtrahend: torch.Tensor) -> None:
        super().__init__()
        self.module_b = B(dim, subtrahend)
        self.addend = nn.Parameter(addend)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.module_b(x) + self.addend).sum()


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix + name


def _generate_model_and_input():
    dim = 8
    torch.manual_seed(42)
    addend = torch.randn((dim, dim))
    torch.manual_seed(70)
    subtrahend = torch.randn((dim, dim))
    model = A(dim, addend, subtrahend)
    torch.manual_seed(84)
    inp = torch.randn((dim, dim))
    return model, inp


def _ddp_ignored_param_names(impl, module: nn.Module, prefix: str) -> list[str]:
    """Every parameter name under a fully_shard'ed module (post-order search)."""
    if isinstance(module, impl.FSDPModule):
        return [name for name, _ in module.named_parameters(prefix)]
    names = []
    for name, child in module.named_children():
        names += _ddp_ignored_param_names(impl, child, _join(prefix, name))
    return names


def _fsdp_ignored_params(module: nn.Module, ignored_path: str, path: str) -> set:
    """The parameters of the submodule at ``ignored_path`` (which must hold no buffer)."""
    if ignored_path == path:
        assert not list(module.buffers()), "ignoring buffers is not handled"
        return set(module.parameters())
    ignored = set()
    for name, child in module.named_children():
        ignored |= _fsdp_ignored_params(child, ignored_path, _join(path, name))
    return ignored


def _post_order_wrap_fsdp(impl, module: nn.Module, mesh, path: str, ignored_path: str, ignored: set) -> nn.Module:
    """fully_shard every module below ``module`` (and it), bottom-up, except the ignored subtree."""
    if ignored_path != path:
        for name, child in module.named_children():
            _post_order_wrap_fsdp(impl, child, mesh, _join(path, name), ignored_path, ignored)
        impl.fully_shard(module, mesh=mesh, ignored_params=ignored)
    return module


def _fsdp_module_paths(impl, module: nn.Module, path: str) -> set[str]:
    found = set()
    for name, child in module.named_children():
        found |= _fsdp_module_paths(impl, child, _join(path, name))
    if isinstance(module, impl.FSDPModule):
        found.add(path)
    return found


def _full(impl, p: torch.Tensor) -> torch.Tensor:
    return impl.full(p).detach().clone() if impl.is_sharded(p) else p.detach().clone()


def _compare_ref_test_params(impl, ref_model: nn.Module, test_model: nn.Module) -> dict:
    """Same names, and every test parameter's full value equals the reference's."""
    ref, test = dict(ref_model.named_parameters()), dict(test_model.named_parameters())
    assert sorted(ref) == sorted(test), (sorted(ref), sorted(test))
    full = {}
    for name, ref_p in ref.items():
        full[name] = _full(impl, test[name])
        torch.testing.assert_close(full[name], ref_p.detach(), msg=name)
    return full


# ============================================================================ TestFullyShardIgnoreParams
@cases.case()
def ddp_A_fsdp_B_ddp_C(rank, world_size, impl):
    """Upstream: test_fully_shard_ignore_params.py::TestFullyShardIgnoreParams::test_ddp_A_fsdp_B_ddp_C.

    ``A(addend, B(lin_b, C(lin_c), subtrahend))``: fully_shard ``module_b.lin_b`` and
    ``module_b`` with ``ignored_params`` = module_c's parameters; then DDP over the whole model,
    ignoring what FSDP manages (subtrahend, lin_b.*). The fully_shard'ed modules are exactly
    {module_b, module_b.lin_b}; the names DDP must ignore are derived as upstream does; 3 Adam
    steps match a DDP-only reference (loss, and every parameter's full value)."""
    mesh = init_device_mesh("cpu", (world_size,))
    ref_model, ref_inp = _generate_model_and_input()
    ref_model = DDP(ref_model, process_group=dist.group.WORLD)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)

    test_model, test_inp = _generate_model_and_input()
    names_before = {p: n for n, p in test_model.named_parameters()}
    ignored_path = "module_b.module_c"
    fsdp_ignored = _fsdp_ignored_params(test_model, ignored_path, "")
    test_model.module_b = _post_order_wrap_fsdp(impl, test_model.module_b, mesh, "module_b", ignored_path,
                                                fsdp_ignored)
    assert _fsdp_module_paths(impl, test_model, "") == {"module_b", "module_b.lin_b"}
    ddp_ignored = _ddp_ignored_param_names(impl, test_model, "")
    assert set(ddp_ignored) == {"module_b.subtrahend", "module_b.lin_b.weight", "module_b.lin_b.bias",
                                "module_b.module_c.lin_c.weight", "module_b.module_c.lin_c.bias"}, ddp_ignored
    # DDP may ignore only what FSDP does not ignore (by the names the parameters had before fully_shard;
    # FSDP-ignored parameters are the same objects after it).
    fsdp_ignored_names = {names_before[p] for p in fsdp_ignored}
    ddp_ignored = [n for n in ddp_ignored if n not in fsdp_ignored_names]
    assert set(ddp_ignored) == {"module_b.subtrahend", "module_b.lin_b.weight", "module_b.lin_b.bias"}
    for n, p in test_model.named_parameters():
        assert impl.is_sharded(p) == (n in ddp_ignored), n
    DDP._set_params_and_buffers_to_ignore_for_model(module=test_model, params_and_buffers_to_ignore=ddp_ignored)
    test_model = DDP(test_model, broadcast_buffers=False)
    test_optim = torch.optim.Adam(test_model.parameters(), lr=1e-2)

    fulls = [_compare_ref_test_params(impl, ref_model, test_model)]
    losses = []
    for _ in range(3):
        ref_loss = ref_model(ref_inp)
        test_loss = test_model(test_inp)
        torch.testing.assert_close(test_loss, ref_loss)
        ref_loss.backward()
        test_loss.backward()
        with implicit_replication():  # one optimizer over DTensor and plain parameters
            ref_optim.step()
            ref_optim.zero_grad()
            test_optim.step()
            test_optim.zero_grad()
        fulls.append(_compare_ref_test_params(impl, ref_model, test_model))
        losses.append(test_loss.detach())
    return {"losses": losses, "params": fulls}


# ============================================================================ extras (no upstream test)
@cases.case()
def extra_ignored_params_not_sharded_not_reduced(rank, world_size, impl):
    """Upstream: none (FSDP2's ``ignored_params`` documentation: "They will not be sharded, nor
    moved to the device during init, nor have their gradients reduced in backward").

    An MLP fully_shard'ed with out_proj's parameters ignored, each rank with its own inputs: the
    ignored parameters are the same full-shape objects, their gradients are this rank's own
    (equal to an unsharded model's, not averaged), in_proj's are sharded and averaged; 2 Adam
    steps keep both as a reference that averages only in_proj's gradients (so out_proj differs
    per rank)."""
    model = MLP(8)
    ref = copy.deepcopy(model)
    ignored = [model.out_proj.weight, model.out_proj.bias]
    impl.fully_shard(model, ignored_params=set(ignored))
    assert model.out_proj.weight is ignored[0] and model.out_proj.bias is ignored[1]
    assert not any(impl.is_sharded(p) for p in ignored)
    assert impl.is_sharded(model.in_proj.weight) and impl.is_sharded(model.in_proj.bias)
    ref_optim = torch.optim.Adam(ref.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    rank_seed(rank)
    results = []
    for _ in range(2):
        inp = torch.randn(4, 8)
        ref_loss = ref(inp).sum()
        ref_loss.backward()
        for p in ref.in_proj.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world_size)
        loss = model(inp).sum()
        loss.backward()
        torch.testing.assert_close(loss, ref_loss, **FP32)
        for p, ref_p in ((model.in_proj.weight, ref.in_proj.weight), (model.in_proj.bias, ref.in_proj.bias)):
            torch.testing.assert_close(impl.local(p.grad), impl.shard_of(ref_p.grad, p), **FP32)
        for p, ref_p in ((model.out_proj.weight, ref.out_proj.weight), (model.out_proj.bias, ref.out_proj.bias)):
            assert p.grad.shape == ref_p.shape
            torch.testing.assert_close(p.grad, ref_p.grad, **FP32)
        ref_optim.step()
        optim.step()
        ref_optim.zero_grad()
        optim.zero_grad()
        for p, ref_p in ((model.in_proj.weight, ref.in_proj.weight), (model.in_proj.bias, ref.in_proj.bias)):
            torch.testing.assert_close(impl.local(p), impl.shard_of(ref_p, p), **FP32)
        for p, ref_p in ((model.out_proj.weight, ref.out_proj.weight), (model.out_proj.bias, ref.out_proj.bias)):
            torch.testing.assert_close(p.detach(), ref_p.detach(), **FP32)
        results.append({"loss": loss.detach(), "out_proj_weight": model.out_proj.weight.detach().clone(),
                        "in_proj_weight": impl.full(model.in_proj.weight)})
    return results


test_case = cases.pytest_tests()
