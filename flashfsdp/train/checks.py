"""Checks `flashfsdp-train` runs before it starts any worker or writes anything.

Each check raises `UsageError` with a one-line message naming the problem and the fix, so that
bad input costs no worker start-up, no traceback and no partial run directory.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

import torch

from flashfsdp.models import LlamaConfig
from flashfsdp_cli.train_sections import check_reduce_quantization
from flashfsdp.train.checkpoints import checkpoints_dir, latest_checkpoint
from flashfsdp.train.config import TrainConfig, UsageError
from flashfsdp.train.data import Corpus, CorpusError, ShardedBatchSampler, load_corpus
from flashfsdp.train.freezing import check_freeze
from flashfsdp.train.launch import under_torchrun
from flashfsdp.train.pretrained import check_weights
from flashfsdp.train.tokenizer import load_tokenizer

GiB = 2**30
# fp32 master weight + fp32 gradient + AdamW's two fp32 moments, per parameter.
STATE_BYTES_PER_PARAM = 16
# Activation bytes kept for backward per token, per layer, per unit of width and per byte of the
# compute dtype: about 34·s·b·h bytes per layer at 16 bits (Korthikanti et al. 2022, "Reducing
# Activation Recomputation in Large Transformer Models", without the attention-score term that
# a fused attention kernel does not store).
ACTIVATION_ELEMENTS_PER_TOKEN_PER_DIM = 17
# Memory a check may plan to use: the rest is left to the allocator, the runtime and the OS.
USABLE_FRACTION = 0.9
# Host memory of one worker process before its model: the interpreter, torch, flashfsdp and the
# process group. Measured as the resident set (VmRSS) of a process after importing torch and
# flashfsdp.train.trainer and joining a 2-rank gloo group: 343 MiB with torch 2.13.0+cpu on
# x86-64 Linux (`python -m benchmarks.soak` measures it again, as `process_overhead`); rounded
# up to cover the allocator's slack. The worker's copy of the corpus comes on top.
PROCESS_OVERHEAD_BYTES = 384 * 2**20


def check_nproc(nproc: int | None, device_type: str) -> int:
    """The number of local workers to start: --nproc, or 2 on CPU / every GPU on CUDA.

    Raises:
        UsageError: --nproc < 1, or more workers than GPUs with --device cuda.
    """
    gpus = torch.cuda.device_count() if device_type == "cuda" else 0
    if nproc is None:
        return gpus if device_type == "cuda" else 2
    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1, got {nproc}")
    if device_type == "cuda" and nproc > gpus:
        raise UsageError(
            f"--nproc {nproc} is more than the {gpus} CUDA device(s) present (one GPU per rank); "
            f"use --nproc {gpus} or fewer, or --device cpu"
        )
    return nproc


def check_batch(batch_size: int, grad_accum: int, world_size: int) -> None:
    """The global batch must split evenly over ranks and micro-batches.

    Args:
        batch_size: global batch in sequences (--batch-size).
        grad_accum: micro-batches per step (--grad-accum).
        world_size: number of data-parallel ranks (W / --tp: the ranks of one TP group share rows).

    Raises:
        UsageError: --batch-size not a multiple of world_size · --grad-accum.
    """
    parts = world_size * grad_accum
    if batch_size % parts:
        raise UsageError(
            f"--batch-size {batch_size} does not split over {world_size} rank(s) x "
            f"--grad-accum {grad_accum}; use a multiple of {parts}"
        )


def check_tp(tp: int, world_size: int) -> int:
    """--tp must divide the world size; returns the data-parallel size W / tp.

    Raises:
        UsageError: `world_size` not a multiple of `tp` (names --tp and the divisors).
    """
    if world_size % tp:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        raise UsageError(f"--tp {tp} does not divide the {world_size} rank(s); give one of {divisors} "
                         f"(or a --nproc that is a multiple of {tp})")
    return world_size // tp


def check_reshard_after_forward(value: bool | int | None, world_size: int) -> None:
    """--reshard-after-forward N must be a number of ranks that divides the world size (as
    `fully_shard` takes it: 1 keeps the unsharded parameters, W reshards fully, 1 < N < W keeps a
    copy sharded over groups of N ranks); True, False and None (the default) always pass.

    Raises:
        UsageError: an N < 1, or one that does not divide `world_size` (names the divisors).
    """
    if value is None or isinstance(value, bool):
        return
    if value < 1 or world_size % value:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        raise UsageError(f"--reshard-after-forward {value} does not divide the {world_size} rank(s); give "
                         f"one of {divisors}, or true, false or default")


def check_data(path: str | None, seed: int, seq_len: int, batch_size: int,
               world_size: int, tokenizer: str | None = None) -> Corpus:
    """Load the corpus and check that both splits hold a global batch of windows.

    Args:
        path: --data (a text file or directory), or None for the standard library.
        seed: the split and data-order seed (--seed).
        seq_len: training sequence length in bytes.
        batch_size: global batch in sequences (--batch-size).
        world_size: number of ranks.
        tokenizer: --tokenizer (a tokenizer.json), or None for UTF-8 bytes.

    Returns:
        The loaded corpus.

    Raises:
        UsageError: missing --data path, empty corpus, or too little text for the batch.
    """
    try:
        corpus = load_corpus(path, seed=seed, tokenizer=load_tokenizer(tokenizer))
        for split, data in (("training", corpus.train), ("validation", corpus.val)):
            try:
                ShardedBatchSampler(data.numel(), seq_len, batch_size, world_size)
            except CorpusError as err:
                raise CorpusError(f"{split} split of {corpus.source}: {err}") from None
    except CorpusError as err:
        raise UsageError(str(err)) from None
    return corpus


def available_memory(device_type: str) -> int:
    """Bytes one rank may use: free host memory (cgroup limit included) on CPU, or the smallest
    GPU's total memory on CUDA."""
    if device_type == "cuda":
        return min(torch.cuda.get_device_properties(i).total_memory
                   for i in range(torch.cuda.device_count()))
    return host_available_memory()


