"""The autograd functions that fire a unit's pre-backward and post-backward.

- ``BackwardHook`` applied to a unit's forward outputs: its backward runs when the gradient of
  those outputs arrives, i.e. before the unit's own backward — there the unit unshards again.
- ``BackwardHook`` applied to a unit's forward inputs: its backward runs once the gradients of
  the inputs are computed, i.e. after the unit's backward. The autograd engine runs
  ``AccumulateGrad`` nodes first when ready (highest sequence number), so by then the unit's
  parameter gradients are in place and the unit reduces them. Units whose inputs need no gradient
  are reduced by the root's final callback instead (FSDP2's ``RegisterPostBackwardFunction``).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch.autograd import Variable


class BackwardHook(torch.autograd.Function):
    """Identity on tensors whose backward calls ``hook()`` before passing the gradients on.

    Applied to a unit's outputs it is its pre-backward; applied to its inputs, its post-backward.
    """

    @staticmethod
    def forward(ctx, hook: Callable[[], None], *tensors: torch.Tensor):
        ctx.hook = hook
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.hook()
        return (None, *grads)


def apply_to_tensors(hook: Callable[[], None], tree):
    """Apply :class:`BackwardHook` jointly to every tensor in ``tree`` that requires grad; return the new tree.

    ``tree`` is any nest of tuples, lists, dicts and leaves (as forward inputs/outputs are).
    Returns ``tree`` unchanged when no tensor in it requires grad or grad mode is off.
    """
    if not torch.is_grad_enabled():
        return tree
    leaves, rebuild = _flatten(tree)
    idx = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and x.requires_grad]
    if not idx:
        return tree
    out = BackwardHook.apply(hook, *[leaves[i] for i in idx])
    out = (out,) if isinstance(out, torch.Tensor) else out
    for i, t in zip(idx, out):
        leaves[i] = t
    return rebuild(leaves)


def _flatten(tree):
    from torch.utils._pytree import tree_flatten, tree_unflatten  # noqa: PLC0415

    leaves, spec = tree_flatten(tree)
    return leaves, lambda new: tree_unflatten(new, spec)


def queue_final_callback(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the current backward pass ends (autograd engine callback queue)."""
    Variable._execution_engine.queue_callback(callback)


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread (e.g. recomputation)."""
    return torch._C._current_graph_task_id() != -1
