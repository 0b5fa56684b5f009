"""Port of upstream ``test/distributed/_composable/fsdp/test_fully_shard_compose.py``.

``fully_shard`` composed with torch's other composable APIs:

- ``replicate`` (``torch.distributed._composable.replicate``, DDP as a module hook) managing a
  module above or below a fully_shard'ed one, in upstream's four nestings. Upstream only runs 10
  training steps and asserts nothing; the port checks what those steps must give: each step's
  loss equal to the replicated reference's (a copy whose gradients are averaged over the ranks,
  :func:`average_grads`, what ``replicate`` does for every parameter), the final parameters equal
  to the reference's (sharded ones gathered, replicated ones as they are), and the same losses for
  torch's ``fully_shard`` and flashfsdp. Wrong gradients for a module managed by ``replicate`` (or
  for the units around it) show up as a loss or parameter mismatch.
- composable ``checkpoint`` (activation checkpointing) on a child that is fully_shard'ed with an
  fp16 ``param_dtype``: the dtype of the forward inputs of the root, ``c1`` and ``c2`` (root and
  c1 fp32, c2 fp16 after the child's input cast), also in the forward recomputed inside backward,
  with ``checkpoint`` on the child itself or (``strict``) on its submodule ``c2.l``.

Upstream runs on CUDA at W = min(4, #GPUs); here CPU/gloo at W = 2.
"""

from __future__ import annotations

import copy

import torch
from torch.distributed._composable import checkpoint, replicate
from torch.testing._internal.common_dist_composable import CompositeModel, CompositeParamModel
from torch.testing._internal.common_distributed import SaveForwardInputsModel

from tests.fsdp2_suite.common import FP32, average_grads
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)

UPSTREAM = "test/distributed/_composable/fsdp/test_fully_shard_compose.py"


# ============================================================================ helpers
def full_value(impl, param: torch.Tensor) -> torch.Tensor:
    """The full value of ``param``: gathered if it is sharded (collective), as it is if it is a
    plain parameter (one managed by ``replicate``)."""
    return impl.full(param).detach().clone() if impl.is_sharded(param) else param.detach().clone()


def _build(config: str, impl):
    """Upstream's four nestings. Each comma delimits a level of the module tree, bottom-up; 'r' is
    ``replicate``, 'fm' a manual ``fully_shard``. Returns (model, reference copy)."""
    cpu = torch.device("cpu")
    torch.manual_seed(42)
    if config == "1fm,1r":
        model = CompositeModel(device=cpu)
        ref_model = copy.deepcopy(model)
        impl.fully_shard(model.l1)
        replicate(model)
    elif config == "1r,1fm":
        model = CompositeParamModel(cpu)
        ref_model = copy.deepcopy(model)
        replicate(model.u1)
        impl.fully_shard(model)
    elif config == "1r1fm,1fm":
        model = CompositeParamModel(cpu)
        ref_model = copy.deepcopy(model)
        replicate(model.u1)
        impl.fully_shard(model.u2)
        impl.fully_shard(model)
    elif config == "1fm1fm,1r1r,1fm":
        model = CompositeParamModel(cpu)
        ref_model = copy.deepcopy(model)
        impl.fully_shard(model.u1.seq)
        impl.fully_shard(model.u2.seq)
        replicate(model.u1)
        replicate(model.u2)
        impl.fully_shard(model)
    else:
        raise ValueError(f"Unknown config: {config}")
    return model, ref_model


def _replicate_and_fully_shard(rank, world_size, impl, config: str):
    model, ref_model = _build(config, impl)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    names = [n for n, _ in ref_model.named_parameters()]
    assert [n for n, _ in model.named_parameters()] == names, "parameter names changed by the wrapping"

    torch.manual_seed(rank + 42)
    inp = torch.randn((2, 100))
    losses = []
    for iter_idx in range(10):
        step = []
        for _model, _optim in ((ref_model, ref_optim), (model, optim)):
            _optim.zero_grad(set_to_none=(iter_idx % 2 == 0))
            step.append(_model(inp).sum())
            step[-1].backward()
            if _model is ref_model:
                average_grads(ref_model)
            _optim.step()
        torch.testing.assert_close(step[1].detach(), step[0].detach(), **FP32,
                                   msg=lambda m, i=iter_idx: f"[{config}] step {i}: loss vs the reference: {m}")
        losses.append(step[1].detach())
    # The replicated and the sharded parameters both end where the reference's do.
    for (name, p), ref_p in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(full_value(impl, p), ref_p.detach(), **FP32,
                                   msg=lambda m, name=name: f"[{config}] {name} after 10 steps: {m}")
    return torch.stack(losses)


# ============================================================================ TestFullyShardCompose
@cases.case()
def replicate_and_fully_shard_1fm_1r(rank, world_size, impl):
    """Upstream: test_fully_shard_compose.py::TestFullyShardCompose::test_replicate_and_fully_shard
    (config "1fm,1r"): CompositeModel with ``l1`` fully_shard'ed and ``replicate`` on the root
    above it; 10 Adam steps match the replicated reference (losses and final parameters)."""
    return _replicate_and_fully_shard(rank, world_size, impl, "1fm,1r")


@cases.case()
def replicate_and_fully_shard_1r_1fm(rank, world_size, impl):
    """Upstream: test_fully_shard_compose.py::TestFullyShardCompose::test_replicate_and_fully_shard
    (config "1r,1fm"): CompositeParamModel with ``u1`` under ``replicate`` and ``fully_shard`` on the
    root above it (the root unit must leave u1's parameters to replicate); parity as above."""
    return _replicate_and_fully_shard(rank, world_size, impl, "1r,1fm")


