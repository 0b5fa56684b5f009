"""What save and load share: the state DCP writes and reads, DCP's errors in words, one-rank runs."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from flashfsdp.bindings import get_optimizer_state_dict


def check_model_optimizer(model: Any, optimizer: Any, where: str) -> None:
    """TypeError naming the argument unless ``model`` is an nn.Module and ``optimizer`` an Optimizer or None."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{where}: optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")


def dcp_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What DCP saves and loads: the sharded model state dict and the sharded optimizer state."""
    state: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


@contextlib.contextmanager
def single_process_quiet():
    """Silence DCP's warning that it runs in a single process: W = 1 without a process group is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def failures(exc: CheckpointException) -> str:
    """"rank: ExceptionType: message" of every rank that failed inside DCP."""
    return "; ".join(f"{rank}: {type(err[0]).__name__}: {err[0]}" for rank, err in sorted(exc.failures.items()))


def short(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 200 characters) of an exception."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}".rstrip(": ")
