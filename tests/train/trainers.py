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


def finished_run(config) -> str:
    """`config`'s run directory as the job leaves it after its last step, without training:
    run.json, and the checkpoint of step `config.training.steps` (the model as initialised, or
    as --init-from loaded it, with an AdamW state), saved by the job's own code at W = 1 on this
    process. Returns the checkpoint's path."""
    from flashfsdp.train.checkpoints import save_checkpoint  # noqa: PLC0415
    from flashfsdp.train.pretrained import load_pretrained  # noqa: PLC0415
    from flashfsdp.train.sharding import build_sharded_model  # noqa: PLC0415

    config.save()
    init_from = config.model.init_from
    model, _ = build_sharded_model(config.llama, torch.device("cpu"), config.precision.policy,
                                   seed=None if init_from else config.training.seed)
    if init_from:
        load_pretrained(model, init_from, config.llama)
    optimizer = torch.optim.AdamW(model.parameters())
    return save_checkpoint(config.run.out, model, optimizer, config.training.steps, {}, keep=1, rank=0)


def save_hf_llama(folder, tokenizer=None, edit=None, **fields):
    """A small transformers `LlamaForCausalLM` (4 blocks of width 32, untied, grouped-query; `fields`
    override its config) saved into `folder` with `tokenizer` (a `PreTrainedTokenizerFast`; the job's
    byte-level one by default), its weights changed by `edit(model)` first if given. Returns `folder`."""
    import transformers  # noqa: PLC0415

    from flashfsdp.train.hf_tokenizer import run_tokenizer  # noqa: PLC0415

    config = transformers.LlamaConfig(**{
        "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 16,
        "tie_word_embeddings": False, **fields})
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    if edit is not None:
        edit(model)
    model.save_pretrained(folder)
    (tokenizer or run_tokenizer(None, transformers)).save_pretrained(folder)
    return folder
