"""Everything `flashfsdp.train` asks of the flashfsdp runtime: sharding, clipping, checkpoints.

The calls are those of PyTorch FSDP2 (`torch.distributed.fsdp.fully_shard`,
`MixedPrecisionPolicy`, `FSDPModule.set_requires_gradient_sync`) imported from `flashfsdp`,
plus `flashfsdp.clip_grad_norm_` and `flashfsdp.checkpoint.{save,load,latest}`.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil

import torch
from torch import nn

from flashfsdp import MixedPrecisionPolicy, checkpoint, clip_grad_norm_, fully_shard
from flashfsdp.models import Llama

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
_STEP_DIR = re.compile(r"^step_(\d+)$")


def shard_model(model: Llama, args: argparse.Namespace) -> Llama:
    """Shard `model` in place: one flashfsdp unit per `Block`, then the root unit (embeddings,
    final norm, tied output), all with `MixedPrecisionPolicy(param_dtype, reduce_dtype)`.

    Args:
        model: an unsharded `Llama` on this rank's device, identical on every rank.
        args: the resolved options (`param_dtype`, `reduce_dtype` as "bf16" or "fp32").

    Returns:
        `model`, now also an `FSDPModule`.
    """
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[args.param_dtype],
                                  reduce_dtype=DTYPES[args.reduce_dtype])
    for block in model.layers:
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip the sharded gradients to a global 2-norm of `max_norm` (0: only measure it).

    Returns:
        The global gradient norm before clipping, as a float.
    """
    norm = clip_grad_norm_(model, max_norm if max_norm > 0 else float("inf"))
    return float(norm)


def checkpoint_dir(out: str, step: int) -> str:
    """`<out>/checkpoints/step_<step>`: where the checkpoint after `step` steps goes."""
    return os.path.join(out, "checkpoints", f"step_{step}")


def latest_checkpoint(out: str) -> str | None:
    """The newest complete checkpoint of the run in `out`, or None."""
    directory = os.path.join(out, "checkpoints")
    return checkpoint.latest(directory) if os.path.isdir(directory) else None


def save_checkpoint(out: str, model: nn.Module, optimizer: torch.optim.Optimizer, step: int,
                    extra: dict, keep: int, rank: int) -> str:
    """Save collectively (every rank calls it) into `checkpoint_dir(out, step)`.

    Then rank 0 deletes all but the `keep` newest `step_<N>` directories (keep ≤ 0: keep all).
    `flashfsdp.checkpoint.save` writes atomically, so an interrupted save leaves no partial
    checkpoint behind.

    Returns:
        The checkpoint's path.
    """
    path = checkpoint_dir(out, step)
    checkpoint.save(path, model, optimizer, step=step, extra=extra)
    if rank == 0 and keep > 0:
        parent = os.path.dirname(path)
        steps = sorted(int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(parent)) if m)
        for old in steps[:-keep]:
            shutil.rmtree(os.path.join(parent, f"step_{old}"), ignore_errors=True)
    return path


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load a checkpoint collectively, at any world size; returns {"step": int, "extra": dict}."""
    return checkpoint.load(path, model, optimizer)
