"""Port of upstream ``test/distributed/_composable/fsdp/test_fully_shard_debug.py``.

Which unit owns which parameter, and the names each unit gives its module and its parameters
after lazy initialisation, for ``FSDP(Sequential(MLP(FSDP(in_proj), FSDP(out_proj)), MLP(...)))``:
the root unit holds only the parameters no nested unit claimed (``1.*``), each nested unit its own
module's, and every name is relative to the root.

Upstream reads FSDP2's private ``fully_shard.state(m)._fsdp_param_group._module_fqn`` and each
``FSDPParam._param_fqn``; that is still what the torch run reads. flashfsdp has no
``FSDPParamGroup``: its sharded parameters (DTensors, as FSDP2's) carry their unit
(``param_tags.unit_of``, the unit of ``fully_shard.state(m).unit``) and their recorded name
(``tag_of(p).fqn``), and the unit's name is the module's qualified name after lazy
init (``"<root>"`` for the root, whose qualified name is empty). Lazy init is triggered as upstream
does (the root state's private ``_lazy_init()``), and also by a first forward (the public way).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.testing._internal.common_fsdp import MLP

from tests.fsdp2_suite.runner import CaseSet
from flashfsdp.runtime.param_tags import tag_of

cases = CaseSet(__name__)

UPSTREAM = "test/distributed/_composable/fsdp/test_fully_shard_debug.py"

EXPECTED = {
    "": {"1.in_proj.weight", "1.in_proj.bias", "1.out_proj.weight", "1.out_proj.bias"},
    "0.in_proj": {"0.in_proj.weight", "0.in_proj.bias"},
    "0.out_proj": {"0.out_proj.weight", "0.out_proj.bias"},
}


def unit_param_fqns(impl, model: nn.Module) -> dict[str, dict[str, int]]:
    """Per fully_shard'ed module (by its path in ``model``): the names its unit gives the parameters
    it owns (-> their full numel). Also checks the unit's own name for its module."""
    out: dict[str, dict[str, int]] = {}
    if impl.name == "torch":
        for path, module in model.named_modules():
            state = impl.fully_shard.state(module) if isinstance(module, impl.FSDPModule) else None
            if state is None:
                continue
            group = state._fsdp_param_group
            assert group is not None, f"'{path}' has no parameter group"
            assert group._module_fqn == path, f"'{path}': module fqn {group._module_fqn!r}"
            out[path] = {fp._param_fqn: fp._orig_size.numel() for fp in group.fsdp_params}
        return out
    # flashfsdp: ownership is on the sharded parameters
    units = {}
    for path, module in model.named_modules():
        if isinstance(module, impl.FSDPModule):
            unit = impl.fully_shard.state(module).unit
            units[id(unit)] = path
            assert unit.name == (path or "<root>"), f"'{path}': unit named {unit.name!r}"
            out[path] = {}
    for name, p in model.named_parameters():
        assert impl.is_sharded(p), f"{name} is not sharded"
        owner = units.get(id(tag_of(p).unit))
        assert owner is not None, f"{name}'s unit is not the unit of any fully_shard'ed module of the model"
        out[owner][tag_of(p).fqn] = impl.full_shape(p).numel()
    return out


def _build(impl) -> nn.Module:
    torch.manual_seed(42)
    model = nn.Sequential(MLP(8), MLP(8))
    impl.fully_shard(model[0].in_proj)
    impl.fully_shard(model[0].out_proj)
    impl.fully_shard(model)  # root gets `model[1]`
    return model


def _check(got: dict[str, dict[str, int]], how: str) -> None:
    assert set(got) == set(EXPECTED), f"{how}: fully_shard'ed modules {sorted(got)}"
    for path, want in EXPECTED.items():
        assert set(got[path]) == want, f"{how}: the unit of '{path}' owns {sorted(got[path])}, expected {sorted(want)}"


@cases.case()
def fully_shard_module_and_param_fqns(rank, world_size, impl):
    """Upstream: test_fully_shard_debug.py::TestFullyShardDebug::test_fully_shard_module_and_param_fqns:
    after the root's lazy init, the root unit owns exactly ``1.{in,out}_proj.{weight,bias}`` (the
    parameters no nested unit claimed), ``0.in_proj``'s unit ``0.in_proj.*`` and ``0.out_proj``'s
    ``0.out_proj.*``, named relative to the root (upstream's module FQN "" / "0.in_proj" / ...).
    Also after a lazy init by a first forward instead of the private ``_lazy_init()``."""
    model = _build(impl)
    impl.fully_shard.state(model)._lazy_init()
    by_private = unit_param_fqns(impl, model)
    _check(by_private, "after _lazy_init()")

    model = _build(impl)
    model(torch.randn(2, 8)).sum().backward()
    by_forward = unit_param_fqns(impl, model)
    _check(by_forward, "after a forward/backward")
    return [by_private, by_forward]


test_case = cases.pytest_tests()
