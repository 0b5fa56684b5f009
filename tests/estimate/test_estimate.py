"""flashfsdp.estimate on shapes alone: bad input, the communication ratios, hybrid sharding, the
optimizer-state layout, DeepSpeed's formula and the command line."""

from __future__ import annotations

import pytest
import torch

from flashfsdp import MixedPrecisionPolicy
from flashfsdp.estimate import estimate, zero3_model_states
from flashfsdp.estimate.__main__ import main
from flashfsdp.estimate.units import unit_spec
from flashfsdp.models import LlamaConfig

SMALL = LlamaConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, multiple_of=16, max_seq_len=16)


@pytest.mark.parametrize("kwargs, match", [
    (dict(model_or_config="huge", world_size=8), "unknown preset 'huge'"),
    (dict(world_size=0), "world_size must be an integer >= 1"),
    (dict(world_size=True), "world_size must be an integer >= 1"),
    (dict(world_size=8, mesh=(2, 2)), "mesh has 4 ranks .* world_size is 8"),
    (dict(world_size=4, mesh=(3,)), "mesh has 3 ranks"),
    (dict(world_size=8, sharding="hybrid"), "needs the shard group size"),
    (dict(world_size=8, sharding="hybrid", shard_group_size=3), "must divide world_size=8"),
    (dict(world_size=8, sharding="zero2"), "unknown sharding 'zero2'"),
    (dict(world_size=8, optimizer="lion"), "unknown optimizer 'lion'"),
    (dict(world_size=8, sharding="grad_op", reshard_after_forward=True), "contradicts"),
    (dict(world_size=8, reshard_after_forward=3), "reshard_after_forward=3"),
    (dict(world_size=8, max_inflight=-1), "max_inflight"),
    (dict(world_size=8, units=["nope"]), "'nope' is not a submodule"),
    (dict(world_size=8, bucket_bytes=-1), "estimate: bucket_bytes must be >= 0"),
])
def test_bad_input_names_the_argument(kwargs, match):
    kwargs = {"model_or_config": SMALL, **kwargs}
    with pytest.raises(ValueError, match=match):
        estimate(kwargs.pop("model_or_config"), **kwargs)


def test_model_of_another_type_is_a_type_error():
    with pytest.raises(TypeError, match="model_or_config"):
        estimate(42, 8)
    with pytest.raises(TypeError, match="estimate: bucket_bytes must be an int"):
        estimate(SMALL, 8, bucket_bytes=2.5)


def test_meta_model_and_config_agree():
    from flashfsdp.models import Llama  # noqa: PLC0415

    with torch.device("meta"):
        model = Llama(SMALL)
    assert estimate(model, 8) == estimate(SMALL, 8)
    assert estimate(model, 8, units=[f"layers.{i}" for i in range(4)]) == estimate(SMALL, 8)


def test_communication_is_one_and_a_half_ddp_and_one_without_resharding():
    """ZeRO-3 (explicit True: every unit gathered in forward and backward) sends 3Ψ against DDP's
    2Ψ; keeping the parameters (grad_op) 2Ψ; the default keeps the root and the last block."""
    full = estimate("8b", 64, reshard_after_forward=True).comm
    grad_op = estimate("8b", 64, sharding="grad_op").comm
    default = estimate("8b", 64).comm
    assert full.ratio_to_ddp == pytest.approx(1.5, rel=1e-3)
    assert grad_op.ratio_to_ddp == pytest.approx(1.0, rel=1e-3)
    assert grad_op.ratio_to_ddp < default.ratio_to_ddp < full.ratio_to_ddp
    assert full.all_gathers == 2 * 33 and grad_op.all_gathers == 33 and default.all_gathers == 2 * 33 - 2


def test_hybrid_shards_like_its_group_and_all_reduces_the_shard():
    hybrid = estimate(SMALL, 16, sharding="hybrid", shard_group_size=4)
    alone = estimate(SMALL, 4)
    assert (hybrid.replicas, hybrid.master_bytes, hybrid.params_peak_bytes) == (4, alone.master_bytes,
                                                                               alone.params_peak_bytes)
    assert hybrid.comm.all_reduce == sum(u.reduced_shard_bytes() for u in hybrid.units) > 0
    assert estimate(SMALL, 16, mesh=(4, 4)) == hybrid


