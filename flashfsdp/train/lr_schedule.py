"""Learning-rate schedule of `flashfsdp-train`: linear warm-up, then cosine decay to a floor.

A pure function of the step, so a resumed run (at any world size) follows the same schedule
without saving scheduler state. The shape is the one of Loshchilov & Hutter 2017 (SGDR, one
cycle) with linear warm-up (Goyal et al. 2017), as used for GPT-3 and Llama.
"""

from __future__ import annotations

import math


def lr_at(step: int, peak_lr: float, warmup_steps: int, decay_steps: int, min_lr: float) -> float:
    """The learning rate for optimizer step `step` (0-based).

    - step < warmup_steps: peak_lr · (step + 1) / warmup_steps (never 0, reaches peak_lr at the
      last warm-up step);
    - warmup_steps ≤ step < decay_steps: cosine from peak_lr down to min_lr;
    - step ≥ decay_steps: min_lr.

    Args:
        step: optimizer step, ≥ 0.
        peak_lr: the rate reached at the end of warm-up (> 0).
        warmup_steps: warm-up length in steps (≥ 0).
        decay_steps: step at which the cosine reaches min_lr (usually the run's total steps).
        min_lr: the floor, 0 ≤ min_lr ≤ peak_lr.

    Raises:
        ValueError: negative step or warm-up, or min_lr outside [0, peak_lr].
    """
    if step < 0 or warmup_steps < 0:
        raise ValueError(f"step ({step}) and warmup_steps ({warmup_steps}) must be non-negative")
    if not 0.0 <= min_lr <= peak_lr:
        raise ValueError(f"min_lr ({min_lr}) must be in [0, peak_lr = {peak_lr}]")
    if step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if step >= decay_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, decay_steps - warmup_steps)
    return min_lr + 0.5 * (peak_lr - min_lr) * (1.0 + math.cos(math.pi * progress))
