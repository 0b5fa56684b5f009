"""Port of upstream ``test/distributed/_composable/fsdp/test_fully_shard_clip_grad_norm_.py``.

Gradient-norm clipping of a sharded model against the replicated reference: the total norm is the
global one (all ranks' shards), one all-reduce computes it, and every gradient is clipped by the
same coefficient as the reference's.

Upstream calls the stock ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``, which works
because the gradients are DTensors (the norm is a ``Partial`` DTensor, reduced once); flashfsdp's
are the same DTensors, so every case calls the stock function on both implementations, as a
drop-in user does, and counts the functional all-reduces under ``CommDebugMode`` as upstream does.
``clip_grad_norm_flashfsdp`` also runs flashfsdp's own ``flashfsdp.clip_grad_norm_`` (one
all-reduce per unit communicator, through that communicator) against the same reference.
"""

from __future__ import annotations

import copy
import functools
import math

import torch
from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer

from tests.fsdp2_suite.common import average_grads, rank_seed, shard_transformer
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)

UPSTREAM = "test/distributed/_composable/fsdp/test_fully_shard_clip_grad_norm_.py"

# Upstream: 10 iterations without an optimizer step (every iteration recomputes the same gradients
# after zero_grad); 2 keep the "zero_grad, backward again, clip again" part.
NUM_ITERS = 2


class count_all_reduces:
    """Context manager yielding a callable that returns the functional all-reduces issued inside
    (upstream's ``CommDebugMode`` count)."""

    def __enter__(self):
        from torch.distributed.tensor.debug import CommDebugMode  # noqa: PLC0415

        self.mode = CommDebugMode()
        self.mode.__enter__()
        counts = self.mode.get_comm_counts
        return lambda: (counts().get(torch.ops.c10d_functional.all_reduce, 0)
                        + counts().get(torch.ops._c10d_functional.all_reduce, 0))

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)


def build_transformer(impl):
    """Upstream's model: ``Transformer(ModelArgs(dropout_p=0.0))``, each block and the root sharded;
    the reference is a replicated copy (gradients averaged after backward)."""
    torch.manual_seed(42)
    model = Transformer(ModelArgs(dropout_p=0.0))
    ref_model = copy.deepcopy(model)
    shard_transformer(impl, model)
    return ref_model, model


def _test_clip_grad_norm(rank, impl, max_norm, norm_type, ref_model, model, clip_fn, all_reduces_expected=1):
    """Upstream's ``_test_clip_grad_norm``; ``clip_fn(model, max_norm, norm_type)`` clips the sharded
    model and returns the total norm as a plain tensor (or a DTensor, made full here);
    ``all_reduces_expected``: the functional all-reduces it issues (None: not counted)."""
    vector_norm_fn = functools.partial(torch.linalg.vector_norm, ord=norm_type)
    ref_optim = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    rank_seed(rank)
    inp = torch.randint(0, model.model_args.vocab_size, (3, 16))
    out = {"total_norm": [], "clipped_grads": []}
    for _ in range(NUM_ITERS):
        ref_optim.zero_grad()
        ref_model(inp).sum().backward()
        average_grads(ref_model)
        optim.zero_grad()
        model(inp).sum().backward()

        ref_grads = [p.grad.detach().clone() for p in ref_model.parameters()]
        local_grads = [impl.local(p.grad).detach().clone() for p in model.parameters()]
        for (name, param), ref_grad in zip(model.named_parameters(), ref_grads):
            torch.testing.assert_close(impl.full(param.grad, param), ref_grad, rtol=1.3e-6, atol=1e-5,
                                       msg=lambda m, name=name: f"{name}.grad: {m}")

        # Check that all gradients have norm greater than the max norm before clipping to ensure
        # the clipping is not vacuous.
        assert all(vector_norm_fn(g).item() > max_norm for g in ref_grads)
        assert all(vector_norm_fn(g).item() > max_norm for g in local_grads)

        # Check gradient norm clipping via total norm and individual gradient norms post-clipping
        ref_total_norm = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm=max_norm,
                                                        norm_type=norm_type)
        with count_all_reduces() as num_all_reduces:
            total_norm = clip_fn(model, max_norm, norm_type)
            all_reduces = num_all_reduces()
        if hasattr(total_norm, "full_tensor"):  # a DTensor (Partial(max) for inf): outside the count, as upstream
            total_norm = total_norm.full_tensor()
        torch.testing.assert_close(total_norm, ref_total_norm, rtol=1.3e-6, atol=1e-5,
                                   msg=lambda m: f"total norm (norm_type={norm_type}) differs from the "
                                                 f"replicated reference's: {m}")
        # Expect one all-reduce (one mesh dim) for partial -> replicate
        if all_reduces_expected is not None:
            assert all_reduces == all_reduces_expected, (f"{all_reduces} all-reduces for the total norm, "
                                                         f"upstream expects {all_reduces_expected}")
        # For zero gradients, clipping has no effect
        for param, grad in zip(ref_model.parameters(), ref_grads):
            assert vector_norm_fn(param.grad).item() <= max_norm
            if torch.count_nonzero(grad):
                assert not torch.equal(param.grad, grad)
        for param, grad in zip(model.parameters(), local_grads):
            assert vector_norm_fn(impl.local(param.grad)).item() <= max_norm
            if torch.count_nonzero(grad):
                assert not torch.equal(impl.local(param.grad), grad)
        # The clipped gradients are the reference's (same coefficient everywhere).
        impl.check_sharded_parity(ref_model, model)
        out["total_norm"].append(total_norm.detach().clone())
        out["clipped_grads"].append(impl.full_grads(model))
    return out


