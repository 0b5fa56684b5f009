"""The step loop shared by the flat optimizers: plan runs per group (cached), step them, step the rest.

An optimizer class mixes :class:`FlatStepMixin` in before the torch optimizer it extends and
implements ``_age(param)`` (the state age that members of one run must share),
``_build_plan(group, plan)`` (state entries as flat views, the argument lists of its functional
step, recorded in the :class:`GroupPlan`) and ``_run_plan(group, plan)`` (one step of the group).
Everything else (constructor, ``param_groups``, ``state``, ``state_dict``, hooks) is torch's.

A group's plan is kept while its parameters and their gradients stay where they were (the
gradient shards of a unit are freed by ``zero_grad`` and allocated again, usually elsewhere: then
the plan is made again), its flags are unchanged, every state tensor the plan steps is still the
one in ``state`` and ``load_state_dict`` was not called. Checking that costs a few pointer reads
per parameter; planning costs much more (see ``runtime/flat_runs.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from flashfsdp.runtime.extensions import refuse_subclass_params
from flashfsdp.runtime.param_tags import tag_of

from flashfsdp.runtime.flat_runs import FlatStates, Run, plan_runs, signature


@dataclass
class GroupPlan:
    """One optimizer group's cached step: its runs, the rest, the state tensors it steps.

    Attributes:
        key: the signature and flags it was made for.
        runs: flat runs; ``rest``: parameters stepped one by one as torch steps them.
        checks: (param, state key, tensor) for every state tensor the runs step.
        args: the optimizer's own prepared arguments.
        stale: set by a step after which the plan must be made again (an age changed apart).
    """

    key: tuple
    runs: list[Run]
    rest: list[torch.Tensor]
    checks: list[tuple[torch.Tensor, str, torch.Tensor]] = field(default_factory=list)
    args: dict[str, Any] = field(default_factory=dict)
    stale: bool = False


class FlatStepMixin:
    """Step each optimizer group's flashfsdp pieces as flat runs (see ``runtime/flat_runs.py``)."""

    _PLAN_FLAGS = ("differentiable", "fused", "foreach", "capturable")

    def _cache(self, name: str, factory):
        value = self.__dict__.get(name)
        if value is None:
            value = self.__dict__[name] = factory()
        return value

    def _flat_states(self) -> FlatStates:
        return self._cache("_flashfsdp_flat_states", FlatStates)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``; the loaded tensors are copied into the flat state buffers
        at the next step (the state stays per parameter, as saved)."""
        super().load_state_dict(state_dict)
        self._forget()

    def _plan_flags(self, group: dict) -> tuple:
        """The group settings besides ``_PLAN_FLAGS`` that change which state a plan holds."""
        return ()

    def _forget(self) -> None:
        """Drop cached plans and ages (state was replaced from outside)."""
        self._cache("_flashfsdp_plans", dict).clear()

    def _check_params(self, index: int, group: dict) -> None:
        """Refuse (once per parameter list) a parameter kept outside its unit's flat shard.

        Raises:
            NotImplementedError: a tensor-subclass parameter with FSDP2's all-gather extensions.
        """
        checked = self._cache("_flashfsdp_checked", dict)
        params = group["params"]
        if checked.get(index) != (id(params), len(params)):
            groups = {id(t.group): t.group for t in map(tag_of, params) if t is not None}
            refuse_subclass_params(groups.values(), f"{type(self).__name__} (flashfsdp.optim)",
                                   "step it with a torch.optim optimizer (e.g. torch.optim.AdamW)")
            checked[index] = (id(params), len(params))

    def _plan(self, index: int, group: dict) -> GroupPlan:
        self._check_params(index, group)
        plans = self._cache("_flashfsdp_plans", dict)
        key = (signature(group["params"]), *(group.get(f) for f in self._PLAN_FLAGS), *self._plan_flags(group))
        plan = plans.get(index)
        state = self.state
        if (plan is not None and not plan.stale and plan.key == key
                and all(state.get(p, {}).get(k) is t for p, k, t in plan.checks)):
            return plan
        states = self._flat_states()
        if states.cover([p for g in self.param_groups for p in g["params"]]):
            plans.clear()  # new segments: the other groups' plans step the buffers they left
        with_grad = [p for p in group["params"] if p.grad is not None]
        runs, rest = ([], with_grad) if group.get("differentiable") else plan_runs(with_grad, self._age)
        plan = plans[index] = GroupPlan(key, runs, rest)
        if runs:
            self._build_plan(group, plan)
        return plan

    def _flat_step(self, closure: Callable[[], torch.Tensor] | None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        plans = self._cache("_flashfsdp_plans", dict)
        for index in [i for i in plans if i >= len(self.param_groups)]:
            del plans[index]
        for index, group in enumerate(self.param_groups):
            plan = self._plan(index, group)
            if plan.runs or plan.rest:
                self._run_plan(group, plan)
        return loss

    @staticmethod
    def _uses_fused(group: dict, runs) -> bool:
        """Whether the runs of ``group`` go through torch's fused kernels: unless ``fused=False``
        was asked, on CPU and CUDA (torch 2.13 has fused AdamW and SGD kernels on both)."""
        if group["fused"] is False or not runs:
            return False
        return all(r.flat.device.type in ("cpu", "cuda") for r in runs)
