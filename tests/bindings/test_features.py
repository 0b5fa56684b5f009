"""Frozen parameters, all_gather_with_grad, tied parameters, memory accounting, the unshard's
copies (zero copy-out where the gathered buffer is the unsharded layout)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import flashfsdp
from flashfsdp.bindings.autograd import in_backward
from flashfsdp.kernels.dispatch import use_backend
from flashfsdp.runtime.flat_param import FlatParam
from flashfsdp.runtime.process_group import ProcessGroupCommunicator
from flashfsdp.runtime.reduce import ReduceLayout
from tests.harness import run_distributed
from tests.training import CountingCommunicator, gather_full_params, local_rows


class LoRALinear(nn.Module):
    """A frozen base weight with a trainable low-rank update, all in one unit."""

    def __init__(self, d: int, r: int = 2):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d**0.5, requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(r, d) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(d, r) * 0.1)

    def forward(self, x):
        return F.linear(x, self.weight) + F.linear(F.linear(x, self.lora_a), self.lora_b)


def _lora(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(LoRALinear(9), nn.Tanh(), LoRALinear(9))
    ref = copy.deepcopy(model)
    comm = CountingCommunicator(ProcessGroupCommunicator())
    for m in (model[0], model[2], model):
        flashfsdp.fully_shard(m, communicator=comm)
    model.set_bucket_bytes(0)  # one reduce-scatter per unit, counted (buckets: tests/bindings/test_buckets.py)
    frozen_before = gather_full_params(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        x = torch.randn(4 * world_size, 9, generator=g)
        model(local_rows(x, rank, world_size)).pow(2).mean().backward()
        frozen_grads = [p.grad for n, p in model.named_parameters() if not p.requires_grad]
        opt.step()
        opt.zero_grad()
        ref(x).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    state = model[0]._flashfsdp_state
    frozen_groups = [g for g in state.unit.groups if not g.requires_grad]
    return {
        "params": gather_full_params(model),
        "ref": {n: p.detach() for n, p in ref.named_parameters()},
        "frozen_before": frozen_before,
        "frozen_grads": frozen_grads,
        "frozen_grad_buffers": [g.sharded_grad for g in frozen_groups],
        "rs_numels": comm.reduce_scatter_numels,
        # What one reduce-scatter of a group carries: W segments of its shard and its flags.
        "trainable_rs": sorted(world_size * ReduceLayout.of(g).segment for s in (model[0], model[2])
                               for g in s._flashfsdp_state.unit.groups if g.requires_grad),
    }


def test_frozen_parameters_cost_no_gradient_communication_or_memory():
    for r in run_distributed(_lora, 2):
        for name, value in r["ref"].items():
            torch.testing.assert_close(r["params"][name], value, rtol=1e-5, atol=1e-5)
        for name in ("0.weight", "2.weight"):
            assert torch.equal(r["params"][name], r["frozen_before"][name])
        assert all(g is None for g in r["frozen_grads"])
        assert all(b is None for b in r["frozen_grad_buffers"])
        # Each step reduce-scatters exactly the trainable groups of the two LoRA units.
        assert len(r["trainable_rs"]) == 2
        assert sorted(r["rs_numels"]) == sorted(r["trainable_rs"] * 3)


class _FrozenEmbeddingLoRAHead(nn.Module):
    """A frozen embedding and a LoRA head in the root unit, a trainable block unit between them:
    the root's forward input (token ids) requires no grad, and the head's frozen base weight is
    read by the backward op that passes the gradient to the block after the LoRA factors'
    gradients are accumulated (that branch of the sum was recorded later, so it runs first)."""

    def __init__(self, d: int = 9):
        super().__init__()
        self.emb = nn.Embedding(11, d)
        self.emb.requires_grad_(False)
        self.block = nn.Linear(d, d)
        self.head = LoRALinear(d)

    def forward(self, tokens):
        return self.head(torch.tanh(self.block(self.emb(tokens))))


def _frozen_root(rank, world_size):
    torch.manual_seed(0)
    model = _FrozenEmbeddingLoRAHead()
    ref = copy.deepcopy(model)
    flashfsdp.fully_shard(model.block)
    flashfsdp.fully_shard(model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        tokens = torch.randint(11, (4 * world_size, 5), generator=g)
        for m, o, t in ((model, opt, local_rows(tokens, rank, world_size)), (ref, ref_opt, tokens)):
            m(t).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    return gather_full_params(model), {n: p.detach() for n, p in ref.named_parameters()}


def test_unit_with_frozen_parameter_and_no_grad_input_reshards_at_the_end_of_backward():
    """A unit holding a frozen parameter whose forward inputs require no grad (here the root,
    under a frozen embedding) cannot tell from its inputs when the last op reading that parameter
    has run: it reshards at the end of the backward (as FSDP2 ends it), not when its trainable
    parameters have their gradients, so the head's frozen base weight is still there for the op
    that passes the gradient on to the block, and training matches the unsharded model."""
    for params, ref in run_distributed(_frozen_root, 2):
        for name, value in ref.items():
            torch.testing.assert_close(params[name], value, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def _info_nce(rank, world_size):
    torch.manual_seed(0)
    encoder = nn.Linear(6, 4)
    ref = copy.deepcopy(encoder)
    flashfsdp.fully_shard(encoder)
    g = torch.Generator().manual_seed(5)
    queries, keys = torch.randn(3 * world_size, 6, generator=g), torch.randn(3 * world_size, 6, generator=g)

    def loss_of(q, k, offset):
        logits = F.normalize(q, dim=1) @ F.normalize(k, dim=1).T / 0.1
        labels = torch.arange(q.shape[0]) + offset
        return F.cross_entropy(logits, labels)

    q_local = encoder(local_rows(queries, rank, world_size))
    k_all = flashfsdp.all_gather_with_grad(encoder(local_rows(keys, rank, world_size)))
    loss_of(q_local, k_all, 3 * rank).backward()
    grads = {n: p.grad.to_local().clone() for n, p in encoder.named_parameters()}  # this rank's dim-0 chunks
    loss_of(ref(queries), ref(keys), 0).backward()
    return {"grads": grads, "ref": {n: torch.chunk(p.grad, world_size, 0)[rank] for n, p in ref.named_parameters()}}


@pytest.mark.parametrize("world_size", [2, 4])
def test_all_gather_with_grad_gives_single_process_gradient(world_size):
    for r in run_distributed(_info_nce, world_size):
        for name, want in r["ref"].items():
            torch.testing.assert_close(r["grads"][name], want, rtol=1e-5, atol=1e-6)


def test_tied_parameter_shared_with_another_unit_is_rejected():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(5, 4)
            self.out = nn.Linear(4, 5, bias=False)
            self.out.weight = self.emb.weight

    model = Tied()
    flashfsdp.fully_shard(model.out)
    with pytest.raises(ValueError, match=r"'emb.weight' of Tied is shared with the unit of Linear.*fully_shard\(\[module_a, module_b\]\)"):
        flashfsdp.fully_shard(model)


def test_tied_parameters_in_one_unit_train_as_one():
    model = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
    model[1].weight = model[0].weight
    ref = copy.deepcopy(model)
    flashfsdp.fully_shard(model)
    assert len(list(model.parameters())) == 1
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    tokens = torch.tensor([[0, 3, 4, 1]])
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(2):
            m(tokens).logsumexp(-1).sum().backward()
            o.step()
            o.zero_grad()
    torch.testing.assert_close(next(model.parameters()).view(5, 4), ref[0].weight)


class _Stack(nn.Module):
    """n Linear(d, d) blocks (one unit each) and a Linear(d, d_out) head in the root's unit."""

    def __init__(self, n_blocks=16, d=24, d_out=1):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(n_blocks))
        self.head = nn.Linear(d, d_out)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


