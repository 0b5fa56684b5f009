"""--freeze PATTERN: partial fine-tuning, the parameters matching a pattern left out of training.

A frozen parameter gets `requires_grad_(False)` on the sharded model: flashfsdp leaves it out of
the reduce-scatter (no gradient is computed, packed or reduced for it) and `build_optimizer` out
of AdamW (no moments). What that saves per rank, in fp32 master precision, is the gradient shard
and AdamW's two moments: 12 bytes per frozen parameter / W, plus the unsharded gradient of a unit
in backward. The patterns are `fnmatch` globs (case-sensitive) matched against each parameter's
name in the job's model (`layers.0.attention.wq.weight`) and its transformers name
(`model.layers.0.self_attn.q_proj.weight`), so `'*embed*'` or `'layers.[0-3].*'` work either way.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Sequence

import torch
from torch import nn

from flashfsdp.models import Llama, LlamaConfig
from flashfsdp.train.errors import UsageError
from flashfsdp.train.hf_names import hf_names

# fp32 gradient shard + AdamW's two fp32 moments, per parameter element.
SAVED_BYTES_PER_PARAM = 12
_WRAPPER_PREFIX = "_checkpoint_wrapped_module."


@dataclasses.dataclass(frozen=True)
class FreezeSummary:
    """What --freeze left to train.

    Attributes:
        trainable, frozen: parameter elements trained and frozen (full model, tied weights once).
        frozen_tensors: names of the frozen parameters.
    """

    trainable: int
    frozen: int
    frozen_tensors: tuple[str, ...]

    def saved_bytes_per_rank(self, world_size: int) -> int:
        """The gradient and AdamW state not allocated per rank: 12 bytes per frozen element / W."""
        return SAVED_BYTES_PER_PARAM * self.frozen // world_size


def clean_name(name: str) -> str:
    """A parameter name without activation checkpointing's wrapper prefix."""
    return name.replace(_WRAPPER_PREFIX, "")


def parameter_sizes(config: LlamaConfig) -> dict[str, int]:
    """Elements of each parameter of `Llama(config)` by name (built on the meta device)."""
    with torch.device("meta"):
        return {name: p.numel() for name, p in Llama(config).named_parameters()}


def matches(name: str, patterns: Sequence[str], aliases: dict[str, str]) -> bool:
    """Whether `name` or its transformers name `aliases.get(name)` matches one of `patterns`."""
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(aliases.get(name, ""), p) for p in patterns)


def frozen_names(names: Sequence[str], patterns: Sequence[str], config: LlamaConfig) -> list[str]:
    """The names among `names` that `patterns` freeze.

    Raises:
        UsageError: a pattern that matches no name, or patterns that match every name (the
            message names the pattern and shows names to match).
    """
    aliases = hf_names(config)
    for pattern in patterns:
        if not any(matches(n, [pattern], aliases) for n in names):
            examples = ", ".join(list(names)[:3])
            raise UsageError(f"--freeze {pattern!r} matches no parameter; names look like {examples} "
                             "(or transformers' model.layers.0.self_attn.q_proj.weight)")
    frozen = [n for n in names if matches(n, patterns, aliases)]
    if frozen and len(frozen) == len(names):
        raise UsageError(f"--freeze {' '.join(patterns)} freezes every parameter; leave some to train")
    return frozen


def freeze(model: nn.Module, patterns: Sequence[str], config: LlamaConfig) -> FreezeSummary:
    """Freeze the parameters of the sharded `model` that match `patterns` (`requires_grad_(False)`).

    Args:
        model: the (sharded) `Llama` of `config`.
        patterns: --freeze globs (empty: nothing frozen).
        config: the model's shape (for the full sizes and the transformers names).

    Returns:
        The `FreezeSummary`.

    Raises:
        UsageError: see `frozen_names`.
    """
    sizes = parameter_sizes(config)
    params = {clean_name(n): p for n, p in model.named_parameters()}
    frozen = frozen_names(list(params), patterns, config)
    for name in frozen:
        params[name].requires_grad_(False)
    frozen_elements = sum(sizes[n] for n in frozen)
    return FreezeSummary(sum(sizes.values()) - frozen_elements, frozen_elements, tuple(frozen))


def check_freeze(patterns: Sequence[str], config: LlamaConfig) -> None:
    """Check --freeze against the model's names before any worker starts (see `frozen_names`)."""
    if patterns:
        frozen_names(list(parameter_sizes(config)), patterns, config)
