"""``flashfsdp.optim.SGD``: torch's SGD (with momentum, dampening, Nesterov, weight decay) that
steps each unit's flat shard as one tensor.

Algorithm: stochastic gradient descent with momentum as ``torch.optim.SGD`` defines it (Sutskever
et al., "On the importance of initialization and momentum in deep learning", ICML 2013, in
PyTorch's formulation); the update is torch's functional ``sgd`` (``torch._fused_sgd_`` on CPU and
CUDA), given one flat tensor per run instead of one per parameter.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import _use_grad_for_differentiable
from torch.optim.sgd import sgd

from .base import FlatStepMixin
from .runs import Run


class SGD(FlatStepMixin, torch.optim.SGD):
    """SGD over flashfsdp's sharded parameters, stepping one flat tensor per unit run.

    Same constructor arguments, ``param_groups``, per-parameter ``state`` (``momentum_buffer``
    when ``momentum != 0``) and ``state_dict()`` layout as :class:`torch.optim.SGD`, so checkpoints
    interchange with torch's SGD. Runs are formed as in :class:`flashfsdp.optim.AdamW` (consecutive
    pieces of one shard with gradients), here among pieces that all have a momentum buffer or all
    have none yet; momentum buffers are views into one flat buffer per shard.

    Args: those of :class:`torch.optim.SGD` (``params, lr, momentum, dampening, weight_decay,
        nesterov, maximize, foreach, differentiable, fused``), checked by it.

    Raises:
        ValueError / RuntimeError: torch's, for bad arguments.
        RuntimeError: a piece's ``.grad`` with another number of elements than the piece.
    """

    def _age(self, p: torch.Tensor) -> bool:
        """Whether ``p`` has a momentum buffer (the first step starts it from the gradient)."""
        return "momentum_buffer" in self.state.get(p, {})

    @_use_grad_for_differentiable
    def step(self, closure=None):
        """One SGD step (torch's semantics); returns ``closure()``'s loss if given."""
        return self._flat_step(closure)

    def _step_group(self, group: dict, runs: list[Run], rest: list[torch.Tensor]) -> None:
        if runs:
            self._step_runs(group, runs)
        if rest:
            params, grads, buffers = [], [], []
            has_sparse = self._init_group(dict(group, params=rest), params, grads, buffers)
            self._sgd(group, params, grads, buffers, has_sparse, group["fused"], group["foreach"])
            if group["momentum"] != 0:
                for p, buf in zip(params, buffers, strict=True):
                    self.state[p]["momentum_buffer"] = buf

    def _step_runs(self, group: dict, runs: list[Run]) -> None:
        fused = self._uses_fused(group, runs)
        momentum = group["momentum"] != 0
        states = self._flat_states()
        buffers = []
        for run in runs:
            started = momentum and self._age(run.params[0])
            if started:
                for p in run.params:
                    states.adopt(p, self.state[p], "momentum_buffer")
            buffers.append(states.run_view(run, "momentum_buffer") if started else None)
        if fused and momentum and any(b is None for b in buffers) and not all(b is None for b in buffers):
            fused = False  # the fused kernel starts all buffers of a call or none
        self._sgd(group, [r.flat for r in runs], [r.grad for r in runs], buffers if momentum else [None] * len(runs),
                  False, fused, None if fused else group["foreach"])
        if momentum:
            for run, buf in zip(runs, buffers):
                view = states.run_view(run, "momentum_buffer")
                if buf is not None and buf.data_ptr() != view.data_ptr():
                    view.copy_(buf)  # a buffer the step started: moved into the flat buffer
                for p in run.params:
                    self.state[p]["momentum_buffer"] = states.view(p, "momentum_buffer")

    def _sgd(self, group: dict, params, grads, buffers, has_sparse: bool, fused, foreach) -> None:
        sgd(params, grads, buffers, has_sparse_grad=has_sparse, foreach=foreach, fused=fused,
            grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None),
            weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
            dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"])
