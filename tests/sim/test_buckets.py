"""flashfsdp.sim with buckets (``bucket_bytes``, ``runtime/step.py``'s [Note: buckets]): units that
run back to back share one all-gather and one reduce-scatter, each one collective of their summed
bytes with one latency; what that saves, what it holds, and which units go alone."""

from __future__ import annotations

import pytest

from flashfsdp import sim
from flashfsdp.runtime.step import DEFAULT_BUCKET_BYTES
from flashfsdp.sim.elision import separate_embedding
from flashfsdp.sim.quantized import quantized_all_gather
from tests.sim.common import LINK, MB, NO_PREFETCH, W

ALL = 2**30  # a bucket that fits every unit


def _small(n_blocks: int = 4, **kwargs) -> sim.Model:
    """Latency-bound units: blocks of 16,384 bf16 parameters (32 KiB unsharded, reduced in bf16),
    a root of half that."""
    root = sim.Unit("<root>", MB // 128, 1e-3, 2e-3)
    blocks = tuple(sim.Unit(f"layers.{i}", MB // 64, 1e-3, 2e-3) for i in range(n_blocks))
    return sim.Model(root, blocks, **kwargs)


def test_a_bucket_is_one_collective_of_the_summed_bytes():
    """No prefetch, one FIFO: every collective is exposed. Unit by unit: the root and each block
    gathered in forward, the blocks again in backward, a reduce-scatter each. With every unit in
    one bucket: one all-gather for the forward, one for the backward's blocks, one reduce-scatter
    for the blocks and the root (its gradients come last: the blocks' bucket waits for them, no
    other unit being expected after the first block).
    The bytes are the same; each collective saved is one latency (W - 1)·α."""
    model = _small()
    kwargs = dict(policy=NO_PREFETCH, shared_comm_stream=True, record_timeline=True)
    alone = sim.simulate(model, W, LINK, **kwargs)
    bucketed = sim.simulate(model, W, LINK, bucket_bytes=ALL, **kwargs)
    assert (alone.all_gathers, alone.units_gathered, alone.reduce_scatters) == (9, 9, 5)
    assert (bucketed.all_gathers, bucketed.units_gathered, bucketed.reduce_scatters) == (2, 9, 1)
    assert (alone.collectives, bucketed.collectives, bucketed.bucket_bytes) == (14, 3, ALL)
    assert bucketed.collective_bytes == alone.collective_bytes
    root, block = model.root.unsharded_bytes(W), model.blocks[0].unsharded_bytes(W)
    assert bucketed.all_gather_s == pytest.approx(LINK.all_gather_s(root + 4 * block, W) + LINK.all_gather_s(4 * block, W))
    assert bucketed.reduce_scatter_s == pytest.approx(LINK.reduce_scatter_s(4 * block + root, W))
    assert alone.step_s - bucketed.step_s == pytest.approx(11 * (W - 1) * LINK.alpha_s)
    assert bucketed.step_s == pytest.approx(model.compute_s() + bucketed.comm_s)  # all exposed
    spans = [(s.kind, s.unit) for s in bucketed.timeline if s.stream != "compute"]
    assert spans == [("all_gather", "<root> .. layers.3 (5 units)"), ("all_gather", "layers.3 .. layers.0 (4 units)"),
                     ("reduce_scatter", "layers.3 .. <root> (5 units)")]


def test_the_byte_limit_and_the_default():
    model = _small()
    block = model.blocks[0].unsharded_bytes(W)
    two = sim.simulate(model, W, LINK, bucket_bytes=2 * block)
    # forward: the root with a block, then two by two; backward: the three blocks not kept for it
    # (the last one is) as two and one; reductions two by two, the root's alone
    assert (two.all_gathers, two.units_gathered, two.reduce_scatters) == (3 + 2, 8, 2 + 1)
    default = sim.simulate(model, W, LINK, bucket_bytes=DEFAULT_BUCKET_BYTES)
    assert default.all_gathers == 2  # 4 MiB holds every unit of this model
    big = sim.simulate(sim.llama3_8b(), 64, "ib400", bucket_bytes=DEFAULT_BUCKET_BYTES)
    assert big.all_gathers == big.units_gathered  # units of hundreds of MB never share


def test_units_gathered_together_are_held_together():
    """The forward's bucket unshards every unit at once, beside the bucket's gathered buffer (freed
    at the first wait's copy-out): twice the model's unsharded bytes, more than unit by unit."""
    model = _small()
    total = sum(u.unsharded_bytes(W) for u in model.units)
    alone = sim.simulate(model, W, LINK, policy=NO_PREFETCH)
    bucketed = sim.simulate(model, W, LINK, policy=NO_PREFETCH, bucket_bytes=ALL)
    assert bucketed.peak_bytes - bucketed.sharded_bytes == 2 * total
    assert alone.peak_bytes < bucketed.peak_bytes


def test_gradients_wait_for_their_bucket_to_be_packed():
    """The blocks' unsharded gradients stay until the last block of their bucket is packed: with
    parameters kept (no regather), 4 blocks' gradients and parameters and the root's at once."""
    model = _small(root_backward_after=0.5)
    kwargs = dict(policy=NO_PREFETCH, reshard_after_forward=False)
    alone = sim.simulate(model, W, LINK, **kwargs)
    bucketed = sim.simulate(model, W, LINK, bucket_bytes=ALL, **kwargs)
    root, block = model.root.unsharded_bytes(W), model.blocks[0].unsharded_bytes(W)
    grads = 2 * root + 2 * 4 * block  # every unit's parameters, and the gradients of root and blocks
    assert bucketed.peak_bytes - bucketed.sharded_bytes >= grads > alone.peak_bytes - alone.sharded_bytes


def test_int8_all_gathers_go_alone_and_reductions_still_share():
    model = quantized_all_gather(_small())
    pred = sim.simulate(model, W, LINK, bucket_bytes=ALL)
    assert pred.all_gathers == pred.units_gathered == 1 + 2 * 4 - 1  # the last block kept for backward
    assert pred.reduce_scatters == 1


def test_a_unit_whose_backward_reads_no_parameter_is_left_out_of_the_backward_bucket():
    shape = sim.LlamaShape(n_layers=2, dim=64, ffn_dim=128, vocab_size=256, n_heads=4, n_kv_heads=4)
    model = separate_embedding(sim.llama_model(shape), shape)
    pred = sim.simulate(model, W, LINK, policy=NO_PREFETCH, bucket_bytes=ALL, record_timeline=True)
    gathers = [s.unit for s in pred.timeline if s.kind == "all_gather"]
    assert gathers == ["<root> .. layers.1 (4 units)", "layers.1 .. layers.0 (2 units)"]
    assert pred.all_gather_bytes_elided == model.blocks[0].unsharded_bytes(W)


def test_hsdp_all_reduces_each_unit_of_a_bucket():
    model = _small()
    slow = sim.Link("slow", alpha_s=1e-4, bandwidth=1e8)
    pred = sim.simulate(model, 8, sim.Hierarchy(LINK, slow, 2), bucket_bytes=ALL)
    assert (pred.reduce_scatters, pred.all_reduces) == (1, 5)  # as runtime/bucket.py: one per unit
    blocking = sim.simulate(model, 8, sim.Hierarchy(LINK, slow, 2), bucket_bytes=ALL, host_blocking=True)
    assert (blocking.reduce_scatters, blocking.all_reduces) == (1, 5)


def test_one_rank_gathers_nothing():
    """On one rank a bucket's copy-in casts the shards into place: no all-gather (a unit alone
    still calls the one-rank all-gather, as the runtime's)."""
    pred = sim.simulate(_small(), 1, LINK, bucket_bytes=ALL)
    assert (pred.all_gathers, pred.units_gathered) == (0, 8)
    assert pred.peak_bytes - pred.sharded_bytes < 2 * sum(u.unsharded_bytes(1) for u in _small().units)


def test_coupled_ranks_bucket_alike():
    model, slow = _small(), sim.Link("high latency", alpha_s=5e-3, bandwidth=1e9)
    preds = sim.simulate_ranks([model, model], 2, slow, bucket_bytes=ALL)
    alone = sim.simulate_ranks([model, model], 2, slow)
    assert [p.all_gathers for p in preds] == [2, 2] and preds[0].step_s < alone[0].step_s


def test_a_bucket_of_the_whole_forward_exposes_its_all_gather_where_prefetch_hid_them():
    """Buckets are for collectives that cost more than they hide: on a fast link each unit's
    prefetch is hidden behind the unit before it, and one all-gather of every unit before the
    root's forward is exposed whole."""
    model = _small()
    alone, bucketed = sim.simulate(model, W, LINK), sim.simulate(model, W, LINK, bucket_bytes=ALL)
    assert alone.exposed_s < bucketed.exposed_s
    first = LINK.all_gather_s(sum(u.unsharded_bytes(W) for u in model.units), W)
    assert bucketed.exposed_s >= first


@pytest.mark.parametrize("value, error, match", [
    (-1, ValueError, "bucket_bytes must be >= 0"),
    (1.5, TypeError, "bucket_bytes must be an int"),
    (True, TypeError, "bucket_bytes must be an int"),
])
def test_bad_bucket_bytes_name_the_argument(value, error, match):
    with pytest.raises(error, match=match):
        sim.simulate(_small(), W, LINK, bucket_bytes=value)
    with pytest.raises(error, match=match):
        sim.Setting("bad", bucket_bytes=value)


def test_settings_carry_a_bucket_size():
    model = _small()
    (default,) = [s for s in sim.SETTINGS if s.bucket_bytes is not None]
    assert default.bucket_bytes == DEFAULT_BUCKET_BYTES
    assert default.simulate_kwargs(model)["bucket_bytes"] == DEFAULT_BUCKET_BYTES
    plain, bucketed = sim.compare_settings(model, W, LINK, [sim.Setting("plain"), default])
    assert plain.all_gathers > bucketed.all_gathers == 2
    # a bucket size given to the comparison applies to the settings without their own
    plain, bucketed = sim.compare_settings(model, W, LINK, [sim.Setting("plain"), default], bucket_bytes=0)
    assert plain.all_gathers == plain.units_gathered and bucketed.all_gathers == 2