def host_available_memory() -> int:
    """Bytes of host memory free for new processes: `MemAvailable`, within the cgroup v2 limit."""
    available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:  # cgroup v2 container limit
        with open("/sys/fs/cgroup/memory.max") as fh:
            limit = fh.read().strip()
        with open("/sys/fs/cgroup/memory.current") as fh:
            used = int(fh.read())
        if limit != "max":
            available = min(available, int(limit) - used)
    except (OSError, ValueError):
        pass
    return available


def estimate_bytes_per_rank(cfg: LlamaConfig, world_size: int, micro_batch: int, seq_len: int,
                            param_bytes: int, activation_checkpointing: bool = False) -> int:
    """A rough peak-memory estimate of one rank, in bytes.

    The larger of: initialisation, where the model is built on the meta device and each rank
    materialises only its shards while `init_weights` draws one full fp32 parameter at a time
    (plus a full temporary of it: 8 bytes per element of the largest parameter), and training:
    16·P/W of sharded state, two blocks' unsharded parameters and gradients in the compute dtype
    (the current and the prefetched unit), activations, and the logits with their fp32 copies.
    With activation checkpointing each block keeps only its input (s·b·h elements) and one block's
    activations exist at a time, while it is recomputed (Korthikanti et al. 2022, full
    recomputation).

    Args:
        cfg: the model's shape (P = `cfg.num_params()`).
        world_size: number of ranks W.
        micro_batch: sequences per micro-batch on one rank.
        seq_len: tokens per sequence.
        param_bytes: bytes per element of the compute dtype (2 for bf16, 4 for fp32).
        activation_checkpointing: the blocks recompute their activations in backward.
    """
    params = cfg.num_params()
    block = 4 * cfg.dim * cfg.dim + 3 * cfg.dim * cfg.ffn_dim
    largest = max(cfg.vocab_size * cfg.dim, cfg.dim * cfg.ffn_dim, cfg.dim * cfg.dim)
    tokens = micro_batch * seq_len
    state = STATE_BYTES_PER_PARAM * params // world_size
    gathered = 2 * 2 * block * param_bytes
    per_layer = tokens * cfg.dim * ACTIVATION_ELEMENTS_PER_TOKEN_PER_DIM * param_bytes
    if activation_checkpointing:
        activations = tokens * cfg.n_layers * cfg.dim * param_bytes + per_layer
    else:
        activations = cfg.n_layers * per_layer
    logits = tokens * cfg.vocab_size * (param_bytes + 8)
    return max(4 * params // world_size + 8 * largest, state + gathered + activations + logits)


def rank_bytes_needed(config: TrainConfig, world_size: int) -> int:
    """`estimate_bytes_per_rank` of the run: its model, micro-batch, sequence, compute dtype and
    activation checkpointing."""
    cfg, training = config.llama, config.training
    micro_batch = training.batch_size // (world_size * training.grad_accum)
    return estimate_bytes_per_rank(cfg, world_size, micro_batch, cfg.max_seq_len, config.precision.compute_bytes,
                                   training.activation_checkpointing)


def host_bytes_needed(config: TrainConfig, world_size: int, local_world: int,
                      corpus_bytes: int = 0, running: bool = False) -> int:
    """Host memory the `local_world` ranks on this host still need together, in bytes: each
    rank's process (`PROCESS_OVERHEAD_BYTES` plus its copy of the corpus) unless the processes
    are `running` already (then that memory is no longer free) and, on CPU, its
    `rank_bytes_needed` (on CUDA that is on the rank's GPU).

    Args:
        config: the run's config.
        world_size: number of ranks.
        local_world: ranks on this host.
        corpus_bytes: bytes of the corpus each rank loads (training and validation text).
        running: the ranks' processes exist (the check runs in a worker).
    """
    per_rank = 0 if running else PROCESS_OVERHEAD_BYTES + corpus_bytes
    if config.run.device == "cpu":
        per_rank += rank_bytes_needed(config, world_size)
    return local_world * per_rank


def check_fit(config: TrainConfig, world_size: int, local_world: int, corpus_bytes: int = 0) -> None:
    """Refuse a run that cannot fit: the local ranks' processes (unless they run already: the
    check runs in a worker), and on CPU their models, in the host's free memory
    (`host_bytes_needed`); on CUDA each rank's model on its GPU.

    Args:
        config: the run's config (model, batch, micro-batches, compute dtype, device).
        world_size: number of ranks.
        local_world: ranks on this host.
        corpus_bytes: bytes of the corpus each rank loads.

    Raises:
        UsageError: an estimate exceeds `USABLE_FRACTION` of the available memory; the message
            gives the figures and suggests fewer local ranks, a smaller model or batch, or more
            ranks on CUDA.
    """
    size = f"{config.model_flags} ({config.llama.num_params() / 1e6:.0f}M parameters)"
    need, host_need = rank_bytes_needed(config, world_size), host_bytes_needed(
        config, world_size, local_world, corpus_bytes, running=under_torchrun())
    host = host_available_memory()
    process = (PROCESS_OVERHEAD_BYTES + corpus_bytes) / GiB
    if host_need > USABLE_FRACTION * host:
        model = f"{need / GiB:.1f} GiB for the model and " if config.run.device == "cpu" else ""
        raise UsageError(
            f"{size} needs about {host_need / GiB:.1f} GiB on this host for {local_world} rank(s) "
            f"({model}{process:.1f} GiB for the process and its data, per rank) but "
            f"{host / GiB:.1f} GiB is free; use a smaller --nproc, --preset, --batch-size or "
            "--seq-len, or a machine with more memory"
        )
    have = available_memory(config.run.device)
    if config.run.device == "cuda" and need > USABLE_FRACTION * have:
        raise UsageError(
            f"{size} needs about {need / GiB:.1f} GiB per GPU at {world_size} rank(s) but a GPU "
            f"has {have / GiB:.1f} GiB; use more ranks (--nproc, or torchrun over more nodes), "
            "a smaller --batch-size (or more --grad-accum), or a smaller --preset"
        )


def check_writable(out: str) -> None:
    """--out must be a directory this process can write in, or one it can create.

    Finds the nearest existing directory of `out` (itself or an ancestor) and creates and drops
    an unnamed temporary file there, so a read-only file system is caught as well as missing
    permissions (which root bypasses); nothing is left behind.

    Raises:
        UsageError: `out` or an ancestor is not a directory, or no file can be created there.
    """
    existing = out
    while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"--out {out}: {existing} exists and is not a directory; choose another --out")
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as err:
        raise UsageError(f"--out {out}: cannot write in {existing} ({err.strerror or err}); "
                         "choose a writable --out") from None


