"""Optimizers that step each flashfsdp unit's flat shard in one fused call.

``flashfsdp.optim.AdamW`` and ``flashfsdp.optim.SGD`` take torch's arguments and keep torch's
per-parameter state and ``state_dict()`` layout (checkpoints interchange with ``torch.optim``), but
step each unit's sharded parameters as one contiguous tensor in one fused call per group (see
``runtime/flat_runs.py``), where FSDP2 steps every parameter's piece separately (and a stock
optimizer on flashfsdp's parameters steps one tensor per run with foreach or fused, one local
tensor per parameter otherwise: ``bindings/optimizer_local_step.py``).
Parameters that are not flashfsdp pieces are stepped as torch steps them. With ``max_grad_norm``
either clips the gradients to their global norm within ``step()``, folded into the fused call's
``grad_scale`` (see ``clip.py``).
"""

from flashfsdp.optim.adamw import AdamW
from flashfsdp.optim.sgd import SGD

__all__ = ["AdamW", "SGD"]
