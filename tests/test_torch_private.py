"""Every private PyTorch API flashfsdp uses (flashfsdp/_torch_private.py) still exists, with the
signature and behaviour flashfsdp relies on; a missing one fails with a clear ImportError; and the
rest of flashfsdp reaches torch's private names only through that module.

A test here failing on a new torch release names the API that changed."""

from __future__ import annotations

import ast
import inspect
import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from flashfsdp import _torch_private as tp

PACKAGE = pathlib.Path(tp.__file__).parent

# Python functions: the parameters (in order) flashfsdp passes, positionally or by name.
SIGNATURES = {
    "get_scalar_dtype": ["is_fused"],
    "use_grad_for_differentiable": ["func"],
    "refresh_per_optimizer_state": [],
    "get_default_store": [],
    "get_registry": ["module"],
    "override_module_mixed_precision": ["root", "module_classes_to_override", "wrap_override_dict"],
    "module_wrap_policy": ["module", "recurse", "nonwrapped_numel", "module_classes"],
    "or_policy": ["module", "recurse", "nonwrapped_numel", "policies"],
    "post_order_apply": ["root_module", "fn"],
    "recursive_wrap": ["module", "auto_wrap_policy", "wrapper_cls", "ignored_modules", "ignored_params",
                       "only_wrap_children", "kwargs"],
    "run_mixed_precision_override_policy": ["root_module", "module_classes", "ignored_modules", "root_kwargs",
                                            "target_module_to_kwargs"],
    "wrap_module_cls_individually": ["module", "module_classes", "recurse", "args", "kwargs"],
    "sync_params_and_buffers": ["process_group", "module_states", "broadcast_bucket_size", "src"],
    "set_element": ["root_dict", "path", "value"],
    "flatten_state_dict": ["state_dict"],
    "concatenate_meshes": ["device_mesh_list"],
    "StridedShard": ["dim", "split_factor", "sf"],
}
# Built-ins (no Python signature) and classes: checked by behaviour below.
BEHAVIOUR = {
    "current_graph_task_id", "will_engine_execute_node", "are_functorch_transforms_active", "DisableFuncTorch",
    "unsafe_set_version_counter", "profiler_enabled", "make_wrapper_subclass", "disabled_torch_function_impl",
    "DisableTorchFunctionSubclass", "aten_to_copy", "pytree", "foreach_copy_", "foreach_add_", "foreach_sub_",
    "foreach_mul_", "foreach_mul", "foreach_norm", "foreach_zero_", "assert_async", "REGISTRY_KEY", "RegistryItem", "WrapPolicy", "COMPOSABLE_STATE_KEY",
    "saved_tensors_hooks_is_enabled", "top_saved_tensors_default_hooks", "set_code_exec_strategy",
    "FrameExecStrategy", "FrameAction", "ActivationWrapper", "CheckpointImpl",
    "apply_activation_checkpointing", "checkpoint_wrapper", "c10d_world", "DTensorSpec", "TensorMeta",
    "storage_use_count",
}
def _defined_names() -> set[str]:
    """The names _torch_private.py assigns from ``private(...)`` or ``optional_private(...)``."""
    tree = ast.parse(pathlib.Path(tp.__file__).read_text())
    return {node.targets[0].id for node in tree.body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
            and getattr(node.value.func, "id", None) in ("private", "optional_private")}


def test_every_private_name_is_checked_here():
    assert _defined_names() == set(SIGNATURES) | BEHAVIOUR


@pytest.mark.parametrize("name", sorted(SIGNATURES))
def test_python_signatures_are_the_ones_flashfsdp_calls(name):
    assert list(inspect.signature(getattr(tp, name)).parameters) == SIGNATURES[name]


def test_a_missing_private_api_is_a_clear_import_error():
    with pytest.raises(ImportError, match=r"private PyTorch API torch\._no_such_api, which torch .* does not have"):
        tp.private("torch", "_no_such_api")
    with pytest.raises(ImportError, match=r"torch\.no_such_module\.x"):
        tp.private("torch.no_such_module", "x")


