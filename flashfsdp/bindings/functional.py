"""Differentiable collectives."""

from __future__ import annotations

import torch
import torch.distributed as dist

from flashfsdp.runtime.comm_factory import communicator_in_use


class _AllGatherWithGrad(torch.autograd.Function):
    """Through the communicator the units over the group use (``communicator_in_use``): on CUDA
    the same NCCL communicator as their all-gathers and reduce-scatters, so NCCL orders them."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group):
        comm = communicator_in_use(group if group is not None else dist.group.WORLD, tensor.device)
        ctx.comm = comm
        tensor = tensor.contiguous()
        out = tensor.new_empty((comm.world_size * tensor.shape[0], *tensor.shape[1:]))
        comm.all_gather_into_tensor(out.view(-1), tensor.view(-1)).wait()
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        comm = ctx.comm
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // comm.world_size, *grad.shape[1:]))
        comm.reduce_scatter_tensor(out.view(-1), grad.view(-1), op="sum").wait()
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