def test_post_forward_slices_cost_memory_and_gather_backward_within_the_group():
    # unit by unit (with buckets the whole forward of SMALL is one all-gather: that peak hides the slices)
    full = estimate(SMALL, 8, reshard_after_forward=True, bucket_bytes=0)
    hpz = estimate(SMALL, 8, reshard_after_forward=2, bucket_bytes=0)
    assert hpz.params_peak_bytes > full.params_peak_bytes
    assert hpz.comm.sent < full.comm.sent
    # a regather from the post-forward slice (over 2 ranks) all-gathers alone, as the runtime's does
    full, hpz = estimate(SMALL, 8, reshard_after_forward=True), estimate(SMALL, 8, reshard_after_forward=2)
    assert full.comm.all_gathers == 2 and hpz.comm.all_gathers == 2 + 4  # forward, then each block


def test_buckets_share_collectives_and_move_the_same_bytes():
    """SMALL's units (root 65,792 bytes, blocks 184,832 unsharded and 185,216 reduce-scattered at
    W = 8): unit by unit, an
    all-gather per unit gathered and a reduce-scatter per unit; buckets of two blocks halve the
    blocks' collectives; the default 4 MiB holds the whole model: one all-gather for the forward,
    one for the backward's blocks, one reduce-scatter for the blocks and the root (its reduction
    comes last: the blocks' bucket waits for it). The bytes are the same; the peak grows: units
    gathered together are held together, beside the bucket's gathered buffer."""
    alone = estimate(SMALL, 8, bucket_bytes=0)
    block = alone.units[1]
    assert (block.unsharded_bytes(), block.reduce_scatter_bytes()) == (184_832, 185_216)
    two = estimate(SMALL, 8, bucket_bytes=2 * 185_216)
    default = estimate(SMALL, 8)
    assert default.bucket_bytes == 4 * 2**20
    assert [(e.comm.all_gathers, e.comm.units_gathered, e.comm.reduce_scatters) for e in (alone, two, default)] == [
        (8, 8, 5), (5, 8, 3), (2, 8, 1)]
    fields = ("all_gather_forward", "all_gather_backward", "reduce_scatter", "sent")
    assert {tuple(getattr(e.comm, f) for f in fields) for e in (alone, two, default)} == {
        tuple(getattr(alone.comm, f) for f in fields)}
    assert alone.params_peak_bytes < two.params_peak_bytes < default.params_peak_bytes
    unsharded = sum(u.unsharded_bytes() for u in alone.units)
    assert default.params_peak_bytes == 2 * unsharded  # every unit, and the bucket's gathered buffer
    # the blocks' gradients wait for the bucket's pack, beside the root's (alive all backward)
    assert default.unsharded_grad_bytes == sum(u.unsharded_grad_bytes() for u in alone.units)
    assert alone.unsharded_grad_bytes == sum(u.unsharded_grad_bytes() for u in alone.units[:2])
    hybrid = estimate(SMALL, 16, sharding="hybrid", shard_group_size=8)
    assert (hybrid.comm.reduce_scatters, hybrid.comm.all_reduces) == (1, 5)  # an all-reduce per unit
    # on one rank a bucket casts the shards into place: no all-gather, no gathered buffer
    one = estimate(SMALL, 1)
    assert (one.comm.all_gathers, one.params_peak_bytes) == (0, sum(u.unsharded_bytes() for u in one.units))
    # a unit with a Shard(1) parameter (the root's embedding here) all-gathers alone, as the runtime's
    from torch.distributed.tensor import Shard  # noqa: PLC0415

    strided = estimate(SMALL, 8, shard_placement_fn=lambda p: Shard(1) if p.shape[0] == SMALL.vocab_size else None)
    assert strided.units[0].groups[0].layout.strided and not strided.units[1].groups[0].layout.strided
    assert (strided.comm.all_gathers, strided.comm.units_gathered) == (3, 8)  # the root, then the blocks


def test_busiest_rank_elements_match_the_layout_chunks():
    for shapes, world in (([(5,), (0, 3), (17, 2), (3,)], 4), ([(1000,), (7, 7)], 64), ([(33,)], 2)):
        spec = unit_spec("u", [torch.empty(s, device="meta", requires_grad=True) for s in shapes], world,
                         torch.bfloat16, None)
        layout = spec.groups[0].layout
        chunks = [sum(torch.chunk(torch.empty(s), world)[r].numel() if r < len(torch.chunk(torch.empty(s), world))
                      else 0 for s in shapes) for r in range(world)]
        assert spec.groups[0].busiest_rank_elements() == max(chunks) == sum(
            layout.local_numel(0, i) for i in range(len(shapes)))


