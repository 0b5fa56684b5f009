"""--activation-checkpointing: torch's non-reentrant checkpoint_wrapper around each block, applied
before sharding; each block's forward runs again in backward, and the losses equal the run
without it (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from flashfsdp.models import Block, Llama, LlamaConfig
from flashfsdp.train.activation_checkpointing import checkpoint_blocks
from tests.harness import run_distributed
from tests.train.trainers import corpus_text, make_trainer

STEPS = 3


def _losses(rank: int, world_size: int, root: str, corpus: str) -> dict:
    got = {}
    for name, flags in (("plain", []), ("checkpointed", ["--activation-checkpointing"])):
        trainer = make_trainer(["--data", corpus, "--steps", str(STEPS), "--out", f"{root}/{name}", *flags])
        calls = []
        blocks = [m for m in trainer.model.modules() if isinstance(m, Block)]
        for block in blocks:
            block.register_forward_pre_hook(lambda *_: calls.append(1))
        losses = [trainer.train_step()[0]["train_loss"] for _ in range(STEPS)]
        wrapped = sum(isinstance(m, CheckpointWrapper) for m in trainer.model.modules())
        got[name] = {"losses": losses, "block_forwards": len(calls) / STEPS / len(blocks), "wrapped": wrapped}
    return got


def test_checkpointed_blocks_recompute_and_train_to_the_same_losses(tmp_path):
    corpus = tmp_path / "corpus.py"
    corpus.write_text(corpus_text())
    for got in run_distributed(_losses, 2, str(tmp_path), str(corpus), timeout=240):
        plain, checkpointed = got["plain"], got["checkpointed"]
        assert plain["wrapped"] == 0 and checkpointed["wrapped"] == 2
        assert plain["block_forwards"] == 1 and checkpointed["block_forwards"] == 2  # recomputed in backward
        torch.testing.assert_close(checkpointed["losses"], plain["losses"], rtol=1e-5, atol=1e-5)


def test_a_model_without_blocks_is_refused():
    with pytest.raises(ValueError, match="activation checkpointing: Linear holds no Block"):
        checkpoint_blocks(torch.nn.Linear(2, 2))


def test_wrapping_keeps_the_parameters_and_the_forward():
    model = Llama(LlamaConfig(dim=32, n_layers=2, n_heads=2, max_seq_len=8))
    model.init_weights(0)
    tokens = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    before = model(tokens)
    assert checkpoint_blocks(model) == 2 and all(isinstance(b, CheckpointWrapper) for b in model.layers)
    assert set(model.state_dict()) == set(Llama(model.config).state_dict())  # the wrapper's prefix dropped
    torch.testing.assert_close(model(tokens), before)


def test_the_memory_check_counts_one_block_of_activations_when_checkpointed(tmp_path):
    from flashfsdp.train.checks import ACTIVATION_ELEMENTS_PER_TOKEN_PER_DIM as ELEMENTS  # noqa: PLC0415
    from flashfsdp.train.checks import rank_bytes_needed  # noqa: PLC0415
    from flashfsdp.train.config import TrainConfig  # noqa: PLC0415

    args = ["--preset", "small", "--device", "cpu", "--out", str(tmp_path)]
    plain = TrainConfig.from_argv(args)
    checkpointed = TrainConfig.from_argv(args + ["--activation-checkpointing"])
    cfg, tokens = plain.llama, plain.training.batch_size // 2 * plain.llama.max_seq_len  # W = 2, 4-byte fp32
    per_layer = tokens * cfg.dim * ELEMENTS * 4
    saved = (cfg.n_layers - 1) * per_layer - tokens * cfg.n_layers * cfg.dim * 4
    assert rank_bytes_needed(plain, 2) - rank_bytes_needed(checkpointed, 2) == saved > 0
