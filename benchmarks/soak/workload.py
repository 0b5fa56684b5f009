"""The training the soak and fault benchmarks run on each rank, and what they measure of a process.

A tiny Llama (``flashfsdp.models``), one flashfsdp unit per block plus the root, AdamW, a random
byte batch per step: big enough to run every phase of a sharded step (all-gather, reduce-scatter,
the optimizer on the shards), small enough for 1000 steps on a shared CPU in well under a minute.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn

# The tiny model: width, blocks, heads, sequence length (bytes), sequences per rank per step.
DIM, LAYERS, HEADS, SEQ, BATCH = 32, 2, 2, 16, 2


@dataclass
class Job:
    """One rank's model, optimizer and batch generator (see `build`)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    generator: torch.Generator


def build(rank: int, seed: int = 0) -> Job:
    """The tiny model, fully_shard'ed (one unit per block, then the root) over the default
    process group (none needed at W = 1), and its AdamW; rank r draws batches from seed
    ``1000 + r``."""
    import flashfsdp  # noqa: PLC0415
    from flashfsdp.models import Llama, LlamaConfig  # noqa: PLC0415

    model = Llama(LlamaConfig(dim=DIM, n_layers=LAYERS, n_heads=HEADS, max_seq_len=SEQ))
    model.init_weights(seed)
    for block in model.layers:
        flashfsdp.fully_shard(block)
    flashfsdp.fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return Job(model, optimizer, torch.Generator().manual_seed(1000 + rank))


def train_step(job: Job) -> float:
    """One step: forward, next-byte cross-entropy, backward, AdamW; returns the local loss."""
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=job.generator)
    logits = job.model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    job.optimizer.step()
    job.optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def process_stats() -> dict[str, float]:
    """This process now (Linux /proc): ``rss_MiB`` (VmRSS, resident memory), ``threads`` (its
    tasks) and ``fds`` (open file descriptors)."""
    rss_kib = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss_kib = int(line.split()[1])
    return {"rss_MiB": rss_kib / 1024, "threads": len(os.listdir("/proc/self/task")),
            "fds": len(os.listdir("/proc/self/fd"))}
