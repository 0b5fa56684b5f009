"""The pipeline-parallel estimate (``flashfsdp.estimate.pipeline``) and its command line: the
activations per block against autograd's saved tensors, the micro-batches in flight per schedule,
the bubble, the point-to-point bytes, the errors naming the flags, and the states of each
pipeline rank against a real (pp, dp) = (2, 2) run on gloo (W = 4)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from flashfsdp.estimate.__main__ import main
from flashfsdp.estimate.pipeline import (block_activation_bytes, bubble_fraction, estimate_pipeline, in_flight,
                                         stage_layers, stage_model)
from flashfsdp.models import LlamaConfig
from flashfsdp.models.llama import Block
from tests.harness import run_distributed

SMALL = LlamaConfig(dim=32, n_layers=4, n_heads=2, multiple_of=16, max_seq_len=8, vocab_size=64, tie_embeddings=False)
MICROBATCHES, MB_SIZE = 4, 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_block_activations_equal_the_tensors_autograd_saves(dtype, kv_heads):
    config = LlamaConfig(dim=64, n_layers=1, n_heads=4, n_kv_heads=kv_heads, multiple_of=16, max_seq_len=32)
    block = Block(config).to(dtype)
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(torch.randn(2, 32, 64, dtype=dtype, requires_grad=True))
    assert sum(saved.values()) == block_activation_bytes(config, 2, 32, dtype.itemsize)


def test_micro_batches_in_flight_follow_torchs_schedules():
    assert [in_flight("gpipe", 4, r, 8) for r in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", 4, r, 8) for r in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1f1b", 4, r, 2) for r in range(4)] == [2, 2, 2, 1]
    # torch's _get_warmup_ops: (v - 1) * (M // rounds) + 2 * (pp - 1 - r), plus the first steady forward
    assert [in_flight("interleaved1f1b", 4, r, 8, 2) for r in range(4)] == [11, 9, 7, 5]


def test_bubble_and_stage_split():
    assert bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 19)
    assert bubble_fraction(1, 8) == 0
    assert [list(r) for r in stage_layers(10, 4)] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]


def test_llama_8b_at_pp4_dp16():
    est = estimate_pipeline("8b", 64, pp=4, microbatches=8, seq_len=4096,
                            mp_policy=dataclasses.make_dataclass("P", [("param_dtype", object)])(torch.bfloat16))
    assert (est.pp, est.dp) == (4, 16)
    assert [len(r.layers) for r in est.ranks] == [8, 8, 8, 8]
    assert est.ranks[0].holds_embedding and est.ranks[3].holds_output
    # states: rank 0 holds the embedding (128256 x 4096), the middle ranks blocks alone
    assert est.ranks[0].fsdp.model_state_bytes > est.ranks[1].fsdp.model_state_bytes
    assert est.peak_rank.pp_rank == 0
    assert est.p2p_bytes_per_microbatch == 4096 * 4096 * 2
    assert est.p2p_bytes_per_step == 2 * 8 * 3 * 4096 * 4096 * 2


@pytest.mark.parametrize("argv, names", [
    (["--pp", "3", "--microbatches", "4"], ["--pp", "--world-size"]),
    (["--pp", "4"], ["--microbatches"]),
    (["--pp", "64", "--microbatches", "4"], ["--pp", "blocks"]),
    (["--pp", "4", "--microbatches", "4", "--virtual-stages", "2"], ["--virtual-stages", "--schedule"]),
    (["--pp", "4", "--microbatches", "0"], ["--microbatches"]),
    (["--pp", "2", "--microbatches", "5", "--schedule", "interleaved1f1b"], ["--microbatches"]),
])
def test_bad_pipeline_sizes_are_one_line_naming_the_flags(argv, names, capsys):
    assert main(["--preset", "8b", "--world-size", "64", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and all(n in err for n in names), err


def test_command_line_names_the_peak_stage(capsys):
    assert main(["--preset", "8b", "--world-size", "64", "--pp", "4", "--microbatches", "8", "--param-dtype", "bf16",
                 "--seq-len", "4096"]) == 0
    out = capsys.readouterr().out
    assert "peak set by: pp rank 0 (embedding + blocks 0-7)" in out
    assert "bubble: 27.3% of the step" in out


def _pipelined_states(rank: int, world_size: int) -> dict:
    """Rank ``rank`` of a (pp, dp) = (2, 2) mesh: its stage of SMALL fully_shard'ed over its dp
    ranks, two GPipe steps with AdamW; the bytes its units hold sharded and its optimizer state."""
    import flashfsdp  # noqa: PLC0415
    import torch.distributed.pipelining as pipelining  # noqa: PLC0415
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    from flashfsdp.runtime.param_tags import unit_of  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank = mesh["pp"].get_local_rank()
    torch.manual_seed(pp_rank)
    stage = stage_model(SMALL, 2, pp_rank == 0, pp_rank == 1, device="cpu")
    stage.init_weights(pp_rank)
    for block in stage.layers:
        flashfsdp.fully_shard(block, mesh=mesh["dp"])
    flashfsdp.fully_shard(stage, mesh=mesh["dp"])
    pipe_stage = pipelining.PipelineStage(stage, pp_rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    pipe = pipelining.ScheduleGPipe(pipe_stage, n_microbatches=MICROBATCHES,
                                    loss_fn=lambda out, target: out.float().logsumexp(-1).mean())
    optim = torch.optim.AdamW(stage.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(mesh["dp"].get_local_rank())
    for _ in range(2):
        tokens = torch.randint(0, SMALL.vocab_size, (MICROBATCHES * MB_SIZE, SMALL.max_seq_len), generator=gen)
        pipe.step(*((tokens,) if pp_rank == 0 else ()), **({"target": tokens} if pp_rank == 1 else {}))
        optim.step()
        optim.zero_grad(set_to_none=False)
    units = {id(unit_of(p)): unit_of(p) for p in stage.parameters()}.values()
    local = [getattr(t, "to_local", lambda t=t: t)() for s in optim.state.values() for t in s.values()
             if torch.is_tensor(t)]
    return {"pp_rank": pp_rank, "sharded": sum(u.memory_bytes()["sharded"] for u in units),
            "optimizer": sum(t.numel() * t.element_size() for t in local)}


def test_stage_states_equal_a_pipelined_run_at_pp2_dp2():
    est = estimate_pipeline(SMALL, 4, pp=2, microbatches=MICROBATCHES, schedule="gpipe",
                            microbatch_size=MB_SIZE)
    measured = run_distributed(_pipelined_states, 4)
    for r in est.ranks:
        mine = [m for m in measured if m["pp_rank"] == r.pp_rank]
        assert len(mine) == 2
        for m in mine:  # master + gradient shards: every dp rank holds the padded shard
            assert m["sharded"] == r.fsdp.master_bytes + r.fsdp.grad_bytes, (r.pp_rank, m)
        assert max(m["optimizer"] for m in mine) == r.fsdp.optimizer_bytes, (r.pp_rank, mine)