@contextlib.contextmanager
def _after_every_unshard(callback):
    """Call ``callback()`` right after any unit's unsharded buffer is (re)allocated.

    Instrumentation only: the real ``FlatParam.alloc_unsharded`` runs first. Those allocations are
    the moments where the storage the runtime holds grows during a step (the gradient shards and
    the optimizer state are allocated once, in the first step, and stay).
    """
    original = FlatParam.alloc_unsharded

    def alloc_and_sample(self, *args, **kwargs):
        original(self, *args, **kwargs)
        callback()

    FlatParam.alloc_unsharded = alloc_and_sample
    try:
        yield
    finally:
        FlatParam.alloc_unsharded = original


def _memory(rank, world_size):
    """The peak of what the runtime holds on this rank over 3 steps, and its parts."""
    out = {}
    for max_inflight in (2, 0):
        torch.manual_seed(0)
        model = _Stack(n_blocks=4, d=32, d_out=16)
        full_bytes = sum(p.numel() * 4 for p in model.parameters())
        block_bytes = sum(p.numel() * 4 for p in model.blocks[0].parameters())
        root_bytes = sum(p.numel() * 4 for p in model.head.parameters())
        for b in model.blocks:
            flashfsdp.fully_shard(b)
        flashfsdp.fully_shard(model)
        model.set_max_inflight_all_gathers(max_inflight)
        model.set_bucket_bytes(0)  # the unit-by-unit schedule (buckets: tests/bindings/test_buckets.py)
        states = [m._flashfsdp_state for m in model.modules() if hasattr(m, "_flashfsdp_state")]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        peak = {"held": 0, "grads_in_forward": 0}

        def sample():
            if torch._C._current_graph_task_id() != -1:
                return  # the forward's peak: the backward adds the gradient shards as it goes
            mem = [s.unit.memory_bytes() for s in states]
            runtime = sum(m["sharded"] + m["unsharded"] + m["secondary"] for m in mem)
            adam = sum(t.to_local().numel() * t.element_size()  # DTensor state: this rank's chunk
                       for st in opt.state.values() for t in st.values() if t.dim() > 0)
            peak["held"] = max(peak["held"], runtime + adam)
            grads = sum(g.sharded_grad is not None for s in states for g in s.unit.groups)
            peak["grads_in_forward"] = max(peak["grads_in_forward"], grads)

        with _after_every_unshard(sample):
            for _ in range(3):
                model(torch.randn(4, 32)).sum().backward()
                opt.step()
                opt.zero_grad()
        out[max_inflight] = {"peak": peak["held"], "full": full_bytes, "block": block_bytes, "root": root_bytes,
                             "grads_in_forward": peak["grads_in_forward"]}
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_memory_per_rank_matches_zero3_accounting(world_size):
    """Forward peak bytes per rank = (master + AdamW exp_avg + exp_avg_sq) / W + unsharded units.

    The sharded part is 3 fp32 copies of the model split over W ranks (padding aside): the
    gradient shards, freed once ``zero_grad()`` set every ``.grad`` to None, are not held during
    the forward (FSDP2 frees them too). The unsharded part is what the schedule keeps gathered at
    once: the root (its parameters stay from forward until the end of backward) + the block
    computing + the block prefetched ahead of it (the next one: implicit prefetch asks for one);
    with ``set_max_inflight_all_gathers(0)`` nothing is prefetched: root + one block. The peak is
    sampled after every unsharded allocation of the forward, over three steps, so AdamW state
    exists. A block is more than 5% of the total, so the tolerance tells the unsharded counts apart.
    """
    for r in run_distributed(_memory, world_size):
        for max_inflight, blocks_gathered in ((2, 2), (0, 1)):
            m = r[max_inflight]
            assert m["grads_in_forward"] == 0, m
            formula = 3 * m["full"] / world_size + m["root"] + blocks_gathered * m["block"]
            assert m["block"] > 0.05 * formula  # the check below can tell one block more or less
            assert abs(m["peak"] - formula) <= 0.05 * formula, (max_inflight, m, formula)


