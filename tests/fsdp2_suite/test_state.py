"""Port of upstream ``test/distributed/_composable/fsdp/test_fully_shard_state.py``.

What ``fully_shard`` does to a module as an object: one distinct state per call reachable through
``fully_shard.state(module)``, refusing a second application, swapping only the class of the module
it is given (``FSDP<Class>``, also an ``FSDPModule``) and not of what a container builds from it
(``Sequential`` slicing), refusing containers without a ``forward`` (``ModuleList`` /
``ModuleDict``), and refusing ``copy.deepcopy``.

Upstream runs these at W = 1 (``FSDPTestMultiThread``); here they run at W = 2 with the rest of the
suite (nothing in them depends on W).
"""

from __future__ import annotations

import copy
import re

import torch.nn as nn
from torch.testing._internal.common_fsdp import MLP

from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)

UPSTREAM = "test/distributed/_composable/fsdp/test_fully_shard_state.py"


def expect_raises(exc_type, regex: str, fn, *args, **kwargs) -> BaseException:
    """``assertRaisesRegex``: ``fn(*args, **kwargs)`` raises ``exc_type`` whose message matches ``regex``."""
    try:
        fn(*args, **kwargs)
    except BaseException as exc:  # noqa: BLE001 - the type is checked below
        if not isinstance(exc, exc_type):
            raise AssertionError(f"expected {exc_type.__name__} matching {regex!r}, got "
                                 f"{type(exc).__name__}: {exc}") from exc
        if not re.search(regex, str(exc)):
            raise AssertionError(f"{exc_type.__name__} raised, but {str(exc)!r} does not match {regex!r}") from exc
        return exc
    raise AssertionError(f"expected {exc_type.__name__} matching {regex!r}; nothing was raised")


@cases.case()
def fully_shard_state(rank, world_size, impl):
    """Upstream: test_fully_shard_state.py::TestFullyShardState::test_fully_shard_state — the state
    object of a fully_shard'ed module is reachable as ``fully_shard.state(module)`` (the composable
    API's accessor) and each ``fully_shard`` call builds a distinct one."""
    num_mlps = 3
    model = nn.Sequential(*[MLP(8) for _ in range(num_mlps)])
    for mlp in model:
        impl.fully_shard(mlp)
    impl.fully_shard(model)
    root_state = impl.fully_shard.state(model)
    assert root_state is not None
    all_states = [root_state] + [impl.fully_shard.state(mlp) for mlp in model]
    assert len({id(s) for s in all_states}) == num_mlps + 1, "each fully_shard call must construct a distinct state"
    return len(all_states)


@cases.case()
def fully_shard_reapply(rank, world_size, impl):
    """Upstream: test_fully_shard_state.py::TestFullyShardState::test_fully_shard_reapply — a second
    ``fully_shard`` on the same module raises ``AssertionError`` (upstream's message: "Each distinct
    composable distributed API can only be applied to a module once."; matched loosely here).
    flashfsdp raises ``ValueError`` (bad input, with what to do) where torch raises
    ``AssertionError``: documented in docs/fsdp2_compatibility.md."""
    model = MLP(8)
    impl.fully_shard(model)
    error = AssertionError if impl.name == "torch" else ValueError
    expect_raises(error, r"(?i)only be applied to a module once|already fully_shard'ed", impl.fully_shard, model)
    return 0


@cases.case()
def fully_shard_cls(rank, world_size, impl):
    """Upstream: test_fully_shard_state.py::TestFullyShardState::test_fully_shard_cls — only the module
    passed to fully_shard gets the ``FSDP<Class>`` class (still an instance of its class and of
    ``FSDPModule``); slicing a fully_shard'ed ``Sequential`` gives a plain ``Sequential``, not an
    ``FSDPModule``."""
    model = MLP(8)
    impl.fully_shard(model)
    assert isinstance(model, MLP)
    assert isinstance(model, impl.FSDPModule)
    assert model.__class__.__name__ == "FSDPMLP", model.__class__.__name__
    for module in model.modules():
        if module is model:
            continue
        assert not isinstance(module, impl.FSDPModule), f"{type(module).__name__} must not be an FSDPModule"

    # Check that slicing into a `Sequential` does not preserve FSDP
    model = nn.Sequential(*[MLP(8) for _ in range(3)])
    impl.fully_shard(model)
    assert isinstance(model, nn.Sequential)
    assert isinstance(model, impl.FSDPModule)
    assert model.__class__.__name__ == "FSDPSequential", model.__class__.__name__
    sliced_model = model[:2]
    assert isinstance(sliced_model, nn.Sequential)
    assert not isinstance(sliced_model, impl.FSDPModule), (
        f"model[:2] is a {type(sliced_model).__name__}, an FSDPModule; upstream expects a plain Sequential")
    return 0


@cases.case()
def fully_shard_unsupported_module_cls(rank, world_size, impl):
    """Upstream: test_fully_shard_state.py::TestFullyShardState::test_fully_shard_unsupported_module_cls —
    ``fully_shard`` of a ``ModuleList`` / ``ModuleDict`` (containers without ``forward``) raises
    ``ValueError`` "fully_shard does not support containers that do not implement forward"."""
    regex = r"fully\_shard does not support containers that do not implement forward"
    model = nn.ModuleList([MLP(8) for _ in range(3)])
    expect_raises(ValueError, regex, impl.fully_shard, model)
    model = nn.ModuleDict({"1": MLP(8), "2": MLP(8)})
    expect_raises(ValueError, regex, impl.fully_shard, model)
    return 0


@cases.case()
def fully_shard_deepcopy(rank, world_size, impl):
    """Upstream: test_fully_shard_state.py::TestFullyShardState::test_fully_shard_deepcopy —
    ``copy.deepcopy`` of a fully_shard'ed module raises ``AssertionError`` "FSDP does not support
    deepcopy". flashfsdp raises ``RuntimeError`` with the same words and what to do instead
    (documented in docs/fsdp2_compatibility.md)."""
    model = MLP(8)
    impl.fully_shard(model)
    error = AssertionError if impl.name == "torch" else RuntimeError
    expect_raises(error, "FSDP does not support deepcopy", copy.deepcopy, model)
    return 0


test_case = cases.pytest_tests()
