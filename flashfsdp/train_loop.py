"""One worker (rank) of `flashfsdp-train`: the sharded training loop.

Every rank builds the same model from the same seed, shards it (one unit per block plus the
root), and steps AdamW on its shards; rank r trains on rows [r·B/W, (r+1)·B/W) of each global
batch (`flashfsdp.data.ShardedBatchSampler`). The learning rate is a pure function of the step
(`flashfsdp.lr_schedule.lr_at`), so a checkpoint plus the step number restores data order and
schedule at any world size.

[Note: interrupts] Started by torch's elastic agent (ours or a user's torchrun), workers run in
their own session: a Ctrl-C reaches only the agent, which forwards SIGINT to each worker once
and kills them after its shutdown timeout. A KeyboardInterrupt raised at an arbitrary point
would leave the ranks at different collectives, so each worker's SIGINT handler only sets a
flag; at the end of each step the ranks all-reduce their flags together with the loss, so
all of them stop after the same step and save the final checkpoint collectively.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from flashfsdp import train_report
from flashfsdp.data import Corpus, ShardedBatchSampler, load_corpus, unigram_entropy
from flashfsdp.lr_schedule import lr_at
from flashfsdp.models import Llama
from flashfsdp.train_args import model_config, save_run_config
from flashfsdp.train_sharding import (clip_grad_norm, latest_checkpoint, load_checkpoint,
                                      save_checkpoint, shard_model)

SAMPLE_COUNT = 3
SAMPLE_TEMPERATURE = 0.8
# Seed offset of the validation windows: fixed, so every evaluation scores the same windows.
VAL_SEED_OFFSET = 1


class _StopFlag:
    """Set by SIGINT (see [Note: interrupts]); read at step boundaries."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def restore(self) -> None:
        signal.signal(signal.SIGINT, self._previous)


def _init_distributed(device_type: str) -> tuple[int, int, torch.device]:
    """Join the process group torchrun/elastic set up in the environment (gloo on CPU, NCCL on
    CUDA). Returns (rank, world_size, device)."""
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
        if "OMP_NUM_THREADS" not in os.environ:
            local_world = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // local_world))
    return dist.get_rank(), dist.get_world_size(), device


def _build_optimizer(model: torch.nn.Module, no_decay: set[str], args) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (RMSNorm weights, named in `no_decay`, excluded)."""
    decay = [p for n, p in model.named_parameters() if n not in no_decay]
    rest = [p for n, p in model.named_parameters() if n in no_decay]
    groups = [{"params": decay, "weight_decay": args.weight_decay},
              {"params": rest, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy (nats) of int64 (b, T) inputs x and targets y."""
    logits = model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def _train_step(model, optimizer, x, y, micro: int, args, device) -> tuple[torch.Tensor, float]:
    """One optimizer step on this rank's rows x, y (int64 (local_batch, T)) in micro-batches of
    `micro` rows; gradients are reduced only after the last one. Returns (this rank's mean loss
    as a 0-dim tensor, global gradient norm before clipping)."""
    loss_sum = torch.zeros((), device=device)
    for i, (xs, ys) in enumerate(zip(x.split(micro), y.split(micro))):
        model.set_requires_gradient_sync(i == args.grad_accum - 1)
        loss = _loss(model, xs.to(device), ys.to(device)) / args.grad_accum
        loss.backward()
        loss_sum += loss.detach()
    grad_norm = clip_grad_norm(model, args.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm


@torch.no_grad()
def evaluate(model, data, sampler: ShardedBatchSampler, n_batches: int, micro: int,
             device) -> float:
    """Mean validation loss (nats/byte) over the same `n_batches` global batches, all ranks."""
    total = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of row losses, rows)
    for step in range(n_batches):
        x, y = sampler.batch(data, step)
        for xs, ys in zip(x.split(micro), y.split(micro)):
            total[0] += _loss(model, xs.to(device), ys.to(device)).double() * xs.shape[0]
            total[1] += xs.shape[0]
    dist.all_reduce(total)
    return float(total[0] / total[1])


def _samples(model: Llama, prompt: str, tokens: int, seed: int, device) -> list[str]:
    """SAMPLE_COUNT continuations of `prompt` (collective: every rank runs the same forwards)."""
    ids = list(prompt.encode("utf-8")) or [ord("\n")]
    start = torch.tensor([ids] * SAMPLE_COUNT, dtype=torch.long, device=device)
    gen = torch.Generator().manual_seed(seed)
    out = model.generate(start, tokens, temperature=SAMPLE_TEMPERATURE, generator=gen)
    return [bytes(row.tolist()).decode("utf-8", errors="replace") for row in out.cpu()]


def run_worker(args: argparse.Namespace, device_type: str, corpus: Corpus | None = None) -> int:
    """Train as one rank of the job torchrun/elastic started; returns the process exit code.

    Args:
        args: resolved options (`flashfsdp.train_args.resolve`).
        device_type: "cpu" or "cuda".
        corpus: the corpus if already loaded (by the checks), else it is loaded here.
    """
    rank, world, device = _init_distributed(device_type)
    stop = _StopFlag()
    if corpus is None:
        corpus = load_corpus(args.data, seed=args.seed)
    try:
        return _train(args, corpus, rank, world, device, stop)
    finally:
        stop.restore()
        dist.destroy_process_group()