class _FrozenBackbone(nn.Module):
    """A trainable embedding, ``n_blocks`` frozen Linear blocks, a trainable head."""

    def __init__(self, n_blocks=8, d=8):
        super().__init__()
        self.emb = nn.Embedding(11, d)
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(n_blocks))
        self.blocks.requires_grad_(False)
        self.head = nn.Linear(d, 3)

    def forward(self, tokens):
        x = self.emb(tokens)
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def test_frozen_units_reshard_during_backward():
    """Blocks whose parameters are all frozen are resharded right after their backward, so only
    the block computing and the one prefetched are unsharded at once (not every frozen block)."""
    torch.manual_seed(0)
    model = _FrozenBackbone()
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    for b in model.blocks:
        flashfsdp.fully_shard(b)
    flashfsdp.fully_shard(model)
    model.set_bucket_bytes(0)  # the unit-by-unit schedule (buckets: tests/bindings/test_buckets.py)
    blocks = [b._flashfsdp_state for b in model.blocks]
    in_backward_counts = []

    def sample():
        if in_backward():
            in_backward_counts.append(sum(s.unit.memory_bytes()["unsharded"] > 0 for s in blocks))

    tokens = torch.tensor([[1, 4, 7, 2]])
    with _after_every_unshard(sample):
        for _ in range(2):
            model(tokens).sum().backward()
    # every block was gathered in each backward, but the last in the second step (its parameters
    # were kept from forward: keep_for_backward)
    assert len(in_backward_counts) >= 2 * len(blocks) - 1
    assert max(in_backward_counts) <= 2, in_backward_counts
    assert all(s.unit.memory_bytes()["unsharded"] == 0 for s in blocks)
    assert model.head.weight.grad is not None and model.emb.weight.grad is not None
    assert all(p.grad is None for p in model.blocks.parameters())
    after = gather_full_params(model)
    for name, value in frozen.items():
        assert torch.equal(after[name], value), name


