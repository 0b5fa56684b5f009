"""FlatParam: one flat group of a unit — sharded master storage, unsharded buffer, views, pieces.

A unit's parameters are grouped by (original dtype, requires_grad); each group is one FlatParam
(almost always a unit has exactly one). Per rank it holds:

- ``sharded_flat``: S elements in the original dtype (the master weights of this rank's range).
- ``sharded_grad``: S elements in the original dtype, allocated at the first gradient.
- ``sharded_params``: each parameter's local piece as an ``nn.Parameter`` that is a 1-D view into
  ``sharded_flat`` (possibly empty); these are what ``module.parameters()`` yields outside
  forward/backward, so stock optimizers step them in place. Each carries ``_flashfsdp_full_shape``,
  ``_flashfsdp_fqn`` and ``_flashfsdp_piece`` (its range) for state dicts.
- ``unsharded_flat``: T = W·S elements in ``param_dtype``; its storage is alive only between
  unshard and reshard. ``unsharded_params`` are ``nn.Parameter`` views
  ``unsharded_flat[o_i : o_i + n_i].view(shape_i)`` created once: the all-gather writes the
  parameters in place (zero-copy unshard), and reshard frees only the storage, which unshard
  re-materialises in place, so tensors autograd saved in forward are valid again in backward.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from flashfsdp.kernels import flatten

from .layout import FlatLayout, LocalPiece


class FlatParam:
    """The flat storage of one group of parameters of one unit on one rank.

    Args:
        params: the original full parameters (any shapes, one floating dtype, one requires_grad),
            identical on every rank; read once to build this rank's shard.
        fqns: a name per parameter (for errors and state dicts); see :meth:`prefix_fqns`.
        rank, world_size: this rank and W.
        param_dtype: dtype of the unsharded buffer (forward/backward compute).
        device: where the shard and buffers live.
        align: element alignment of the layout (see ``layout.align_elements``).

    Raises:
        ValueError: if the parameters mix dtypes or requires_grad (group them first).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        fqns: Sequence[str],
        *,
        rank: int,
        world_size: int,
        param_dtype: torch.dtype,
        device: torch.device,
        align: int,
    ):
        if len({p.dtype for p in params}) != 1 or len({p.requires_grad for p in params}) != 1:
            raise ValueError("FlatParam: parameters of one group must share dtype and requires_grad")
        self.fqns = list(fqns)
        self.shapes = [tuple(p.shape) for p in params]
        self.dtype = params[0].dtype
        self.requires_grad = params[0].requires_grad
        self.param_dtype = param_dtype
        self.device = device
        self.rank = rank
        self.world_size = world_size
        self.layout = FlatLayout.build([p.numel() for p in params], world_size, align)
        self.pieces: list[LocalPiece] = self.layout.local_pieces(rank)
        S, T = self.layout.shard_size, self.layout.total
        self._shard_lo = rank * S

        # This rank's shard of the master weights: one flatten launch over the pieces.
        self.sharded_flat = torch.empty(S, dtype=self.dtype, device=device)
        with torch.no_grad():
            sources = [
                p.detach().reshape(-1)[pc.param_start : pc.param_start + pc.numel].to(device)
                for p, pc in zip(params, self.pieces)
            ]
            flatten(sources, [pc.shard_start for pc in self.pieces], self.sharded_flat)
        self.sharded_grad: torch.Tensor | None = None
        # (squared L2 norm, inf/nan flag, sharded_grad._version) from the last fused accumulation
        self.grad_stats: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.sharded_params = [self._make_sharded_param(i) for i in range(len(params))]

        # The unsharded buffer and its views: created once, storage freed until the first unshard.
        self.unsharded_flat = torch.empty(T, dtype=param_dtype, device=device)
        self.unsharded_params = [
            nn.Parameter(self.unsharded_flat[o : o + n].view(shape), requires_grad=self.requires_grad)
            for o, n, shape in zip(self.layout.offsets, self.layout.numels, self.shapes)
        ]
        self._unsharded_nbytes = T * self.unsharded_flat.element_size()
        self.free_unsharded()

    # ---------------------------------------------------------------- sharded side
    def _make_sharded_param(self, i: int) -> nn.Parameter:
        pc = self.pieces[i]
        param = nn.Parameter(self.sharded_flat[pc.shard_start : pc.shard_end], requires_grad=self.requires_grad)
        param._flashfsdp_full_shape = torch.Size(self.shapes[i])
        param._flashfsdp_fqn = self.fqns[i]
        param._flashfsdp_piece = pc
        return param

    def prefix_fqns(self, prefix: str) -> None:
        """Prepend ``prefix`` (e.g. ``"layers.0."``) to every parameter's name, in ``fqns`` and on
        the sharded pieces' ``_flashfsdp_fqn``.

        The bindings name a unit's parameters relative to the module it was built from, and call
        this when an enclosing module's unit is built, so that the names end up fully qualified.
        """
        self.fqns = [prefix + fqn for fqn in self.fqns]
        for param, fqn in zip(self.sharded_params, self.fqns):
            param._flashfsdp_fqn = fqn

    @property
    def shard_range(self) -> tuple[int, int]:
        """This rank's [start, end) in the flat buffer (elements)."""
        return self.layout.rank_range(self.rank)

    def sharded_grad_buffer(self) -> torch.Tensor:
        """``sharded_grad`` (S elements, original dtype), allocated (zeroed) on first use."""
        if self.sharded_grad is None:
            self.sharded_grad = torch.zeros(self.layout.shard_size, dtype=self.dtype, device=self.device)
        return self.sharded_grad

    def grad_views(self) -> list[torch.Tensor]:
        """Each sharded parameter's slice of ``sharded_grad`` (1-D views)."""
        grad = self.sharded_grad_buffer()
        return [grad[pc.shard_start : pc.shard_end] for pc in self.pieces]

    def prepare_grad_accumulation(self) -> bool:
        """Make ``sharded_grad`` hold what the user's ``.grad`` fields say; True if it holds a gradient.

        After ``optimizer.zero_grad(set_to_none=True)`` every piece's ``.grad`` is None: the next
        reduction then assigns instead of adding (returns False). A piece whose ``.grad`` was set to
        None alone is zeroed; a ``.grad`` replaced by another tensor is copied into the buffer.
        """
        grads = [p.grad for p in self.sharded_params]
        if self.sharded_grad is None or all(g is None for g in grads):
            return False
        views = self.grad_views()
        for g, v in zip(grads, views):
            if g is None:
                v.zero_()
            elif g.data_ptr() != v.data_ptr() or g.numel() != v.numel():
                v.copy_(g.reshape(-1))
        return True

    def expose_grads(self) -> None:
        """Point every sharded parameter's ``.grad`` at its slice of ``sharded_grad``."""
        for param, view in zip(self.sharded_params, self.grad_views()):
            param.grad = view

    # ---------------------------------------------------------------- unsharded side
    @property
    def is_unsharded(self) -> bool:
        """Whether the unsharded buffer's storage is allocated."""
        return self.unsharded_flat.untyped_storage().nbytes() > 0

    def alloc_unsharded(self) -> None:
        """Re-materialise the unsharded buffer's storage in place (contents undefined)."""
        storage = self.unsharded_flat.untyped_storage()
        if storage.nbytes() != self._unsharded_nbytes:
            storage.resize_(self._unsharded_nbytes)

    def free_unsharded(self) -> None:
        """Free the unsharded buffer's storage; the tensor objects and views stay alive."""
        self.unsharded_flat.untyped_storage().resize_(0)

    def shard_slice_of_unsharded(self) -> torch.Tensor:
        """``unsharded_flat[r·S:(r+1)·S]``: where copy-in writes and the all-gather reads."""
        lo, hi = self.shard_range
        return self.unsharded_flat[lo:hi]

    def copy_in(self) -> None:
        """Cast ``sharded_flat`` to ``param_dtype`` into this rank's slice of the unsharded buffer."""
        flatten([self.sharded_flat], [0], self.shard_slice_of_unsharded())

    @property
    def unsharded_nbytes(self) -> int:
        """Bytes of the unsharded buffer when allocated (T · itemsize of ``param_dtype``)."""
        return self._unsharded_nbytes

    def sharded_nbytes(self) -> int:
        """Bytes this rank holds for the group's master weights and gradient shard."""
        grad = 0 if self.sharded_grad is None else self.sharded_grad.numel() * self.sharded_grad.element_size()
        return self.sharded_flat.numel() * self.sharded_flat.element_size() + grad
