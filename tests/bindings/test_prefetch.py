"""The prefetch schedule as the runtime runs it: which units are all-gathered, when, how often."""

from __future__ import annotations

import collections

import torch
import torch.nn as nn

import flashfsdp
from flashfsdp.runtime.states import ShardState


class _Chain(nn.Module):
    """Blocks a, b, c; a runs twice (``a b c a``); c is skipped when ``skip_c``."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(5, 5), nn.Linear(5, 5), nn.Linear(5, 5)

    def forward(self, x, skip_c=False):
        x = torch.tanh(self.a(x))
        x = torch.tanh(self.b(x))
        if not skip_c:
            x = torch.tanh(self.c(x))
        return self.a(x)


def _sharded_chain():
    torch.manual_seed(0)
    model = _Chain()
    for m in (model.a, model.b, model.c, model):
        flashfsdp.fully_shard(m)
    model.set_bucket_bytes(0)  # each unit's own all-gathers, counted here (buckets: test_buckets.py)
    return model


def _count_all_gathers(model) -> collections.Counter:
    """Wrap every unit's ``unshard`` to count the all-gathers it issues (by unit)."""
    counts = collections.Counter()
    for name, m in (("a", model.a), ("b", model.b), ("c", model.c), ("root", model)):
        unit = m._flashfsdp_state.unit

        def unshard(unit=unit, name=name, original=unit.unshard):
            if unit.state in (ShardState.SHARDED, ShardState.SECONDARY):
                counts[name] += 1
            return original()

        unit.unshard = unshard
    return counts


def test_unit_run_twice_gets_one_all_gather_per_forward_and_one_reduction():
    """Forward a b c a, backward a c b a: each forward of a unit all-gathers it once, and each
    backward too, except a's: its last forward keeps its parameters for its first backward (it ends
    just before the root's: keep_for_backward), and a's gradients are ready only after its second
    backward, so a stays unsharded in between (one reduce-scatter for a, not one per use); the
    second backward of a must not prefetch c again."""
    model = _sharded_chain()
    x = torch.randn(2, 5)
    model(x).sum().backward()  # records the order
    counts = _count_all_gathers(model)
    reductions = collections.Counter()
    for name, m in (("a", model.a), ("b", model.b), ("c", model.c), ("root", model)):
        unit = m._flashfsdp_state.unit

        def reduce_grads(unit=unit, name=name, original=unit.reduce_grads):
            pending = original()
            reductions[name] += len(pending)
            return pending

        unit.reduce_grads = reduce_grads
    model(x).sum().backward()
    assert counts == {"a": 2, "b": 2, "c": 2, "root": 1}
    assert reductions == {"a": 1, "b": 1, "c": 1, "root": 0}  # the root has no parameters of its own


def test_no_grad_forward_that_skips_a_prefetched_unit_leaves_it_sharded():
    """After a step with c, a no-grad forward without c prefetches c (at b) and never runs it: c
    must not stay gathered (stale after an update, and holding memory)."""
    model = _sharded_chain()
    x = torch.randn(2, 5)
    model(x).sum().backward()
    with torch.no_grad():
        model(x, skip_c=True)
    for m in (model.a, model.b, model.c, model):
        assert m._flashfsdp_state.unit.state is ShardState.SHARDED, m
    # And a loaded state is what the next forward uses.
    zeros = {k: torch.zeros_like(v.full_tensor() if hasattr(v, "full_tensor") else v)
             for k, v in flashfsdp.get_full_state_dict(model, rank0_only=False).items()}
    flashfsdp.set_full_state_dict(model, zeros)
    assert model(x).abs().sum() == 0


def test_reshard_after_forward_int_1_keeps_parameters_like_false():
    """FSDP2's int form: 1 means False (keep for backward), as W means True."""
    torch.manual_seed(0)
    kept = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    flashfsdp.fully_shard(kept[0], reshard_after_forward=1)
    flashfsdp.fully_shard(kept)
    kept(torch.randn(2, 4))
    assert kept[0]._flashfsdp_state.unit.state is ShardState.UNSHARDED


def test_implicit_forward_and_backward_prefetch_happen():
    """From the second step, at block i's forward block i+1 is already being gathered, and when
    block i's backward starts (a user's backward pre-hook runs before flashfsdp's), block i+1's
    backward has already prefetched it."""
    torch.manual_seed(0)
    blocks = nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)])
    for b in blocks:
        flashfsdp.fully_shard(b)
    flashfsdp.fully_shard(blocks)
    seen = {"forward": [], "backward": []}

    def state_of(i):
        return blocks[i]._flashfsdp_state.unit.state

    for i in range(3):
        blocks[i].register_forward_pre_hook(lambda m, a, i=i: seen["forward"].append(state_of(i + 1)))
    for i in range(3):
        blocks[i].register_full_backward_pre_hook(lambda m, g, i=i: seen["backward"].append(state_of(i)))
    x = torch.randn(2, 4, requires_grad=True)
    blocks(x).sum().backward()
    seen = {"forward": [], "backward": []}
    blocks(x).sum().backward()
    assert seen["forward"] and all(s is not ShardState.SHARDED for s in seen["forward"])
    assert seen["backward"] and all(s is not ShardState.SHARDED for s in seen["backward"])


def test_last_block_keeps_its_parameters_for_backward():
    """From the second step the block whose forward ends last before the root's stays unsharded
    through the loss (backward needs it first): one all-gather per step instead of two. Not with
    max_inflight 0 (the memory-lean setting)."""
    for max_inflight, kept in ((2, True), (0, False)):
        torch.manual_seed(0)
        blocks = nn.Sequential(*[nn.Linear(4, 4) for _ in range(3)])
        for b in blocks:
            flashfsdp.fully_shard(b)
        flashfsdp.fully_shard(blocks)
        blocks.set_max_inflight_all_gathers(max_inflight)
        blocks.set_bucket_bytes(0)  # the unit's own all-gathers, counted here
        x = torch.randn(2, 4)
        blocks(x).sum().backward()
        gathers = collections.Counter()
        last = blocks[2]._flashfsdp_state.unit
        original = last.unshard

        def unshard(original=original):
            if last.state in (ShardState.SHARDED, ShardState.SECONDARY):
                gathers["last"] += 1
            return original()

        last.unshard = unshard
        out = blocks(x)
        assert (last.state is ShardState.UNSHARDED) is kept
        assert all(b._flashfsdp_state.unit.state is ShardState.SHARDED for b in blocks[:2])
        out.sum().backward()
        assert gathers["last"] == (1 if kept else 2)
        assert all(b._flashfsdp_state.unit.state is ShardState.SHARDED for b in blocks)