class _CountWrites(TorchDispatchMode):
    """Counts the elements written by every aten op (outputs and mutated arguments)."""

    def __init__(self):
        super().__init__()
        self.written = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "aten":
            for arg, value in zip(func._schema.arguments, args):
                if arg.alias_info is not None and arg.alias_info.is_write:
                    values = value if isinstance(value, (list, tuple)) else [value]
                    self.written += sum(v.numel() for v in values if isinstance(v, torch.Tensor))
        return out


def _unshard_writes(rank, world_size, single=False):
    """Unshard a bf16 unit (``single``: of one parameter): elements written by aten ops, where its
    parameters live after unshard and in forward."""
    torch.manual_seed(0)
    model = nn.Linear(16, 32, bias=False) if single else nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    ref = copy.deepcopy(model).to(torch.bfloat16)
    flashfsdp.fully_shard(model, mp_policy=flashfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    (group,) = model._flashfsdp_state.unit.groups
    # The reference kernels run as aten ops, so the mode sees every element they write; the
    # all-gather is a c10d op (gloo writes the other ranks' slices in place, outside aten).
    with use_backend("reference"), _CountWrites() as counter:
        model.unshard()
    base = group.unsharded_flat.data_ptr()
    after_unshard = [(p.data_ptr() - base, p.dtype) for p in model.parameters()]
    model.reshard()
    freed = group.unsharded_flat.untyped_storage().nbytes() == 0
    in_forward = []

    def record(module, args):
        buf = group.unsharded_flat
        lo, hi = buf.data_ptr(), buf.data_ptr() + buf.untyped_storage().nbytes()
        in_forward.extend(lo <= p.data_ptr() and p.data_ptr() + p.numel() * p.element_size() <= hi
                          for p in module.parameters(recurse=False))

    for layer in [model] if single else model:
        layer.register_forward_pre_hook(record)  # runs inside the root's forward, after its unshard
    x = torch.randn(3, 16)
    with torch.no_grad():
        out = model(x)
        want = ref(x.to(torch.bfloat16))
    lay = group.layout
    return {
        "written": counter.written, "shard_size": lay.shard_size, "numel": sum(lay.numels),
        "zero_copy": lay.zero_copy, "unsharded_offsets": list(lay.unsharded_offsets), "params": len(lay.numels),
        "after_unshard": after_unshard, "freed": freed, "in_forward": in_forward, "out": out, "want": want,
    }


def _assert_unshard_writes(r, zero_copy):
    assert r["zero_copy"] is zero_copy
    if zero_copy:
        # Only the copy-in writes (S elements); the parameters are views of the all-gathered buffer.
        assert 0 < r["written"] <= r["shard_size"]
    else:
        # The copy-in (S elements), then one copy-out of every parameter's elements: nothing more.
        assert r["shard_size"] < r["written"] <= r["shard_size"] + r["numel"]
    assert r["after_unshard"] == [(off * 2, torch.bfloat16) for off in r["unsharded_offsets"]]
    assert r["freed"]
    assert len(r["in_forward"]) == r["params"] and all(r["in_forward"])
    torch.testing.assert_close(r["out"], r["want"], rtol=0, atol=0)


def test_unshard_is_zero_copy_out():
    _assert_unshard_writes(_unshard_writes(0, 1), zero_copy=True)


def _unshard_writes_both(rank, world_size):
    return _unshard_writes(rank, world_size), _unshard_writes(rank, world_size, single=True)


def test_unshard_on_two_ranks_copies_out_once_unless_one_parameter_fills_the_shard():
    """The all-gather lands rank-major (FSDP2's layout): with several parameters one copy-out puts
    each parameter's chunks in place; a single parameter whose chunk fills the shard is gathered
    straight into place (zero copy-out)."""
    for several, single in run_distributed(_unshard_writes_both, 2):
        _assert_unshard_writes(several, zero_copy=False)
        _assert_unshard_writes(single, zero_copy=True)


class _Dynamic(nn.Module):
    """Block a runs twice; block c runs only on odd steps (a changed execution order)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5)

    def forward(self, x, step):
        x = torch.tanh(self.a(x))
        x = torch.tanh(self.b(x))
        if step % 2:
            x = torch.tanh(self.c(x))
        return self.a(x)


def _dynamic(rank, world_size):
    torch.manual_seed(0)
    model = _Dynamic()
    ref = copy.deepcopy(model)
    for m in (model.a, model.b, model.c, model):
        flashfsdp.fully_shard(m)
    opt, ref_opt = torch.optim.AdamW(model.parameters(), lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        x = torch.randn(2 * world_size, 5, generator=g)
        model(local_rows(x, rank, world_size), step).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x, step).pow(2).mean().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    return gather_full_params(model), {n: p.detach() for n, p in ref.named_parameters()}


def test_module_run_twice_and_changing_order_train_correctly():
    for got, want in run_distributed(_dynamic, 2):
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5)


def _prefetch_counts(rank, world_size, max_inflight):
    model = _Stack(n_blocks=6, d=8)
    for b in model.blocks:
        flashfsdp.fully_shard(b)
    flashfsdp.fully_shard(model)
    model.set_max_inflight_all_gathers(max_inflight)
    model.set_bucket_bytes(0)  # units, not buckets (tests/bindings/test_buckets.py)
    # Unit 0 prefetches units 1..3 explicitly; the root's limit decides how many it gets.
    model.blocks[0].set_modules_to_forward_prefetch(list(model.blocks[1:4]))
    seen = []

    def count(*_):
        seen.append(sum(s.unit.memory_bytes()["unsharded"] > 0 for s in (b._flashfsdp_state for b in model.blocks)))

    model.blocks[0].register_forward_pre_hook(count)  # runs after flashfsdp's own pre-hook
    for _ in range(2):
        model(torch.randn(2, 8)).sum().backward()
    return seen


@pytest.mark.parametrize("max_inflight", [0, 2])
def test_max_inflight_bounds_prefetched_units(max_inflight):
    (seen,) = run_distributed(_prefetch_counts, 1, max_inflight)
    # At block 0's forward: block 0 itself plus the admitted prefetches.
    assert seen[-1] == 1 + max_inflight
