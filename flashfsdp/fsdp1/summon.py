"""``summon_full_params``: a wrapper's full parameters inside a context, written back on exit.

Each unit's master shards (original dtype, not ``param_dtype``) are all-gathered into one
W·S-element buffer per flat group (``runtime.full_values.gather_flat``, one collective per group) and
copied out into one buffer of the unsharded layout; the module's registrations then hold
full-shape parameters that are views into it (on the CPU with ``offload_to_cpu``), so changes to
them land in the buffer. On exit, with ``writeback``, this rank's rows of each parameter are
copied back into the shards; the registrations get back what they held. With ``rank0_only`` the other ranks take part in the all-gathers and keep their shards.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn as nn

from flashfsdp.runtime.agreement import global_rank
from flashfsdp.runtime.extensions import refuse_subclass_params
from flashfsdp.runtime.flat_param import shards_written
from flashfsdp.runtime.full_values import gather_flat, gathered_to_unsharded, unsharded_to_local
from flashfsdp.runtime.init_window import close_init_windows
from flashfsdp.runtime.states import TrainingState

_active: set[int] = set()  # ids of the unit states whose parameters are summoned now


def summoning() -> bool:
    """Whether some unit's full parameters are summoned now."""
    return bool(_active)


def check_args(wrapper, writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool) -> None:
    """FSDP1's ``_validate_unshard_params_args``.

    Raises:
        NotImplementedError: ``with_grads`` with ``use_orig_params=False`` or ``offload_to_cpu``;
            ``writeback`` with ``rank0_only`` (the other ranks hold no full parameters to write).
    """
    if with_grads and (offload_to_cpu or not wrapper._fsdp_use_orig_params):
        raise NotImplementedError(f"summon_full_params: with_grads=True needs use_orig_params=True and "
                                  f"offload_to_cpu=False (got use_orig_params={wrapper._fsdp_use_orig_params}, "
                                  f"offload_to_cpu={offload_to_cpu}), as in FSDP1")
    if writeback and rank0_only:
        raise NotImplementedError("summon_full_params: writeback=True and rank0_only=True is not supported: "
                                  "only rank 0 would hold full parameters to write back; pass writeback=False")
    if offload_to_cpu and not rank0_only:
        warnings.warn("summon_full_params: offload_to_cpu=True and rank0_only=False copies the full parameters to CPU "
                      "memory on every rank; offload_to_cpu=True with rank0_only=True is recommended", stacklevel=4)


def _check_idle(state, where: str) -> None:
    root = state.ctx.root if state.ctx is not None else None
    for s in (state, root):
        if s is not None and s.training_state is not TrainingState.IDLE:
            raise RuntimeError(f"{where}: cannot summon full parameters during forward/backward (unit "
                               f"'{s.unit.name}' is in {s.training_state.value}); call it outside forward/backward")


@contextlib.contextmanager
def summon_state(state, writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool):
    """The full parameters of one unit (``state``: its FSDPState) for the duration of the context.

    Raises:
        RuntimeError: during forward/backward.
        NotImplementedError: a parameter of the unit is a tensor subclass with FSDP2's all-gather
            extensions (kept outside the flat shard that is gathered here).
    """
    _check_idle(state, "summon_full_params")
    if id(state) in _active:  # an enclosing summon holds them already
        yield
        return
    refuse_subclass_params(state.unit.groups, "summon_full_params",
                           "read it with param.full_tensor(), or keep it a plain tensor")
    close_init_windows()
    keep = not rank0_only or global_rank() == 0
    target = torch.device("cpu") if offload_to_cpu else state.unit.device
    buffers, fulls = {}, []
    for i, regs in enumerate(state.registrations):
        group, pos = state.unit.param_slots[i]
        if id(group) not in buffers:
            buffers[id(group)] = _gather(state.unit, group, group.sharded_flat, target if keep else None)
        sharded = state.unit.sharded_param(i)
        if not keep:
            fulls.append(None)
            continue
        full = nn.Parameter(group.unsharded_views(buffers[id(group)])[pos].view(group.shapes[pos]),
                            requires_grad=sharded.requires_grad)
        if with_grads and sharded.grad is not None:
            key = ("grad", id(group))
            if key not in buffers:
                buffers[key] = _gather(state.unit, group, group.sharded_grad, target)
            full.grad = group.unsharded_views(buffers[key])[pos].view(group.shapes[pos])
        fulls.append(full)
    saved = [[mod._parameters[name] for mod, name in regs] for regs in state.registrations]
    _install(state, fulls)
    _active.add(id(state))
    try:
        yield
    finally:
        _active.discard(id(state))
        _restore(state, saved)
        if writeback and keep:
            _write_back(state, buffers)


def _gather(unit, group, shard: torch.Tensor, target: torch.device | None) -> torch.Tensor | None:
    """``shard`` (laid out like ``group``'s shard) of every rank, in the unsharded layout on ``target``."""
    full = torch.empty(group.layout.gathered_size, dtype=shard.dtype, device=unit.device)
    gather_flat(unit, group, shard, full)
    return None if target is None else gathered_to_unsharded(group, full).to(target)


def _install(state, fulls: list) -> None:
    for full, regs in zip(fulls, state.registrations):
        if full is not None:
            for mod, name in regs:
                mod._parameters[name] = full


def _restore(state, saved: list) -> None:
    for params, regs in zip(saved, state.registrations):
        for param, (mod, name) in zip(params, regs):
            mod._parameters[name] = param


@torch.no_grad()
def _write_back(state, buffers: dict) -> None:
    """Copy this rank's rows of each summoned parameter into its group's master shard."""
    for group in state.unit.groups:
        flat = buffers.get(id(group))
        if flat is not None:
            unsharded_to_local(group, flat.to(group.sharded_flat.device), group.sharded_flat)
    shards_written()
