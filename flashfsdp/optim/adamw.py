"""``flashfsdp.optim.AdamW``: torch's AdamW that steps each unit's flat shard in one fused call.

Algorithm: AdamW (Loshchilov & Hutter, "Decoupled Weight Decay Regularization", ICLR 2019) exactly
as ``torch.optim.AdamW`` computes it — the update itself is torch's functional ``adam`` (the fused
``torch._fused_adamw_`` kernels on CPU and CUDA); what changes is what it is given.
"""

from __future__ import annotations

import torch
from torch.optim.adam import adam

from flashfsdp._torch_private import foreach_add_, foreach_sub_, get_scalar_dtype, use_grad_for_differentiable

from .base import FlatStepMixin, GroupPlan
from .clip import ClipInStepMixin, check_max_grad_norm


class AdamW(ClipInStepMixin, FlatStepMixin, torch.optim.AdamW):
    """AdamW over flashfsdp's sharded parameters, stepping one flat tensor per unit run.

    Same constructor arguments, ``param_groups``, per-parameter ``state`` and ``state_dict()``
    layout as :class:`torch.optim.AdamW` (state keyed by parameter index, one ``step``,
    ``exp_avg``, ``exp_avg_sq`` — and ``max_exp_avg_sq`` with ``amsgrad`` — per parameter), so
    checkpoints interchange with torch's AdamW over the same parameters, and
    ``flashfsdp.get_optimizer_state_dict`` / DCP work unchanged.

    How it steps: a unit's sharded parameters are views into one master shard and their gradients
    views into one gradient shard (``FlatParam``). Per optimizer group, consecutive pieces of one
    shard that all have a gradient and the same step count form a run (``runtime/flat_runs.py``);
    the state of every piece is a view into one flat buffer per shard and key, so a run is one
    tensor for the parameters, the gradient and each state. All runs of a group then go to one
    ``torch._fused_adamw_`` call (CPU or CUDA; with ``fused=False``: torch's foreach or for-loop
    path over the runs). A unit whose parameters are all trainable, in one group and all with
    gradients is a single run. Everything else — parameters that are not flashfsdp pieces, pieces
    of other shapes or strides, ``differentiable=True`` groups — is stepped per parameter, as torch
    steps it. Parameters whose ``.grad`` is None are not stepped (and break runs), as in torch.

    Differences that do not change results: ``state`` entries are created in storage order, so
    ``state_dict()["state"]`` lists the same keys in another order than torch's; a state buffer
    spans the range of a unit's shard that this optimizer's parameters cover (the padding between
    them included; ``runtime/flat_runs.py``, [Note: state segments]); groups that interleave within
    a unit (decay / no decay per parameter) split its run at every border. The per-group plan is
    cached (``base.py``). With ``fused=False`` and torch's single-tensor path (``foreach=False``, or
    the CPU default), a run's temporaries are the run's size, not a parameter's as on torch's AdamW
    over FSDP2.

    Clipping in the step (``max_grad_norm``): ``step()`` first computes the 2-norm of all
    gradients across ranks exactly as :func:`flashfsdp.clip_grad_norm_` does (the same helper,
    one all-reduce per communicator), turns it into torch's clip coefficient
    ``coef = min(1, max_norm / (norm + 1e-6))`` (``torch.nn.utils.clip_grad_norm_``) on the device,
    and hands ``grad_scale = 1 / coef`` (times a GradScaler's scale, if one set it) to the fused
    call, which divides each gradient by it as it reads it: clip and step read the gradients once
    after the norm, instead of twice. The foreach and for-loop paths multiply the gradients by
    ``coef`` first (one ``_foreach_mul_``), the same semantics. ``last_grad_norm`` holds the norm
    of the last step (0-d fp32 tensor, as ``clip_grad_norm_`` returns it), for logging. Scalers:
    ``flashfsdp.ShardedGradScaler`` unscales the gradients before the step; torch's GradScaler
    steps a fused optimizer on scaled gradients with its ``grad_scale``, by which the norm is
    divided and which is multiplied into the fused call's scale.

    Args: those of :class:`torch.optim.AdamW` (``params, lr, betas, eps, weight_decay, amsgrad,
        maximize, foreach, capturable, differentiable, fused``), checked by it, and
        ``max_grad_norm`` (keyword; None: no clipping): the norm to clip the gradients to.

    Raises:
        ValueError: ``max_grad_norm`` is not a finite number > 0.
        ValueError / RuntimeError: torch's, for bad arguments or sparse gradients.
        RuntimeError: a piece's ``.grad`` with another number of elements than the piece.
    """

    def __init__(self, params, *args, max_grad_norm: float | None = None, **kwargs):
        self.max_grad_norm = check_max_grad_norm("flashfsdp.optim.AdamW", max_grad_norm)
        super().__init__(params, *args, **kwargs)

    def _ages(self) -> dict:
        return self._cache("_flashfsdp_ages", dict)

    def _forget(self) -> None:
        super()._forget()
        self._ages().clear()

    def _plan_flags(self, group: dict) -> tuple:
        return (group["amsgrad"],)

    def _age(self, p: torch.Tensor) -> int:
        """Steps taken by ``p`` (read from its state once, then counted without synchronising)."""
        ages = self._ages()
        age = ages.get(p)
        if age is None:
            step = self.state.get(p, {}).get("step")
            age = ages[p] = 0 if step is None else int(step)
        return age

    @use_grad_for_differentiable
    def step(self, closure=None):
        """One AdamW step (torch's semantics), clipped first with ``max_grad_norm``; returns
        ``closure()``'s loss if given."""
        self._accelerator_graph_capture_health_check()
        return self._clipped_step(closure)

    def _build_plan(self, group: dict, plan: GroupPlan) -> None:
        """Each run's state as flat-buffer views (``step``: 0-d views of a counter vector) and the
        argument lists of the group's fused call, all but the gradients."""
        fused = self._uses_fused(group, plan.runs)
        on_device = fused or group["capturable"]
        step_dtype = get_scalar_dtype(is_fused=fused)
        device_of = (lambda p: p.device) if on_device else (lambda p: torch.device("cpu"))
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
        states = self._flat_states()
        lists = ([], None, [], [], [], [])  # params, grads (per step), exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
        others = []  # the counters of the pieces after each run's first: advanced alongside it
        for run in plan.runs:
            device = device_of(run.params[0])
            counters = states.run_slots(run, "step", step_dtype, device)
            for p in run.params:
                states.adopt_slot(p, self.state[p], "step", step_dtype, device)
                for key in keys:
                    states.adopt(p, self.state[p], key)
            lists[0].append(run.flat)
            for i, key in enumerate(keys):
                lists[2 + i].append(states.run_view(run, key))
            lists[5].append(self.state[run.params[0]]["step"])
            if len(run.params) > 1:
                others.append(counters[1:])
            plan.checks += [(p, k, self.state[p][k]) for p in run.params for k in keys + ("step",)]
        members = [p for run in plan.runs for p in run.params]
        for p in members:
            self._age(p)
        plan.args.update(fused=fused, lists=lists, others=others, members=members)

    def _run_plan(self, group: dict, plan: GroupPlan) -> None:
        if plan.runs:
            self._step_runs(group, plan)
        if plan.rest:
            lists = ([], [], [], [], [], [])
            has_complex = self._init_group(dict(group, params=plan.rest), *lists)
            self._adam(group, lists, has_complex, group["fused"], group["foreach"])
            for p in plan.rest:
                self._ages().pop(p, None)

    def _step_runs(self, group: dict, plan: GroupPlan) -> None:
        args, ages = plan.args, self._ages()
        lists = list(args["lists"])
        lists[1] = [run.grad() for run in plan.runs]
        self._adam(group, lists, False, args["fused"], None if args["fused"] else group["foreach"])
        others = args["others"]
        if others:
            foreach_add_(others, 1)
        found_inf = getattr(self, "found_inf", None)
        if found_inf is not None:  # a skipped step leaves ages unknown: read them again
            if others:
                foreach_sub_(others, [found_inf.to(t.device) for t in others])
            ages.clear()
            plan.stale = True
            return
        for p in args["members"]:
            ages[p] += 1

    def _adam(self, group: dict, lists: tuple, has_complex: bool, fused, foreach) -> None:
        beta1, beta2 = group["betas"]
        grad_scale = self._grad_scale_for(lists[1], fused)
        adam(*lists, amsgrad=group["amsgrad"], has_complex=has_complex, beta1=beta1, beta2=beta2,
             lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
             foreach=foreach, capturable=group["capturable"], differentiable=group["differentiable"],
             fused=fused, grad_scale=grad_scale, found_inf=getattr(self, "found_inf", None),
             decoupled_weight_decay=group["decoupled_weight_decay"])
