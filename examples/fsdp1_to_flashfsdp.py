"""Move an FSDP1 training script to flashfsdp: change the imports, keep the code.

Run it on 2 CPU ranks (gloo), or under ``torchrun --nproc-per-node N`` (NCCL where CUDA exists):

    python examples/fsdp1_to_flashfsdp.py
    torchrun --nproc-per-node 2 examples/fsdp1_to_flashfsdp.py

Everything below the imports is a stock FSDP1 script: auto-wrapping each block, mixed precision,
gradient accumulation with ``no_sync``, ``clip_grad_norm_`` on the root, and a full state dict
and optimizer state dict gathered to rank 0 under ``state_dict_type``.
"""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

# Was: from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision, ...
from flashfsdp.fsdp1 import FullOptimStateDictConfig, FullStateDictConfig, MixedPrecision, ShardingStrategy
from flashfsdp.fsdp1 import FullyShardedDataParallel as FSDP, StateDictType


class Block(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class Model(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, depth: int = 2):
        super().__init__()
        self.embed, self.blocks = nn.Embedding(vocab, dim), nn.Sequential(*[Block(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


def train(rank: int, world_size: int) -> None:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    torch.manual_seed(0)
    model = FSDP(
        Model(),
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        device_id=device,
        use_orig_params=True,
    )
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(rank)
    for step in range(10):
        for micro in range(2):  # gradient accumulation: communicate on the last micro-batch only
            tokens = torch.randint(0, 64, (8, 16), generator=gen).to(device)
            with model.no_sync() if micro == 0 else contextlib.nullcontext():
                logits = model(tokens[:, :-1]).float()
                loss = nn.functional.cross_entropy(logits.reshape(-1, 64), tokens[:, 1:].reshape(-1))
                loss.backward()
        norm = model.clip_grad_norm_(1.0)
        optim.step()
        optim.zero_grad()
        if rank == 0 and step % 3 == 0:
            print(f"step {step:2d}  loss {loss.item():.3f}  grad norm {norm.item():.3f}")
    on_rank0 = dict(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(**on_rank0),
                              FullOptimStateDictConfig(**on_rank0)):
        model_state = model.state_dict()  # the unwrapped model's keys, full tensors, on rank 0
        optim_state = FSDP.optim_state_dict(model, optim)
    if rank == 0:
        with tempfile.TemporaryDirectory() as tmp:  # a real script would keep it: here nothing is left behind
            path = os.path.join(tmp, "model.pt")
            torch.save({"model": model_state, "optim": optim_state}, path)
            print(f"saved {len(model_state)} tensors ({sum(v.numel() for v in model_state.values())} values) "
                  f"to {path}")


def _spawned(rank: int, world_size: int, init_file: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        train(rank, world_size)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        train(dist.get_rank(), dist.get_world_size())
        dist.destroy_process_group()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_spawned, args=(2, os.path.join(tmp, "store")), nprocs=2)
