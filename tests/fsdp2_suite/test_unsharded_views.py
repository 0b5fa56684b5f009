"""Port of upstream ``test/distributed/_composable/fsdp/test_fully_shard_unsharded_views.py``.

Upstream runs a world of one rank, where FSDP2 can make the unsharded parameter a *view* of the
sharded one (no all-gather output is allocated), and checks through FSDP2's internals
(``FSDPParam._unsharded_param``, ``all_gather_outputs``, ``data_ptr``) that those views survive
``reshard()`` and weight loading. What a user observes of it, and what is ported here at W = 2:

- frozen parameters (``requires_grad_(False)``), built normally or on the meta device and
  materialised with ``to_empty``, loaded from their own state dict; no-grad forwards with
  ``reshard_after_forward`` False and True;
- after ``model.reshard()``, an in-place ``load_state_dict`` of new values is seen by the next
  forward (output 9 · version for ``Linear(8, 4)`` with every weight and bias = version and an
  all-ones input), again and again, with the same parameter objects and shards holding the
  values;
- after a no-grad forward with ``reshard_after_forward=False`` (the module may still hold its
  unsharded parameters), ``load_state_dict(assign=True)`` replaces the parameters and the next
  forward uses the new ones (output 18).

The state-dict values are DTensors for both implementations (their types are recorded and
compared with torch's), updated as upstream updates them (``torch.full_like``).

Not applicable (FSDP2's ``FSDPParam`` internals, which flashfsdp's flat groups do not have): the
``data_ptr`` equalities of borrowed views, ``FSDPParam.init_all_gather_outputs`` not being called, ``_unsharded_param_is_view``,
``all_gather_outputs`` / ``_unsharded_inner_tensors`` being empty; the ``TwoTensor`` subclass
variant (``fsdp_get_unsharded_view`` extension protocol); and the other upstream tests
(``test_training_and_casts_keep_independent_storage``, ``test_cpu_offload_keeps_independent_storage``,
``test_extension_can_decline_and_must_preserve_metadata``: internals only;
``test_graph_replay_reads_loaded_weights_without_unshard``: CUDA graphs).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)

UPSTREAM = "test/distributed/_composable/fsdp/test_fully_shard_unsharded_views.py"


def _make_model(impl, meta: bool, reshard_after_forward: bool) -> nn.Module:
    """Upstream's ``_make_model`` (no subclass): a frozen ``Linear(8, 4)``, fully_shard'ed, possibly
    built on the meta device and materialised with ``to_empty``, then every value set to 0.5 in its
    own state dict and loaded."""
    with torch.device("meta" if meta else "cpu"):
        model = nn.Linear(8, 4)
        model.requires_grad_(False)
    impl.fully_shard(model, reshard_after_forward=reshard_after_forward)
    if meta:
        model.to_empty(device="cpu")
    state = model.state_dict()
    impl.record_types(f"meta={meta}, reshard_after_forward={reshard_after_forward}: state_dict", state)
    for tensor in state.values():
        tensor.fill_(0.5)
    model.load_state_dict(state)
    return model


def _check_sharded_values(impl, model: nn.Module, value: float, where: str) -> None:
    for name, p in model.named_parameters():
        assert impl.is_sharded(p), f"{where}: {name} is not sharded"
        local = impl.local(p)
        torch.testing.assert_close(local, torch.full_like(local, value), rtol=0, atol=0,
                                   msg=lambda m, name=name: f"{where}: {name}'s shard: {m}")


def _views_survive_reshard_and_weight_loading(impl, meta: bool, reshard_after_forward: bool):
    model = _make_model(impl, meta, reshard_after_forward)
    params = [p for _, p in model.named_parameters()]
    assert all(not p.requires_grad for p in params)
    inputs = torch.ones(2, 8)
    outputs = []
    with torch.no_grad():
        out = model(inputs)
        torch.testing.assert_close(out, torch.full_like(out, 4.5), rtol=0, atol=0)  # 8 * 0.5 + 0.5
        for version in range(1, 4):
            model.reshard()
            where = f"meta={meta}, reshard_after_forward={reshard_after_forward}, version {version}"
            assert all(a is b for a, b in zip(model.parameters(), params)), \
                f"{where}: the module does not hold its sharded parameters after reshard()"
            state = model.state_dict()
            update = {name: torch.full_like(tensor, version) for name, tensor in state.items()}
            impl.record_types(f"{where}: state_dict", state)
            impl.record_types(f"{where}: update", update)
            model.load_state_dict(update)
            assert all(a is b for a, b in zip(model.parameters(), params)), \
                f"{where}: an in-place load_state_dict replaced the parameters"
            _check_sharded_values(impl, model, version, where)
            output = model(inputs)
            torch.testing.assert_close(output, torch.full_like(output, 9 * version), rtol=0, atol=0,
                                       msg=lambda m, where=where: f"{where}: the forward after the load: {m}")
            outputs.append(output)
    return torch.stack(outputs)


@cases.case()
def views_survive_reshard_and_weight_loading(rank, world_size, impl):
    """Upstream: test_fully_shard_unsharded_views.py::TestFullyShardUnshardedViews::test_views_survive_reshard_and_weight_loading
    (subclass=False; meta in {False, True} x reshard_after_forward in {False, True}): frozen
    ``Linear(8, 4)``; after ``reshard()``, three in-place ``load_state_dict`` of new values each show
    in the next no-grad forward (9 · version), in the shards, with the same parameter objects."""
    return [_views_survive_reshard_and_weight_loading(impl, meta, raf)
            for meta in (False, True) for raf in (False, True)]


@cases.case()
def replaced_storage_recreates_view(rank, world_size, impl):
    """Upstream: test_fully_shard_unsharded_views.py::TestFullyShardUnshardedViews::test_replaced_storage_recreates_view:
    a no-grad forward with ``reshard_after_forward=False``, then ``load_state_dict(assign=True)`` of
    new values (2): the module's parameters are replaced and the next forward uses them (18); the
    data_ptr checks are FSDP2's view mechanics (not applicable), their observable part is that the
    assigned parameters are the ones the module holds and shards afterwards."""
    model = _make_model(impl, False, False)
    inputs = torch.ones(2, 8)
    with torch.no_grad():
        model(inputs)
        old_weight = model.weight
        state = {name: torch.full_like(tensor, 2) for name, tensor in model.state_dict().items()}
        impl.record_types("assigned state_dict", state)
        model.load_state_dict(state, assign=True)
        assigned = model.weight
        assert assigned is not old_weight, "load_state_dict(assign=True) kept the old parameter"
        out = model(inputs)
        torch.testing.assert_close(out, torch.full((2, 4), 18.0), rtol=0, atol=0,
                                   msg=lambda m: f"the forward after load_state_dict(assign=True): {m}")
        model.reshard()
        assert model.weight is assigned, "after the forward and reshard(), the module does not hold the assigned weight"
        _check_sharded_values(impl, model, 2.0, "after the assigned load")
    return out


test_case = cases.pytest_tests()