@cases.case()
def replicate_and_fully_shard_1r1fm_1fm(rank, world_size, impl):
    """Upstream: test_fully_shard_compose.py::TestFullyShardCompose::test_replicate_and_fully_shard
    (config "1r1fm,1fm"): ``u1`` under ``replicate``, ``u2`` fully_shard'ed beside it, the root
    fully_shard'ed; parity as above."""
    return _replicate_and_fully_shard(rank, world_size, impl, "1r1fm,1fm")


@cases.case()
def replicate_and_fully_shard_1fm1fm_1r1r_1fm(rank, world_size, impl):
    """Upstream: test_fully_shard_compose.py::TestFullyShardCompose::test_replicate_and_fully_shard
    (config "1fm1fm,1r1r,1fm"): ``u1.seq`` and ``u2.seq`` fully_shard'ed, ``u1`` and ``u2`` under
    ``replicate`` above them, the root fully_shard'ed; parity as above."""
    return _replicate_and_fully_shard(rank, world_size, impl, "1fm1fm,1r1r,1fm")


class _RecordingInputs(dict):
    """``SaveForwardInputsModel``'s ``forward_inputs`` dict that also logs every write (a module's
    forward input), with whether it happened inside a backward (the checkpoint's recomputation)."""

    def __init__(self, labels: dict):
        super().__init__()
        self.labels = labels  # id(module) -> label
        self.log: list[tuple[str, torch.dtype, bool]] = []

    def __setitem__(self, module, tensor):
        self.log.append((self.labels[id(module)], tensor.dtype, _in_backward()))
        super().__setitem__(module, tensor)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


_LABELS = ("root", "c1", "c2", "c2.l")
_BITS = {torch.float32: 32, torch.float16: 16, torch.bfloat16: -16, torch.float64: 64}


def _checkpoint_and_fully_shard(rank, world_size, impl, checkpoint_strict_submodule: bool):
    torch.manual_seed(42)
    labels: dict = {}
    forward_inputs = _RecordingInputs(labels)
    model = SaveForwardInputsModel(forward_inputs=forward_inputs, cast_forward_inputs=False)
    labels.update({id(model): "root", id(model.c1): "c1", id(model.c2): "c2"})
    # c2.l is no SaveForwardInputsModule: log its inputs with a hook (forward and recomputation).
    model.c2.l.register_forward_pre_hook(
        lambda m, args: forward_inputs.log.append(("c2.l", args[0].dtype, _in_backward())))
    x = torch.zeros(2, 100)

    if checkpoint_strict_submodule:
        checkpoint(model.c2.l)
    else:
        checkpoint(model.c2)
    impl.fully_shard(model.c2, mp_policy=impl.MixedPrecisionPolicy(param_dtype=torch.float16))
    impl.fully_shard(model)

    loss = model(x).sum()
    loss.backward()

    assert forward_inputs[model].dtype == torch.float32, forward_inputs[model].dtype
    assert forward_inputs[model.c1].dtype == torch.float32, forward_inputs[model.c1].dtype
    # Notably, the recomputed forward preserves the right dtype (what forward_inputs holds last is
    # the recomputation's input when c2 itself is checkpointed).
    assert forward_inputs[model.c2].dtype == torch.float16, forward_inputs[model.c2].dtype
    log = forward_inputs.log
    for label, dtype, _ in log:
        want = torch.float32 if label in ("root", "c1") else torch.float16
        assert dtype == want, f"{label}'s forward input is {dtype}, expected {want}: {log}"
    recomputed = "c2.l" if checkpoint_strict_submodule else "c2"
    assert any(label == recomputed and in_bwd for label, _, in_bwd in log), \
        f"{recomputed}'s forward was not recomputed in backward: {log}"
    # The (single-rank) grads exist for every parameter and are finite.
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None for g in grads), "a parameter got no gradient"
    # Compared with the torch run: which module ran (forward or recomputation) in which order, the
    # input dtype each got, and the loss.
    return {"log": [(_LABELS.index(lbl), _BITS[d], int(b)) for lbl, d, b in log], "loss": loss.detach().float()}


@cases.case(rtol=1e-3, atol=1e-3)  # fp16 compute: the two implementations may round differently
def checkpoint_and_fully_shard_strict_false(rank, world_size, impl):
    """Upstream: test_fully_shard_compose.py::TestFullyShardCompose::test_checkpoint_and_fully_shard
    (checkpoint_strict_submodule=False): composable ``checkpoint(model.c2)`` and ``fully_shard(c2,
    param_dtype=fp16)``: root/c1 inputs fp32, c2's fp16, also in the recomputed forward."""
    return _checkpoint_and_fully_shard(rank, world_size, impl, False)


@cases.case(rtol=1e-3, atol=1e-3)  # fp16 compute: the two implementations may round differently
def checkpoint_and_fully_shard_strict_true(rank, world_size, impl):
    """Upstream: test_fully_shard_compose.py::TestFullyShardCompose::test_checkpoint_and_fully_shard
    (checkpoint_strict_submodule=True): ``checkpoint(model.c2.l)`` (a submodule of the fp16 unit):
    root/c1 inputs fp32, c2's and c2.l's fp16, also in c2.l's recomputed forward."""
    return _checkpoint_and_fully_shard(rank, world_size, impl, True)


test_case = cases.pytest_tests()