def test_autograd_engine_queries():
    assert tp.current_graph_task_id() == -1
    seen = {}
    x = torch.ones(2, requires_grad=True)
    y = (x * 2).sum()
    node = y.grad_fn.next_functions[0][0]

    def hook(grad):
        seen["task"] = tp.current_graph_task_id()
        seen["runs"] = tp.will_engine_execute_node(node)
        return grad

    y.register_hook(hook)
    y.backward()
    assert seen["task"] != -1 and seen["runs"] is True


def test_functorch_state_and_its_off_switch():
    assert tp.are_functorch_transforms_active() is False
    seen = []

    def f(x):
        seen.append(tp.are_functorch_transforms_active())
        with tp.DisableFuncTorch():
            pass
        return (x * x).sum()

    torch.func.grad(f)(torch.ones(2))
    assert seen == [True]


def test_version_counters_and_profiler_state():
    t = torch.zeros(2)
    u = torch.zeros(2)
    tp.unsafe_set_version_counter((t, u), (7, 9))
    assert (t._version, u._version) == (7, 9)
    assert tp.profiler_enabled() is False
    with torch.profiler.profile():
        assert tp.profiler_enabled() is True


def test_wrapper_subclass_pieces():
    class Wrapper(torch.Tensor):
        __torch_function__ = tp.disabled_torch_function_impl

        @staticmethod
        def __new__(cls, shape):
            return tp.make_wrapper_subclass(cls, torch.Size(shape), dtype=torch.float32, device=torch.device("cpu"),
                                            requires_grad=False)

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            return NotImplemented

    w = Wrapper((3, 4))
    assert type(w) is Wrapper and w.shape == (3, 4) and w.dtype == torch.float32
    with tp.DisableTorchFunctionSubclass():
        pass
    assert tp.aten_to_copy.name() == "aten::_to_copy"


def test_pytree_functions():
    tree = {"a": [torch.ones(1), 2], "b": (3,)}
    leaves, spec = tp.pytree.tree_flatten(tree)
    assert tp.pytree.tree_unflatten(leaves, spec)["b"] == (3,)
    assert tp.pytree.tree_leaves(tree)[1:] == [2, 3]
    assert tp.pytree.tree_map(lambda v: v, tree)["b"] == (3,)
    assert tp.pytree.tree_map_only(int, lambda v: v + 1, tree)["b"] == (4,)
    assert dict in tp.pytree.SUPPORTED_NODES


def test_multi_tensor_ops():
    a, b = [torch.zeros(2), torch.zeros(3)], [torch.ones(2), torch.full((3,), 2.0)]
    tp.foreach_copy_(a, b)
    tp.foreach_add_(a, 1)
    tp.foreach_sub_(a, [torch.tensor(1.0), torch.tensor(2.0)])
    tp.foreach_mul_(a, torch.tensor(3.0))
    assert a[0].tolist() == [3.0, 3.0] and a[1].tolist() == [3.0, 3.0, 3.0]
    doubled = tp.foreach_mul(a, 2.0)
    assert doubled[1].tolist() == [6.0, 6.0, 6.0] and a[1].tolist() == [3.0, 3.0, 3.0]
    assert [float(n) for n in tp.foreach_norm([torch.tensor([3.0, 4.0])])] == [5.0]
    tp.foreach_zero_(a)
    assert a[0].tolist() == [0.0, 0.0]
    tp.assert_async(torch.tensor(True), "never raised")


def test_optimizer_and_scaler_helpers():
    class Holder:
        defaults = {"differentiable": False}

        @tp.use_grad_for_differentiable
        def step(self):
            return torch.is_grad_enabled()

    assert Holder().step() is False
    assert tp.get_scalar_dtype(is_fused=None) in (torch.float32, torch.float64)
    state = tp.refresh_per_optimizer_state()
    assert set(state) == {"stage", "found_inf_per_device"}


def test_composable_state_is_what_torchs_fully_shard_state_answers():
    # torch's pipelining reads a unit's state through torch's fully_shard.state(module)
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    module, state = nn.Linear(2, 2), object()
    assert fully_shard.state(module) is None
    tp.set_composable_state(module, fully_shard, state)
    assert fully_shard.state(module) is state
    assert tp.COMPOSABLE_STATE_KEY in module.__dict__
    with pytest.raises(TypeError, match="must be a torch @contract API"):
        tp.set_composable_state(module, lambda m: m, state)