def check_out(out: str, resume: bool) -> str | None:
    """The checkpoint to resume from (None for a fresh run), after `check_writable(out)`.

    Args:
        out: the run directory (--out).
        resume: --resume was given.

    Raises:
        UsageError: --out not writable; --resume with no checkpoint in --out, or a fresh run
            whose --out already holds checkpoints (it would mix two runs).
    """
    check_writable(out)
    found = latest_checkpoint(out)
    if resume and found is None:
        raise UsageError(
            f"--resume: no checkpoint in {checkpoints_dir(out)}; start without --resume, or point "
            "--out at the directory of a run that saved one"
        )
    if not resume and found is not None:
        raise UsageError(
            f"--out {out} already holds checkpoints; add --resume to continue that run, or "
            "choose another --out"
        )
    return found


def check_not_finished(resume_from: str | None, steps: int) -> None:
    """--resume must have steps left: the checkpoint `resume_from` (`<out>/checkpoints/step_<N>`)
    is at step N < --steps.

    Raises:
        UsageError: N ≥ steps ("already at step N; pass --steps > N").
    """
    if resume_from is None:
        return
    done = int(os.path.basename(resume_from).rpartition("_")[2])
    if done >= steps:
        raise UsageError(f"--resume: the run is already at step {done}; pass --steps > {done} "
                         "to train on")


