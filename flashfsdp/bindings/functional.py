"""Differentiable collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashfsdp.runtime.process_group import all_gather_single, reduce_scatter_single


class _AllGatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group):
        ctx.group = group
        world = dist.get_world_size(group)
        tensor = tensor.contiguous()
        out = tensor.new_empty((world * tensor.shape[0], *tensor.shape[1:]))
        all_gather_single(out, tensor, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        world = dist.get_world_size(ctx.group)
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // world, *grad.shape[1:]))
        reduce_scatter_single(out, grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return out, None


def all_gather_with_grad(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """All-gather along dim 0 whose backward returns this rank's slice of the gradient summed over ranks.

    A loss computed on every rank over all ranks' outputs (e.g. a contrastive InfoNCE loss with
    in-batch negatives from every rank) thus gets the exact single-process gradient, with the
    usual averaging of parameter gradients over ranks and no manual ×W correction.

    Args:
        tensor: this rank's tensor, shape [B, ...] (same shape and dtype on every rank).
        group: the process group (default: world). Without torch.distributed initialised the
            group is this process alone and the function is the identity.

    Returns:
        Shape [W·B, ...]: rank r's tensor at rows [r·B, (r+1)·B).

    Raises:
        ValueError: ``tensor`` is 0-dimensional.
    """
    if tensor.dim() == 0:
        raise ValueError("all_gather_with_grad: tensor must have at least one dimension (gathered along dim 0)")
    if not (dist.is_available() and dist.is_initialized()):
        return tensor
    return _AllGatherWithGrad.apply(tensor, group)
