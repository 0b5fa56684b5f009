"""What torch's own code reads of an FSDP2 unit's state, answered for a flashfsdp unit.

torch's ``fully_shard`` is a composable API: ``torch.distributed.fsdp.fully_shard.state(module)``
gives the FSDP2 state of a module, and torch's own code reaches into it. Pipeline parallelism
(``torch.distributed.pipelining``) does, once the micro-batches of a schedule step are done
(``PipelineStage.perform_reduce_grad``, after ``set_is_last_backward(True)``,
``set_reshard_after_backward(True)`` and ``set_requires_gradient_sync(True)`` on the stage's
module)::

    state = fully_shard.state(stage.submod)
    for s in state._state_ctx.all_states:
        for group in s._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()

``fully_shard`` enters a :class:`TorchStateView` of each unit there (``_torch_private``'s
``set_composable_state``), so that these calls reach flashfsdp's step protocol. The names read
are ``_torch_private.PIPELINING_STATE_READS``; ``tests/test_torch_private.py`` checks them
against the installed torch's ``perform_reduce_grad``.

- ``group.post_backward()``: the unit's reduction now — what its micro-batches accumulated
  without gradient sync is reduce-scattered, in the bucket of the units reduced before it
  (``runtime/step.py``, [Note: buckets]) — and its reshard after backward, as when an autograd
  backward ends the unit (:meth:`FSDPState.run_post_backward`). Safe to call twice or on a unit
  whose backward did not run (nothing to reduce), as FSDP2's.
- ``_root_post_backward_final_callback()``: the end of a backward (``RootContext.end_backward``):
  the open bucket is issued, units still holding gradients reduce, and with the step's last
  backward every reduction finishes, so the optimizer reads finished gradients.

Every rank of a data-parallel group calls them in the same order (the states in module order),
so every rank issues the same collectives. Before the root's first forward (no lazy init yet)
``all_states`` is empty and the callback does nothing, as FSDP2's. The view holds no state of its
own: what it answers is read from the unit's :class:`~flashfsdp.bindings.state.FSDPState` at each
call.
"""

from __future__ import annotations


class ParamGroupView:
    """An FSDP2 ``FSDPParamGroup`` as torch's pipelining uses it: ``post_backward()`` only.

    Args:
        state: the unit's ``FSDPState``.
    """

    def __init__(self, state):
        self._state = state

    def __repr__(self) -> str:
        return f"ParamGroupView({self._state.unit.name!r})"

    def post_backward(self, *unused) -> None:
        """Reduce the unit's gradients and reshard it after backward now (see the module docstring)."""
        self._state.run_post_backward()


class StateContextView:
    """FSDP2's ``FSDPStateContext`` of a root: ``all_states`` (every unit under the root, as their
    :class:`TorchStateView`; empty before lazy init), ``is_last_backward``."""

    def __init__(self, state):
        self._state = state

    @property
    def all_states(self) -> list["TorchStateView"]:
        ctx = self._state.ctx
        return [] if ctx is None else [s.torch_state for s in ctx.states]

    @property
    def is_last_backward(self) -> bool:
        ctx = self._state.ctx
        return self._state.is_last_backward if ctx is None else ctx.step.is_last_backward


class TorchStateView:
    """What ``torch.distributed.fsdp.fully_shard.state(module)`` returns for a flashfsdp unit.

    Args:
        state: the unit's ``FSDPState`` (``flashfsdp.fully_shard.state(module)``).

    Attributes:
        _state_ctx: the root's context (:class:`StateContextView`).
        _fsdp_param_groups: one :class:`ParamGroupView` for a unit with parameters, none for a unit
            without (as FSDP2's).
    """

    def __init__(self, state):
        self._flashfsdp_state = state
        self._state_ctx = StateContextView(state)

    def __repr__(self) -> str:
        return f"TorchStateView({self._flashfsdp_state.unit.name!r})"

    @property
    def _fsdp_param_groups(self) -> list[ParamGroupView]:
        state = self._flashfsdp_state
        return [ParamGroupView(state)] if state.unit.param_slots else []

    def _root_post_backward_final_callback(self) -> None:
        """The end of a backward for every unit under this unit's root (see the module docstring)."""
        ctx = self._flashfsdp_state.ctx
        if ctx is not None:
            ctx.end_backward()


def install_torch_state(modules, state) -> None:
    """Make ``torch.distributed.fsdp.fully_shard.state(m)`` answer ``state``'s view for each of
    ``modules`` (the view is ``state.torch_state``)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard  # noqa: PLC0415

    from flashfsdp._torch_private import set_composable_state  # noqa: PLC0415

    state.torch_state = TorchStateView(state)
    for module in modules:
        set_composable_state(module, torch_fully_shard, state.torch_state)
