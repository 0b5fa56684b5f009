"""Frozen parameters, all_gather_with_grad, tied parameters, memory accounting, zero copy-out."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import flashfsdp
from flashfsdp.kernels.dispatch import use_backend
from flashfsdp.runtime.communicator import Communicator
from flashfsdp.runtime.process_group import ProcessGroupCommunicator
from tests.harness import run_distributed
from tests.training import gather_full_params, local_rows


class LoRALinear(nn.Module):
    """A frozen base weight with a trainable low-rank update, all in one unit."""

    def __init__(self, d: int, r: int = 2):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d, d) / d**0.5, requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(r, d) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(d, r) * 0.1)

    def forward(self, x):
        return F.linear(x, self.weight) + F.linear(F.linear(x, self.lora_a), self.lora_b)


class CountingCommunicator(Communicator):
    """Delegates to a real communicator and records the elements each reduce-scatter reads."""

    def __init__(self, inner: Communicator):
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size
        self.reduce_scatter_numels: list[int] = []

    def all_gather_into_tensor(self, out, inp):
        return self.inner.all_gather_into_tensor(out, inp)

    def reduce_scatter_tensor(self, out, inp, op="sum"):
        self.reduce_scatter_numels.append(inp.numel())
        return self.inner.reduce_scatter_tensor(out, inp, op)

    def all_reduce(self, tensor, op="sum"):
        return self.inner.all_reduce(tensor, op)

    def broadcast(self, tensor, src):
        return self.inner.broadcast(tensor, src)

    def barrier(self):
        self.inner.barrier()


def _lora(rank, world_size):
    torch.manual_seed(0)
    model = nn.Sequential(LoRALinear(9), nn.Tanh(), LoRALinear(9))
    ref = copy.deepcopy(model)
    comm = CountingCommunicator(ProcessGroupCommunicator())
    for m in (model[0], model[2], model):
        flashfsdp.fully_shard(m, communicator=comm)
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
        "trainable_total": sum(g.layout.total for s in (model[0], model[2]) for g in s._flashfsdp_state.unit.groups if g.requires_grad),
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
        assert sum(r["rs_numels"]) == 3 * r["trainable_total"]


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
    grads = {n: p.grad.clone() for n, p in encoder.named_parameters()}
    everyone = [None] * world_size
    dist.all_gather_object(everyone, {n: (p._flashfsdp_piece.param_start, g) for (n, p), g in zip(encoder.named_parameters(), grads.values())})
    full = {}
    for pieces in everyone:
        for n, (start, gr) in pieces.items():
            shape = dict(ref.named_parameters())[n].shape
            buf = full.setdefault(n, torch.zeros(shape.numel()))
            buf[start : start + gr.numel()] = gr
    loss_of(ref(queries), ref(keys), 0).backward()
    return {"grads": full, "ref": {n: p.grad.reshape(-1) for n, p in ref.named_parameters()}}


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
    with pytest.raises(ValueError, match=r"'emb.weight' is shared with the unit at 'out'"):
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
    def __init__(self, n_blocks=16, d=24):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(n_blocks))
        self.head = nn.Linear(d, 1)

    def forward(self, x):
        for b in self.blocks:
            x = torch.tanh(b(x))
        return self.head(x)


def _memory(rank, world_size):
    torch.manual_seed(0)
    model = _Stack()
    full_bytes = sum(p.numel() * 4 for p in model.parameters())
    largest_unit = max(sum(p.numel() * 4 for p in b.parameters()) for b in model.blocks)
    for b in model.blocks:
        flashfsdp.fully_shard(b)
    flashfsdp.fully_shard(model)
    states = [m._flashfsdp_state for m in model.modules() if hasattr(m, "_flashfsdp_state")]
    peak = {"unsharded": 0}

    def track(*_):
        peak["unsharded"] = max(peak["unsharded"], sum(s.unit.memory_bytes()["unsharded"] for s in states))

    for b in model.blocks:
        b.register_forward_hook(track)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        model(torch.randn(4, 24)).sum().backward()
        opt.step()
    sharded = sum(s.unit.memory_bytes()["sharded"] for s in states)
    adam = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values() if t.dim() > 0)
    return {"measured": sharded + adam + peak["unsharded"], "formula": 4 * full_bytes / world_size + largest_unit}


def test_memory_per_rank_matches_zero3_accounting():
    for r in run_distributed(_memory, 2):
        assert abs(r["measured"] - r["formula"]) <= 0.05 * r["formula"], r


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


def test_unshard_is_zero_copy_out():
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 8))
    flashfsdp.fully_shard(model, mp_policy=flashfsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    unit = model._flashfsdp_state.unit
    (group,) = unit.groups
    # The reference kernels run as aten ops, so the mode sees every element they write.
    with use_backend("reference"), _CountWrites() as counter:
        model.unshard()
    # Only the copy-in writes (S elements); the parameters are views of the all-gathered buffer.
    assert 0 < counter.written <= group.layout.shard_size
    base = group.unsharded_flat.data_ptr()
    for (_, p), off in zip(model.named_parameters(), group.layout.offsets):
        assert p.data_ptr() == base + off * 2 and p.dtype == torch.bfloat16
    model.reshard()
    assert group.unsharded_flat.untyped_storage().nbytes() == 0


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
