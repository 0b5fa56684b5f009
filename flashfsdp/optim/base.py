"""The step loop shared by the flat optimizers: plan runs per group, step them, step the rest.

An optimizer class mixes :class:`FlatStepMixin` in before the torch optimizer it extends and
implements ``_step_group(group, runs, rest)`` (one group: the runs as flat tensors, the rest as
torch steps them) and ``_age(param)`` (the state age that members of one run must share).
Everything else (constructor, ``param_groups``, ``state``, ``state_dict``, hooks) is torch's.
"""

from __future__ import annotations

from typing import Callable

import torch

from .runs import FlatStates, plan_runs


class FlatStepMixin:
    """Step each optimizer group's flashfsdp pieces as flat runs (see ``runs.py``)."""

    def _flat_states(self) -> FlatStates:
        states = self.__dict__.get("_flashfsdp_flat_states")
        if states is None:
            states = self.__dict__["_flashfsdp_flat_states"] = FlatStates()
        return states

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's ``load_state_dict``; the loaded tensors are copied into the flat state buffers
        at the next step (the state stays per parameter, as saved)."""
        super().load_state_dict(state_dict)
        self._forget_ages()

    def _forget_ages(self) -> None:
        """Drop cached state ages (state was replaced from outside)."""

    def _flat_step(self, closure: Callable[[], torch.Tensor] | None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        all_runs = []
        for group in self.param_groups:
            with_grad = [p for p in group["params"] if p.grad is not None]
            if group.get("differentiable"):
                runs, rest = [], with_grad
            else:
                runs, rest = plan_runs(with_grad, self._age)
            if runs or rest:
                self._step_group(group, runs, rest)
            all_runs += runs
        self._flat_states().retain(all_runs)
        return loss

    @staticmethod
    def _uses_fused(group: dict, runs) -> bool:
        """Whether the runs of ``group`` go through torch's fused kernels: unless ``fused=False``
        was asked, on CPU and CUDA (torch 2.13 has fused AdamW and SGD kernels on both)."""
        if group["fused"] is False or not runs:
            return False
        return all(r.flat.device.type in ("cpu", "cuda") for r in runs)
