"""Building `flashfsdp.train.trainer.Trainer`s in the ranks of a multi-rank test, from a command line."""

from __future__ import annotations

import torch

# A model and batch small enough for a few steps per test on 2 CPU ranks.
TINY = ["--layers", "2", "--dim", "32", "--heads", "2", "--seq-len", "16", "--batch-size", "4",
        "--eval-batches", "1", "--sample-tokens", "0", "--param-dtype", "fp32"]


def corpus_text() -> str:
    """A few kB of Python-like text: enough windows for several epochs of small batches."""
    return "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(200))


def make_trainer(argv: list[str], resume_from: str | None = None):
    """A `Trainer` of this rank for `TINY` + `argv` (`--data`, `--out`, `--steps` among them),
    resumed from the checkpoint `resume_from` if given (the process group is initialised)."""
    from flashfsdp.train.config import TrainConfig  # noqa: PLC0415
    from flashfsdp.train.data import load_corpus  # noqa: PLC0415
    from flashfsdp.train.tokenizer import load_tokenizer  # noqa: PLC0415
    from flashfsdp.train.trainer import Trainer  # noqa: PLC0415

    config = TrainConfig.from_argv([*TINY, *argv] + (["--resume"] if resume_from else []), warn=False)
    rank, world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()
    corpus = load_corpus(config.data.path, seed=config.training.seed, tokenizer=load_tokenizer(config.data.tokenizer))
    return Trainer(config, corpus, rank, world_size, torch.device("cpu"), resume_from=resume_from)