def _train(args, corpus: Corpus, rank: int, world: int, device: torch.device,
           stop: _StopFlag) -> int:
    t_start = time.perf_counter()
    cfg = model_config(args)
    seq_len = cfg.max_seq_len
    unigram = unigram_entropy(corpus.train)
    train_sampler = ShardedBatchSampler(corpus.train.numel(), seq_len, args.batch_size, world,
                                        rank, args.seed)
    val_sampler = ShardedBatchSampler(corpus.val.numel(), seq_len, args.batch_size, world, rank,
                                      args.seed + VAL_SEED_OFFSET)
    micro = train_sampler.local_batch // args.grad_accum

    model = Llama(cfg).to(device)
    model.init_weights(args.seed)
    no_decay = {n for n, p in model.named_parameters() if p.dim() < 2}
    shard_model(model, args)
    optimizer = _build_optimizer(model, no_decay, args)

    start_step, saved = 0, {}
    if args.resume:
        path = latest_checkpoint(args.out)
        state = load_checkpoint(path, model, optimizer)
        start_step, saved = state["step"], state.get("extra") or {}
    elif rank == 0:
        save_run_config(args)
        train_report.reset(args.out)
    dist.barrier()

    progress = train_report.Progress(args.out, args.steps, start_step, enabled=rank == 0)
    progress.write(f"flashfsdp-train: {cfg.num_params() / 1e6:.2f}M parameters, {world} rank(s) "
                   f"on {device.type}, corpus {corpus.source}: {corpus.train.numel() / 1e6:.1f} MB "
                   f"train ({corpus.train_files} files), {corpus.val.numel() / 1e6:.2f} MB val "
                   f"({corpus.val_files} files), unigram baseline {unigram:.3f} nats/byte")
    val_loss = evaluate(model, corpus.val, val_sampler, args.eval_batches, micro, device)
    if args.resume:
        progress.write(f"resumed from step {start_step} of {args.out}: val loss {val_loss:.4f} "
                       f"(saved: val {saved.get('val_loss')}, train {saved.get('train_loss')})")
    progress.validation(start_step, val_loss, resumed=bool(args.resume), world_size=world)

    step, train_loss, val_step = start_step, saved.get("train_loss"), start_step
    last_saved = start_step if args.resume else None
    interrupted = False
    tokens_per_step = args.batch_size * seq_len
    step_times = []
    try:
        while step < args.steps:
            t0 = time.perf_counter()
            lr = lr_at(step, args.lr, args.warmup, args.decay_steps, args.min_lr)
            for group in optimizer.param_groups:
                group["lr"] = lr
            x, y = train_sampler.batch(corpus.train, step)
            loss_sum, grad_norm = _train_step(model, optimizer, x, y, micro, args, device)
            stats = torch.stack((loss_sum.float(), torch.tensor(float(stop.requested), device=device)))
            dist.all_reduce(stats)  # mean loss for the bar, and the stop flags of all ranks
            step += 1
            train_loss = float(stats[0]) / world
            dt = time.perf_counter() - t0
            step_times.append(dt)
            progress.step({"step": step, "train_loss": train_loss, "lr": lr, "grad_norm": grad_norm,
                           "step_ms": 1000 * dt, "tokens_per_s": tokens_per_step / dt,
                           "world_size": world}, device)
            if step % args.eval_every == 0 or step == args.steps:
                val_loss = evaluate(model, corpus.val, val_sampler, args.eval_batches, micro, device)
                val_step = step
                progress.validation(step, val_loss)
            interrupted = float(stats[1]) > 0
            if interrupted:
                progress.write(f"interrupted: saving a checkpoint at step {step}")
                break
            if step % args.save_every == 0 and step < args.steps:
                _save(args, model, optimizer, step, train_loss, val_loss, val_step, world, rank)
                last_saved = step
    finally:
        progress.close()

    if val_step != step:
        val_loss = evaluate(model, corpus.val, val_sampler, args.eval_batches, micro, device)
        val_step = step
        progress.validation(step, val_loss)
    if last_saved != step:
        path = _save(args, model, optimizer, step, train_loss, val_loss, val_step, world, rank)
        if rank == 0:
            print(f"flashfsdp-train: checkpoint {path}", flush=True)
    if interrupted:
        return 130  # interrupted (128 + SIGINT), after saving

    samples = (_samples(model, args.prompt, args.sample_tokens, args.seed, device)
               if args.sample_tokens > 0 else [])
    if rank == 0:
        timed = step_times[1:] or step_times  # the first step includes warm-up costs
        summary = {
            "params": cfg.num_params(), "world_size": world, "device": device.type,
            "start_step": start_step, "step": step, "train_loss": train_loss,
            "val_loss": val_loss, "unigram_baseline": unigram,
            "tokens_per_s": tokens_per_step * len(timed) / sum(timed) if timed else 0.0,
            "wall_s": time.perf_counter() - t_start,
            "peak_memory_bytes": train_report.memory_bytes(device),
        }
        print(train_report.write_summary(args.out, summary), flush=True)
        train_report.plot_losses(args.out, unigram)
        if samples:
            print(train_report.write_samples(args.out, args.prompt, samples), flush=True)
    return 0


def _save(args, model, optimizer, step, train_loss, val_loss, val_step, world, rank) -> str:
    """Checkpoint after `step` steps with the losses and data/schedule state in `extra`."""
    extra = {"train_loss": train_loss, "val_loss": val_loss if val_step == step else None,
             "lr": lr_at(max(step - 1, 0), args.lr, args.warmup, args.decay_steps, args.min_lr),
             "world_size": world, "seed": args.seed, "batch_size": args.batch_size,
             "next_step": step}
    return save_checkpoint(args.out, model, optimizer, step, extra, args.keep_checkpoints, rank)