def _pipelining_reads() -> set[str]:
    """The attributes torch's ``PipelineStage.perform_reduce_grad`` reads, in the installed torch,
    on what ``fully_shard.state(module)`` returned, on its ``all_states`` and on their param groups."""
    import textwrap  # noqa: PLC0415

    from torch.distributed.pipelining.stage import _PipelineStageBase  # noqa: PLC0415

    tree = ast.parse(textwrap.dedent(inspect.getsource(_PipelineStageBase.perform_reduce_grad)))
    roots = {"distributed_state"}  # the state, then the names its loops bind from it
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name):
            base = node.iter
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in roots:
                roots.add(node.target.id)
    reads = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in roots:
                reads.update(chain)
    return reads


def test_pipelining_reads_of_an_fsdp_state_are_the_ones_flashfsdp_answers():
    # torch's pipelining reaches into fully_shard.state(stage_module) after the micro-batches:
    # bindings/torch_state.py answers these names; a torch that reads another one fails here
    assert _pipelining_reads() == tp.PIPELINING_STATE_READS
    from flashfsdp.bindings import torch_state  # noqa: PLC0415

    answered = {name for cls in (torch_state.TorchStateView, torch_state.StateContextView,
                                 torch_state.ParamGroupView) for name in dir(cls)}
    assert tp.PIPELINING_STATE_READS - {"_state_ctx"} <= answered  # _state_ctx: set in __init__


def test_composable_registry():
    module = nn.Linear(1, 1)
    assert tp.get_registry(module) is None
    setattr(module, tp.REGISTRY_KEY, {"fully_shard": tp.RegistryItem()})
    assert "fully_shard" in tp.get_registry(module)


def test_process_groups_are_registered_until_destroyed():
    from flashfsdp_dev.ranks import single_process_group  # noqa: PLC0415

    with single_process_group():
        world = dist.group.WORLD
        sub = dist.new_group([0])
        assert world in tp.c10d_world.pg_map and sub in tp.c10d_world.pg_map
        dist.destroy_process_group(sub)
        assert sub not in tp.c10d_world.pg_map and world in tp.c10d_world.pg_map
    assert world not in tp.c10d_world.pg_map and not tp.c10d_world.pg_map


def test_a_groups_timeout_is_read_from_its_backend():
    import datetime  # noqa: PLC0415

    from flashfsdp_dev.ranks import single_process_group  # noqa: PLC0415

    with single_process_group():
        sub = dist.new_group([0], backend="gloo", timeout=datetime.timedelta(seconds=7))
        assert tp.group_timeout(sub) == datetime.timedelta(seconds=7)
        dist.destroy_process_group(sub)


def test_fsdp1_wrap_helpers():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2)))
    order = []
    tp.post_order_apply(model, lambda m: order.append(type(m).__name__) or None)
    assert order[-1] == "Sequential" and order.count("Linear") == 2
    assert isinstance(tp.WrapPolicy, type) and hasattr(tp.WrapPolicy, "_run_policy")


def test_dtensor_spec_and_local_tensor_slot():
    # A DTensor built from a DTensorSpec (mesh, placements, tensor_meta=TensorMeta(shape, stride,
    # dtype)) over a wrapper subclass, as runtime/sharding_spec.py builds the sharded parameters,
    # and its local tensor read and re-pointed through the ``_local_tensor`` slot.
    from flashfsdp_dev.ranks import single_process_group  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor import DTensor, Shard  # noqa: PLC0415

    with single_process_group():
        mesh = init_device_mesh("cpu", (1,))
        local = torch.arange(6.0).view(3, 2)
        meta = tp.TensorMeta(torch.Size((3, 2)), (2, 1), torch.float32)
        spec = tp.DTensorSpec(mesh, (Shard(0),), tensor_meta=meta)
        out = tp.make_wrapper_subclass(DTensor, torch.Size((3, 2)), strides=(2, 1), storage_offset=0,
                                       dtype=torch.float32, device=local.device, layout=local.layout,
                                       requires_grad=False)
        out._spec, out._local_tensor = spec, local
        assert out.placements == (Shard(0),) and out.device_mesh is mesh and out.shape == (3, 2)
        assert tp.dtensor_local(out) is local and torch.equal(out.full_tensor(), local)
        other = torch.ones(3, 2)
        tp.set_dtensor_local(out, other)
        assert tp.dtensor_local(out) is other and torch.equal((out * 2).to_local(), 2 * other)