def test_deepspeed_formula_written_out():
    gib = zero3_model_states(10**9, 10**8, num_gpus_per_node=8, num_nodes=2)
    assert gib.gpu_bytes == 4 * 10**8 + int(18 * 10**9 / 16)
    assert gib.cpu_bytes == int(10**8 * 4 * 8 * 1.5)
    offload = zero3_model_states(10**9, 10**8, num_nodes=2, cpu_offload=True, cpu_offload_params=True)
    assert (offload.gpu_bytes, offload.cpu_bytes) == (4 * 10**8, int(10**9 * 18 / 2 * 1.5))
    with pytest.raises(ValueError, match="cpu_offload_params needs cpu_offload"):
        zero3_model_states(1, 1, cpu_offload_params=True)


def test_command_line(capsys):
    assert main(["--preset", "tiny", "--world-size", "8", "--param-dtype", "bf16", "--hsdp", "4",
                 "--table", "2", "8"]) == 0
    out = capsys.readouterr().out
    assert "hybrid: 2 replicas of 4 ranks" in out and "DeepSpeed ZeRO-3" in out and "sent / DDP's" in out
    est = estimate("tiny", 8, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16), sharding="hybrid",
                   shard_group_size=4)
    c = est.comm
    plural = "" if c.reduce_scatters == 1 else "s"
    assert (f"collectives per step: {c.collectives} = {c.all_gathers} all-gathers ({c.units_gathered} unit "
            f"all-gathers), {c.reduce_scatters} reduce-scatter{plural}, {c.all_reduces} all-reduces; buckets of up "
            "to 4 MiB") in out
    assert c.all_gathers < c.units_gathered
    assert main(["--preset", "tiny", "--world-size", "8", "--bucket-bytes", "0", "--table"]) == 0
    alone = estimate("tiny", 8, bucket_bytes=0).comm
    assert (f"collectives per step: {alone.collectives} = {alone.all_gathers} all-gathers, "
            f"{alone.reduce_scatters} reduce-scatters; no buckets") in capsys.readouterr().out
    assert main(["--preset", "huge", "--world-size", "8"]) == 2
    assert "unknown preset 'huge'" in capsys.readouterr().err


def test_int8_all_gathers_halve_the_gathered_bytes_of_bf16(capsys):
    """Each floating group's all-gather carries W packed chunks: S int8 values and a fp32 scale per
    256 (0.508x of bf16 at these sizes); the reduce-scatter is unchanged."""
    from flashfsdp import MixedPrecisionPolicy  # noqa: PLC0415
    from flashfsdp.kernels.quantize import packed_nbytes  # noqa: PLC0415

    bf16 = estimate("tiny", 8, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    int8 = estimate("tiny", 8, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, all_gather_dtype=torch.int8))
    per_unit = {u.name: sum(8 * packed_nbytes(g.layout.shard_size) for g in u.groups) for u in int8.units}
    assert int8.comm.units_gathered == bf16.comm.units_gathered
    # int8 all-gathers go alone (runtime/bucket.py): one per unit; bf16 ones share buckets
    assert int8.comm.all_gathers == int8.comm.units_gathered > bf16.comm.all_gathers
    assert int8.comm.all_gather_forward == sum(per_unit.values())  # every unit gathered once in forward
    assert 0.5 < int8.comm.all_gather_forward / bf16.comm.all_gather_forward < 0.52
    assert int8.comm.reduce_scatter == bf16.comm.reduce_scatter and int8.comm.sent < bf16.comm.sent
    assert main(["--preset", "tiny", "--world-size", "8", "--param-dtype", "bf16", "--all-gather-dtype", "int8",
                 "--table"]) == 0
    assert "int8 all-gathers" in capsys.readouterr().out


def test_training_summary_prints_the_estimate_beside_the_measured_peak(tmp_path):
    from flashfsdp.train import report  # noqa: PLC0415
    from flashfsdp.train.config import TrainConfig  # noqa: PLC0415

    config = TrainConfig.from_argv(["--out", str(tmp_path), "--device", "cpu", "--param-dtype", "bf16"])
    config.save()
    expected = estimate(config.llama, 2, mp_policy=config.precision.policy).total_bytes
    assert report.estimated_memory(str(tmp_path), 2) == expected
    summary = dict(params=1, world_size=2, device="cpu", start_step=0, step=1, train_loss=1.0, val_loss=1.0,
                   unigram_baseline=3.0, tokens_per_s=1.0, wall_s=1.0, peak_memory_bytes=2**30,
                   peak_memory_what="peak RSS (VmHWM) since the reset, minus the RSS before the model")
    assert (f"1.0GiB measured (peak RSS (VmHWM) since the reset, minus the RSS before the model); flashfsdp.estimate: "
            f"{report.format_bytes(expected)} for parameters, gradients, optimizer states and gathered units, "
            "activations not counted") in report.write_summary(str(tmp_path), summary)