@dataclasses.dataclass(frozen=True)
class Inputs:
    """What the checks found: the loaded corpus and the checkpoint to resume from (or None)."""

    corpus: Corpus
    resume_from: str | None


def validate(config: TrainConfig, world_size: int, local_world: int) -> Inputs:
    """All the checks that need no process group, in order: --tp, batch split over the W / tp
    data-parallel ranks, resharding group size, --ranks-per-node,
    run directory, data, memory fit (the corpus each rank loads included), --freeze patterns,
    --init-from weights, --compile.

    Args:
        config: the run's config.
        world_size: number of ranks of the job.
        local_world: ranks on this host.

    Raises:
        UsageError: the first check that fails.
    """
    training, out, resume = config.training, config.run.out, config.checkpoint.resume
    dp = check_tp(config.sharding.tp, world_size)  # the batch splits over the data-parallel ranks
    check_batch(training.batch_size, training.grad_accum, dp)
    check_reshard_after_forward(config.sharding.reshard_after_forward, dp)
    check_reduce_quantization(config.sharding.reduce_quantization, config.sharding.ranks_per_node, dp)
    resume_from = check_out(out, resume)
    check_not_finished(resume_from, training.steps)
    corpus = check_data(config.data.path, training.seed, config.llama.max_seq_len, training.batch_size,
                        dp, config.data.tokenizer)
    check_fit(config, world_size, local_world, corpus.train.numel() + corpus.val.numel())
    check_freeze(config.model.freeze, config.llama)
    if config.model.init_from is not None and not resume:
        check_weights(config.model.init_from, config.llama)  # headers and shapes (read unit by unit later)
    if training.compile:
        from flashfsdp.train.sharding import check_compile  # noqa: PLC0415 - only for --compile

        check_compile(config.run.device)
    return Inputs(corpus, resume_from)