def test_checkpoint_helpers():
    t = torch.ones(1)
    flat, mapping = tp.flatten_state_dict({"a": {"b": t}})
    assert flat == {"a.b": t} and mapping == {"a.b": ("a", "b")}
    root = {"a": {}}
    tp.set_element(root, ("a", "b"), 5)
    assert root == {"a": {"b": 5}}


def test_saved_tensor_hook_state():
    assert tp.saved_tensors_hooks_is_enabled() is True
    assert tp.top_saved_tensors_default_hooks(True) is None

    def pack(t):
        return t

    def unpack(t):
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        assert tp.top_saved_tensors_default_hooks(True) == (pack, unpack)
    assert tp.top_saved_tensors_default_hooks(True) is None
    with torch.autograd.graph.disable_saved_tensors_hooks("off"):
        assert tp.saved_tensors_hooks_is_enabled() is False
    assert tp.saved_tensors_hooks_is_enabled() is True


def test_frame_exec_strategy_is_present_and_skips_a_frame():
    # Optional in flashfsdp (a slower public fallback exists), required of the torch it is tested with.
    assert None not in (tp.set_code_exec_strategy, tp.FrameExecStrategy, tp.FrameAction)
    calls = []

    def eager_only(x):
        calls.append(torch.compiler.is_compiling())
        return x + 1

    tp.set_code_exec_strategy(eager_only.__code__, tp.FrameExecStrategy(tp.FrameAction.SKIP, tp.FrameAction.SKIP))
    eager_only._torchdynamo_disable = True

    @torch.compile(backend="eager")
    def f(x):
        return eager_only(x * 2) - 1

    assert f(torch.ones(2)).tolist() == [2.0, 2.0]
    assert calls == [False]


def test_optional_private_is_none_where_missing():
    assert tp.optional_private("torch", "_no_such_api") is None


def test_checkpoint_wrapper_helpers():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    wrap = lambda m: tp.checkpoint_wrapper(m, checkpoint_impl=tp.CheckpointImpl.NO_REENTRANT)  # noqa: E731
    tp.apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrap, check_fn=lambda m: isinstance(m, nn.Linear))
    wrapped = [m for m in model if isinstance(m, tp.ActivationWrapper)]
    assert len(wrapped) == 2
    model(torch.ones(1, 2, requires_grad=True)).sum().backward()
    assert model[0]._checkpoint_wrapped_module.weight.grad is not None


def _private_uses(path: pathlib.Path) -> set[str]:
    """torch's private modules and names ``path`` imports or reads as ``torch._...`` attributes."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch"):
            if "._" in node.module:
                found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names if a.name.startswith("_"))
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("torch") and "._" in a.name)
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id == "torch":
                found.add(".".join(["torch", *reversed(chain)]))
    return found


def test_the_rest_of_flashfsdp_reaches_private_apis_through_one_module():
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "_torch_private.py":
            continue
        uses = _private_uses(path)
        if uses:
            offenders[rel] = sorted(uses)
    assert not offenders, f"route these through flashfsdp/_torch_private.py: {offenders}"


def test_storage_use_count_counts_every_tensor_on_a_storage():
    base = torch.zeros(8)
    count = lambda: tp.storage_use_count(base.untyped_storage()._cdata)  # noqa: E731
    alone = count()
    views = [base[:4], base[4:]]
    assert count() == alone + 2
    held = views[0].view(2, 2)  # a view of a view, and a detached alias, count too
    alias = views[1].detach()
    assert count() == alone + 4
    del held, alias, views
    assert count() == alone
