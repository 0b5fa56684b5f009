"""``flashfsdp.optim.SGD``: torch's SGD (with momentum, dampening, Nesterov, weight decay) that
steps each unit's flat shard as one tensor.

Algorithm: stochastic gradient descent with momentum as ``torch.optim.SGD`` defines it (Sutskever
et al., "On the importance of initialization and momentum in deep learning", ICML 2013, in
PyTorch's formulation); the update is torch's functional ``sgd`` (``torch._fused_sgd_`` on CPU and
CUDA), given one flat tensor per run instead of one per parameter.
"""

from __future__ import annotations

import torch
from torch.optim.sgd import sgd

from flashfsdp._torch_private import use_grad_for_differentiable

from flashfsdp.runtime.param_tags import group_of, tag_of

from .base import FlatStepMixin, GroupPlan
from .clip import ClipInStepMixin, check_max_grad_norm


class SGD(ClipInStepMixin, FlatStepMixin, torch.optim.SGD):
    """SGD over flashfsdp's sharded parameters, stepping one flat tensor per unit run.

    Same constructor arguments, ``param_groups``, per-parameter ``state`` (``momentum_buffer``
    when ``momentum != 0``) and ``state_dict()`` layout as :class:`torch.optim.SGD`, so checkpoints
    interchange with torch's SGD. Runs are formed as in :class:`flashfsdp.optim.AdamW` (consecutive
    pieces of one shard with gradients), here among pieces that all have a momentum buffer or all
    have none yet; momentum buffers are views into one flat buffer per shard.

    Args: those of :class:`torch.optim.SGD` (``params, lr, momentum, dampening, weight_decay,
        nesterov, maximize, foreach, differentiable, fused``), checked by it, and
        ``max_grad_norm`` (keyword; None: no clipping): clip the gradients to this global norm
        within ``step()``, as :class:`flashfsdp.optim.AdamW` does (``torch._fused_sgd_`` takes a
        ``grad_scale`` too); ``last_grad_norm``: the last step's norm.

    Raises:
        ValueError: ``max_grad_norm`` is not a finite number > 0.
        ValueError / RuntimeError: torch's, for bad arguments.
        RuntimeError: a piece's ``.grad`` with another number of elements than the piece.
    """

    def __init__(self, params, *args, max_grad_norm: float | None = None, **kwargs):
        self.max_grad_norm = check_max_grad_norm("flashfsdp.optim.SGD", max_grad_norm)
        super().__init__(params, *args, **kwargs)

    def _age(self, p: torch.Tensor) -> bool:
        """Whether ``p`` has a momentum buffer (the first step starts it from the gradient)."""
        return "momentum_buffer" in self.state.get(p, {})

    @use_grad_for_differentiable
    def step(self, closure=None):
        """One SGD step (torch's semantics), clipped first with ``max_grad_norm``; returns
        ``closure()``'s loss if given."""
        return self._clipped_step(closure)

    def _plan_flags(self, group: dict) -> tuple:
        return (group["momentum"] != 0,)

    def _build_plan(self, group: dict, plan: GroupPlan) -> None:
        momentum = group["momentum"] != 0
        states = self._flat_states()
        started = [momentum and self._age(run.params[0]) for run in plan.runs]
        fused = self._uses_fused(group, plan.runs) and (all(started) or not any(started))  # the fused
        # kernel starts all momentum buffers of a call or none
        for run, on in zip(plan.runs, started):
            if on:
                for p in run.params:
                    states.adopt(p, self.state[p], "momentum_buffer")
                plan.checks += [(p, "momentum_buffer", self.state[p]["momentum_buffer"]) for p in run.params]
        plan.args.update(fused=fused, momentum=momentum, started=started,
                         buffers=[states.run_view(r, "momentum_buffer") if on else None
                                  for r, on in zip(plan.runs, started)])

    def _run_plan(self, group: dict, plan: GroupPlan) -> None:
        if plan.runs:
            self._step_runs(group, plan)
        if plan.rest:
            params, grads, buffers = [], [], []
            has_sparse = self._init_group(dict(group, params=plan.rest), params, grads, buffers)
            self._sgd(group, params, grads, buffers, has_sparse, group["fused"], group["foreach"])
            if group["momentum"] != 0:
                for p, buf in zip(params, buffers, strict=True):
                    self.state[p]["momentum_buffer"] = buf

    def _step_runs(self, group: dict, plan: GroupPlan) -> None:
        args, runs = plan.args, plan.runs
        buffers = list(args["buffers"])
        fused = args["fused"]
        self._sgd(group, [r.flat for r in runs], [r.grad() for r in runs], buffers, False, fused,
                  None if fused else group["foreach"])
        if not args["momentum"] or all(args["started"]):
            return
        states = self._flat_states()
        for run, buf, on in zip(runs, buffers, args["started"]):
            if not on:  # a buffer this step started: into the flat buffer, the pieces' state its views
                states.run_view(run, "momentum_buffer").copy_(buf)
                for p in run.params:
                    self.state[p]["momentum_buffer"] = group_of(p).wrap_local(
                        states.view(p, "momentum_buffer"), tag_of(p).index)
        plan.stale = True

    def _sgd(self, group: dict, params, grads, buffers, has_sparse: bool, fused, foreach) -> None:
        sgd(params, grads, buffers, has_sparse_grad=has_sparse, foreach=foreach, fused=fused,
            grad_scale=self._grad_scale_for(grads, fused), found_inf=getattr(self, "found_inf", None),
            weight_decay=group["weight_decay"], momentum=group["momentum"], lr=group["lr"],
            dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"])
