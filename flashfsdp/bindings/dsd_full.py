"""The stock full-state-dict getters of ``torch.distributed.checkpoint.state_dict`` (DSD), made exact.

``get_model_state_dict`` / ``get_optimizer_state_dict`` / ``get_state_dict`` with
``StateDictOptions(full_state_dict=True)`` call ``model.state_dict()`` / ``optimizer.state_dict()``
and then gather what they recognise as sharded: DTensors and ShardedTensors. A flashfsdp
:class:`~flashfsdp.bindings.sharded_tensor.ShardedPiece` is neither (a range of the flattened
parameter is no DTensor placement), so DSD would pass this rank's piece off as the full tensor.

So the state-dict hooks ask :func:`dsd_full_request` whether DSD's full getter is the caller
(it is on the call stack, with its options as ``info``), and if so hand DSD *full* tensors instead
of pieces: one all-gather per flat group (per state key for optimizer state) through the unit's own
communicator, unit by unit in module order (the same on every rank, since DSD calls
``state_dict()`` on every rank). DSD then keeps them (all ranks, or rank 0 with ``cpu_offload``),
exactly as it does with the full tensors it gathers from FSDP2's DTensors. With ``cpu_offload``
the gathered values go straight to the CPU, so the device holds one unit extra at a time.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
import torch.nn as nn

_DSD_MODULE = "torch.distributed.checkpoint.state_dict"


def dsd_full_request():
    """DSD's options (``info``) if its model or optimizer full-state-dict getter called us, else None.

    DSD's ``_get_model_state_dict`` / ``_get_optim_state_dict`` take their options as ``info``.
    Nothing is on the stack unless DSD has been imported. Should torch rename these internals,
    nothing is found and the hooks return pieces again (``tests/bindings/test_state_dict.py`` would
    fail on it).
    """
    dsd = sys.modules.get(_DSD_MODULE)
    if dsd is None:
        return None
    getters = set()
    for name in ("_get_model_state_dict", "_get_optim_state_dict"):
        fn = getattr(dsd, name, None)
        if fn is not None:
            getters.add(inspect.unwrap(fn).__code__)
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in getters:
            info = frame.f_locals.get("info")
            return info if getattr(info, "full_state_dict", False) is True else None
        frame = frame.f_back
    return None


def _target(info, device: torch.device) -> torch.device:
    return torch.device("cpu") if getattr(info, "cpu_offload", False) else device


def full_unit_params(state, info) -> dict[int, torch.Tensor]:
    """Unit parameter index -> its full value (collective over the unit's ranks)."""
    from .full_state_dict import gather_group  # noqa: PLC0415

    unit = state.unit
    by_group: dict[int, dict[int, int]] = {}
    for i, (group, pos) in enumerate(unit.param_slots):
        by_group.setdefault(id(group), {})[pos] = i
    out: dict[int, torch.Tensor] = {}
    for group in unit.groups:
        positions = by_group.get(id(group), {})
        fulls = gather_group(unit, group, group.sharded_flat, sorted(positions), _target(info, unit.device))
        for pos, tensor in fulls.items():
            out[positions[pos]] = tensor
    return out


def full_optimizer_state(state: dict, params: dict[Any, nn.Parameter], is_piece_state, info) -> dict:
    """``state`` (an optimizer state dict's ``state``) with every per-element state of a flashfsdp
    parameter replaced by its full tensor: one all-gather per (flat group, state key), groups in
    the optimizer's parameter order."""
    from .full_state_dict import gather_group  # noqa: PLC0415

    jobs: dict[tuple[int, str], list] = {}  # (id(group), key) -> [(param_id, param, value)]
    order: list[tuple[int, str]] = []
    for param_id, entries in state.items():
        param = params.get(param_id)
        if param is None or not hasattr(param, "_flashfsdp_piece") or not isinstance(entries, dict):
            continue
        for key, value in entries.items():
            if is_piece_state(value, param):
                job = (id(param._flashfsdp_group), key)
                if job not in jobs:
                    jobs[job] = []
                    order.append(job)
                jobs[job].append((param_id, param, value))
    out = {param_id: dict(entries) if isinstance(entries, dict) else entries for param_id, entries in state.items()}
    for job in order:
        members = jobs[job]
        param = members[0][1]
        group, unit = param._flashfsdp_group, param._flashfsdp_unit
        shard = torch.zeros(group.layout.shard_size, dtype=members[0][2].dtype, device=unit.device)
        positions = {}
        for param_id, p, value in members:
            pc = p._flashfsdp_piece
            shard[pc.shard_start : pc.shard_end].copy_(value.detach().reshape(-1))
            positions[pc.param_index] = param_id
        fulls = gather_group(unit, group, shard, sorted(positions), _target(info, unit.device))
        for pos, tensor in fulls.items():
            out[positions[pos]][job[1]] = tensor
    return out