def stock_clip(model, max_norm, norm_type):
    """What upstream calls (and a drop-in user): the stock function over ``model.parameters()``."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=max_norm, norm_type=norm_type, foreach=True)


def _clip_grad_norm_1d(rank, impl, norm_type):
    ref_model, model = build_transformer(impl)
    return _test_clip_grad_norm(rank, impl, 1, norm_type, ref_model, model, stock_clip)


@cases.case()
def clip_grad_norm_1d_l2(rank, world_size, impl):
    """Upstream: test_fully_shard_clip_grad_norm_.py::TestClipGradNormWorldSize2::test_clip_grad_norm_1d
    (norm_type=2) — the total 2-norm of the sharded gradients equals the replicated reference's, is
    computed with one all-reduce, and clips every gradient like the reference (the stock
    ``clip_grad_norm_`` on both)."""
    return _clip_grad_norm_1d(rank, impl, 2)


@cases.case()
def clip_grad_norm_1d_l1(rank, world_size, impl):
    """Upstream: test_fully_shard_clip_grad_norm_.py::TestClipGradNormWorldSize2::test_clip_grad_norm_1d
    (norm_type=1) — as ``clip_grad_norm_1d_l2`` for the 1-norm."""
    return _clip_grad_norm_1d(rank, impl, 1)


@cases.case()
def clip_grad_norm_1d_linf(rank, world_size, impl):
    """Upstream: test_fully_shard_clip_grad_norm_.py::TestClipGradNormWorldSize2::test_clip_grad_norm_1d
    (norm_type=inf) — as ``clip_grad_norm_1d_l2`` for the max-norm."""
    return _clip_grad_norm_1d(rank, impl, math.inf)


@cases.case(torch_reason="flashfsdp's own clip_grad_norm_ (torch has none over a module)")
def clip_grad_norm_flashfsdp(rank, world_size, impl):
    """flashfsdp's ``flashfsdp.clip_grad_norm_(model, max_norm)``: the same global norm and clipped
    gradients as the replicated reference, through the units' communicators (no DTensor
    collective: nothing counted under ``CommDebugMode``)."""
    ref_model, model = build_transformer(impl)
    return _test_clip_grad_norm(rank, impl, 1, 2, ref_model, model, impl.api.clip_grad_norm_,
                                all_reduces_expected=0)


test_case = cases.pytest_tests()
