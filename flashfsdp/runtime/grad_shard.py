"""The gradient half of a flat group: the gradient shard and the DTensor gradients that view it.

``sharded_grad`` has the shard's layout (S elements, the master dtype): the reduce-scatter's
output is accumulated into it (``reduce.py``), and each sharded parameter's ``.grad`` is a DTensor
of the parameter's placements whose local tensor is the parameter's chunk of it — what FSDP2's
gradients are, so ``clip_grad_norm_`` / ``get_total_norm`` and stock optimizers see the global
picture, while ``flashfsdp.optim`` steps the whole shard as one tensor. The buffer exists from the
first reduction until ``optimizer.zero_grad()`` sets every ``.grad`` to None (then it is freed, as
FSDP2's gradients are during the forward).
"""

from __future__ import annotations

import sys
from typing import Callable, Sequence

import torch

from flashfsdp._torch_private import storage_use_count

from .layout import ShardLayout
from .sharding_spec import is_dtensor, local_of



class GradShard:
    """Mixin of :class:`~flashfsdp.runtime.flat_param.FlatParam` holding its gradient shard.

    It reads the FlatParam's ``layout``, ``rank``, ``shapes``, ``spec``, ``sharded_params`` and
    ``local_view`` / ``_new_shard`` / ``chunk_of``.

    Attributes:
        sharded_grad: the gradient shard (S elements, the master dtype) or None.
        grad_stats: ``(squared L2 norm, inf/nan flag, sharded_grad._version)`` from the last fused
            accumulation (``reduce.py``), or None.
        unsharded_accum: no-sync micro-batches with a ``reduce_dtype`` other than ``param_dtype``:
            the gradients summed in ``reduce_dtype`` in the unsharded layout, or None;
            ``accum_had_grad`` says which parameters got one (``reduce.accumulate_unsharded``).
    """

    def __init__(self):
        self.sharded_grad: torch.Tensor | None = None
        self.grad_stats: tuple[torch.Tensor, torch.Tensor, int] | None = None
        self.unsharded_accum: torch.Tensor | None = None
        self.accum_had_grad: list[bool] = [False] * len(self.shapes)
        self._reduce_layouts: dict[tuple[bool, ...], ShardLayout | None] = {}
        self._grad_tensors: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        # [Note: kept gradient DTensors]: the released buffer and its DTensors
        self._spare_grad: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self._grad_holders: tuple | None = None

    def reduce_layout(self) -> ShardLayout | None:
        """The reduce-scatter layout of the parameters trainable now, or None when all are (the
        group's own layout is used then). A frozen parameter is left out of the reduce-scatter:
        each rank's segment packs only the trainable parameters' chunks (FSDP2 gets the same
        from per-parameter sharding). Cached per pattern of ``requires_grad`` flags."""
        trainable = tuple(p.requires_grad for p in self.sharded_params)
        if trainable not in self._reduce_layouts:
            self._reduce_layouts[trainable] = None if all(trainable) else self.layout.sub_layout(trainable)
        return self._reduce_layouts[trainable]

    def sharded_grad_buffer(self) -> torch.Tensor:
        """``sharded_grad``, allocated (zeroed) on first use: the released buffer and its gradient
        DTensors again where :meth:`release_unused_grad` could keep them."""
        if self.sharded_grad is None:
            spare, self._spare_grad = self._spare_grad, None
            if spare is not None:
                buffer = spare[0]
                buffer.untyped_storage().resize_(buffer.numel() * buffer.element_size())  # (offset 0)
                self.sharded_grad, self._grad_tensors = buffer.zero_(), spare
            else:
                self.sharded_grad = self._new_shard(self.dtype, zeros=True)
        return self.sharded_grad

    def reduce_output(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
        """A ``numel``-element buffer (``numel`` >= S, a reduce-scatter segment) for a reduction
        whose first S elements can then become ``sharded_grad`` (:meth:`adopt_reduce_output`), or
        None where they cannot: the group holds a gradient, or the gradient shard's dtype or
        device differ from the reduction's (a ``reduce_dtype`` other than the master dtype, CPU
        offload).

        [Note: reduced in place]
        FSDP2's reduce-scatter output becomes the gradient where there is none to add to. Here
        the output of a reduction that assigns is likewise the gradient shard's memory, scaled in
        place by the accumulation (an exact alias, which the kernel allows), instead of a second
        S-element buffer alive beside it: one unit of gradients less at the backward's peak. A
        released buffer ([Note: kept gradient DTensors]) gets its memory back at the segment's size."""
        if self.sharded_grad is not None or dtype != self.dtype or device != self.shard_device:
            return None
        if self._spare_grad is None:
            return torch.empty(numel, dtype=dtype, device=device)
        storage = self._spare_grad[0].untyped_storage()
        storage.resize_(numel * dtype.itemsize)
        return torch.empty(0, dtype=dtype, device=device).set_(storage, 0, (numel,))

    def adopt_reduce_output(self, output: torch.Tensor) -> torch.Tensor:
        """Make ``output[:S]`` (a :meth:`reduce_output` buffer) the gradient shard and return it;
        the gradient shard as :meth:`sharded_grad_buffer` gives it where one appeared since."""
        if self.sharded_grad is not None:
            return self.sharded_grad
        spare, self._spare_grad = self._spare_grad, None
        if spare is not None and spare[0].untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
            self.sharded_grad, self._grad_tensors = spare[0], spare
        else:
            self.sharded_grad = output[: self.layout.shard_size]
        return self.sharded_grad

    def release_unused_grad(self) -> None:
        """Free ``sharded_grad`` once no parameter refers to it (``optimizer.zero_grad()`` set every
        ``.grad`` to None): the memory is free during the forward, as FSDP2's gradients are.

        [Note: kept gradient DTensors]
        Building a DTensor gradient per parameter and step costs microseconds each, which add up on
        units of many small parameters. So where nothing but this group holds the gradient
        DTensors, their local views or the buffer's memory (Python references and the storage's
        use count, against those counted when they were built), the memory alone is freed
        (``untyped_storage().resize_(0)``, as FSDP2 frees its unsharded parameters) and the next
        reduction resizes it back under the same DTensors. Where anything else holds one (a
        ``.grad`` kept past ``zero_grad()``, a view of it), the buffer is dropped as a whole, so
        what is held keeps its values, as on FSDP2."""
        if self.sharded_grad is None or any(p.grad is not None for p in self.sharded_params):
            return
        buffer, exposed = self.sharded_grad, self._grad_tensors
        keep = (exposed is not None and exposed[0] is buffer and buffer.device.type != "meta"
                and not buffer.is_pinned() and self._holders() == self._grad_holders)
        self.sharded_grad, self.grad_stats, self._grad_tensors = None, None, None
        if keep:
            buffer.untyped_storage().resize_(0)
            self._spare_grad = exposed

    def _holders(self) -> tuple:
        """What holds the gradient DTensors and their memory now: the Python references to each
        DTensor and to its local view, and the tensors on the buffer's storage (any view, alias or
        ``to_local()`` result of a gradient counts there); see [Note: kept gradient DTensors]. The
        buffer tensor itself is this group's alone (nothing outside the runtime reaches it)."""
        buffer, grads = self._grad_tensors
        refs = sys.getrefcount
        return (tuple(map(refs, grads)), tuple(map(refs, map(local_of, grads))),
                storage_use_count(buffer.untyped_storage()._cdata))

    def grad_views(self) -> list[torch.Tensor]:
        """Each parameter's chunk of ``sharded_grad`` (local shapes, plain tensors)."""
        return self.local_views(self.sharded_grad_buffer())

    def exposed_grads(self) -> tuple[torch.Tensor, list[torch.Tensor]] | None:
        """``(sharded_grad, its gradient DTensors)`` as :meth:`grad_tensors` built them (one per
        parameter, in index order), or None where there is no gradient shard or none were built
        over it. Reads only: allocates and builds nothing, so an optimizer may ask at every step
        whether a ``.grad`` is the unit's own (a view of ``sharded_grad`` at the parameter's chunk)."""
        tensors = self._grad_tensors
        if tensors is None or self.sharded_grad is None or tensors[0] is not self.sharded_grad:
            return None
        return tensors

    def grad_tensors(self) -> list[torch.Tensor]:
        """The ``.grad`` of each sharded parameter over ``sharded_grad``: DTensors of the
        parameters' placements (plain tensors without a mesh), built once per buffer."""
        grad = self.sharded_grad_buffer()
        if self._grad_tensors is None or self._grad_tensors[0] is not grad:
            self._grad_tensors = (grad, [self.wrap_local(v, i) for i, v in enumerate(self.local_views(grad))])
            self._grad_holders = self._holders()
        return self._grad_tensors[1]

    def _grad_chunk(self, grad: torch.Tensor, i: int) -> torch.Tensor:
        """This rank's chunk of parameter ``i``'s gradient from a ``.grad`` set by hand: a DTensor
        (its local tensor), a full-shape tensor (its rows), or the chunk itself."""
        if is_dtensor(grad):
            return local_of(grad)
        if tuple(grad.shape) == self.shapes[i] and tuple(grad.shape) != self.layout.local_shape(self.rank, i):
            return self.chunk_of(grad, i)
        return grad

    def prepare_grad_accumulation(self) -> bool:
        """Make ``sharded_grad`` hold what the user's ``.grad`` fields say; True if it holds a gradient.

        After ``optimizer.zero_grad(set_to_none=True)`` every ``.grad`` is None: the next reduction
        then assigns instead of adding (returns False). A parameter whose ``.grad`` was set to None
        alone is zeroed; a ``.grad`` replaced by another tensor is copied into the buffer.

        Raises:
            RuntimeError: a ``.grad`` set by hand whose chunk has another shape than the parameter's.
        """
        grads = [p.grad for p in self.sharded_params]
        if self.sharded_grad is None or all(g is None for g in grads):
            return False
        ours = self._grad_tensors[1] if self._grad_tensors is not None else [None] * len(grads)
        views = self.grad_views()
        with torch.no_grad():
            for i, (g, v) in enumerate(zip(grads, views)):
                if g is None:
                    v.zero_()
                elif g is not ours[i]:
                    chunk = self._grad_chunk(g, i)
                    if chunk.shape != v.shape:
                        raise RuntimeError(
                            f"the .grad of '{self.fqns[i]}' was set to a tensor of shape {tuple(g.shape)} whose local "
                            f"chunk has shape {tuple(chunk.shape)}; this rank's chunk is {tuple(v.shape)}")
                    if chunk.data_ptr() != v.data_ptr() or chunk.numel() != v.numel():
                        v.copy_(chunk)
        return True

    def had_grads(self) -> list[bool]:
        """Per parameter, whether its sharded parameter holds a gradient now (accumulating into it)."""
        return [p.grad is not None for p in self.sharded_params]

    def grad_mask(self, local: Sequence[bool], had: Sequence[bool], got_anywhere: Callable[[], list[bool]],
                  unused_get_zeros: bool = False) -> list[bool]:
        """Which parameters get a ``.grad`` after a reduction: those that had one, got one on this
        rank, or got one on another rank only.

        [Note: gradients of unused parameters]
        A trainable parameter that no rank used in a step must keep ``.grad = None`` (stepped with
        zeros, Adam's momentum would move it; FSDP2 and DDP leave it None), and every rank must
        agree on it: a DTensor gradient present on one rank and None on another would send the
        ranks into different collectives in ``get_total_norm``. So each rank's reduce-scatter
        input carries one flag per parameter (it got a gradient on that rank), summed by the same
        reduce-scatter; ``got_anywhere()`` reads the sums, which are the same on every rank. It is
        read only for parameters that got no gradient on this rank (usage that differs across
        ranks, e.g. experts that only some ranks' tokens reach); on CUDA that read costs one
        synchronisation, so freeze parameters that are never used (``requires_grad_(False)``) to
        skip it. With ``unused_get_zeros`` (FSDP2's ``set_reduce_scatter_unused_params``) every
        trainable parameter gets a gradient, zeros where no rank gave one.
        """
        if unused_get_zeros:
            return [bool(h or g or p.requires_grad) for h, g, p in zip(had, local, self.sharded_params)]
        mask = [bool(h or g) for h, g in zip(had, local)]
        if any(not m and p.requires_grad for m, p in zip(mask, self.sharded_params)):
            anywhere = got_anywhere()
            mask = [m or (a and p.requires_grad) for m, a, p in zip(mask, anywhere, self.sharded_params)]
        return mask

    def expose_grads(self, mask: Sequence[bool] | None = None) -> None:
        """Point each sharded parameter's ``.grad`` at its chunk of ``sharded_grad`` (where ``mask``
        says so; the others get None)."""
        for i, (param, grad) in enumerate(zip(self.sharded_params, self.grad_tensors())):
            param.grad = grad if mask is None or mask[i] else None

    def reset_grads(self, grad_flat: torch.Tensor | None, mask: Sequence[bool]) -> None:
        """Take ``grad_flat`` (shard layout, or None) as the gradient shard and expose it where
        ``mask`` says (after the group was moved to another dtype or device)."""
        self.sharded_grad, self.grad_stats, self._grad_tensors, self._spare_grad = grad_flat, None, None, None
        self.unsharded_accum = None
        if grad_flat is not None:
            self.expose_grads(mask)

    def run_post_accumulate_grad_hooks(self) -> None:
        """Call the hooks users registered on the sharded parameters with
        ``register_post_accumulate_grad_hook`` (an optimizer stepping in backward): the parameters
        get their gradient from the reduction, not from autograd, so FSDP2 calls them too, right after."""
        for p in self.sharded_params:
            hooks = getattr(p, "_post_accumulate_grad_hooks", None)
            if p.grad is not None and hooks:
                for hook in list(hooks.values()):
                    hook(p)
