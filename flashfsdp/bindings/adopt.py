"""A unit takes back parameters that were changed behind its back, and checks it is materialised.

``nn.Module._apply`` (``model.to(torch.float64)``, ``to_empty``), ``load_state_dict(assign=True)``
and a plain assignment (``module.weight = nn.Parameter(...)``) replace what a module holds for a
unit's parameter; the unit must take the new values into its flat storage (``ShardedUnit.adopt``)
or the optimizer and the all-gather would see different storage. Each function takes the unit's
``FSDPState`` (``self``).
"""

from __future__ import annotations

import operator

from flashfsdp.runtime.comm_factory import communicator_for
from flashfsdp.runtime.communicator import Communicator
from flashfsdp.runtime.init_window import open_init_window



def adopt_replaced_params(self: "FSDPState") -> None:
    """A parameter assigned after ``fully_shard`` (``module.weight = nn.Parameter(full)``)
    replaces the unit's piece: take this rank's range of it into the flat storage before the
    all-gather reads the shard (FSDP2 re-reads its parameters at lazy init). An all-gather
    already issued (prefetch) read the old values: it is dropped and issued again."""
    if self.holds_unsharded:
        return
    # what each parameter's first registration holds against the unit's sharded parameter, compared
    # by identity in one pass in C (this runs at every forward of every unit)
    dicts, names, groups, positions = _registration_columns(self)
    held = map(dict.get, dicts, names)
    mine = map(operator.getitem, map(_SHARDED_PARAMS, groups), positions)
    if all(map(operator.is_, held, mine)):
        return
    self.unit.reshard()
    adopt_module_params(self)


_SHARDED_PARAMS = operator.attrgetter("sharded_params")


def _registration_columns(self: "FSDPState") -> tuple:
    """Per parameter: the ``_parameters`` dict and name of its first registration, its group and
    position there (kept on the state; the dicts are the modules' own, which ``nn.Module`` keeps)."""
    columns = self.__dict__.get("_registration_columns")
    if columns is None or columns[4] is not self.unit.param_slots:
        firsts = [regs[0] for regs in self.registrations]
        columns = self._registration_columns = (
            [m._parameters for m, _ in firsts], [n for _, n in firsts],
            [g for g, _ in self.unit.param_slots], [pos for _, pos in self.unit.param_slots], self.unit.param_slots)
    return columns[:4]


def adopt_module_params(self: "FSDPState") -> None:
    """After ``module.to(...)`` / ``to_empty`` (FSDPModule._apply): take the converted pieces
    back into the flat storage (see ``ShardedUnit.adopt``), re-register them everywhere, and
    follow a meta-device unit to the device it was materialised on; there, with
    ``set_unsharded_init`` on, its parameters enter the init window (``runtime/init_window.py``),
    else they stay FSDP2's DTensors, initialised by DTensor's own (per-shard) random ops."""
    registered = [regs[0][0]._parameters[regs[0][1]] for regs in self.registrations]
    was_meta, old_device = self.unit.device.type == "meta", self.unit.device
    offload = any(g.offload for g in self.unit.groups)
    pieces_device = next((p.device for p in registered if p.device.type != "meta"), None)
    device = self.compute_device if (was_meta or offload) and pieces_device is not None else None
    if offload and pieces_device is not None and pieces_device.type not in ("cpu", "meta"):
        device = pieces_device  # module.to("cuda") of an offloaded unit: compute there
    if not self.unit.adopt(registered, device):
        return
    for i, regs in enumerate(self.registrations):
        for mod, name in regs:
            mod._parameters[name] = self.unit.sharded_param(i)
    self._tracked_requires_grad = None
    if self.unit.device != old_device:
        _rebuild_communicator(self)
    if was_meta and self.unit.device.type != "meta" and self.unsharded_init:
        open_init_window([p for g in self.unit.groups for p in g.sharded_params])


def _rebuild_communicator(self: "FSDPState") -> None:
    """The communicator for the device a meta-device unit now lives on (unless one was given)."""
    group, kind = self.comm_spec or (None, "auto")
    if isinstance(kind, Communicator):
        return
    comm = communicator_for(group, kind, self.unit.device)
    if (comm.world_size, comm.rank) != (self.unit.comm.world_size, self.unit.comm.rank):
        raise RuntimeError(f"unit '{self.unit.name}': its communicator changed world size or rank on materialisation")
    self.unit.comm = comm


def check_materialised(self: "FSDPState") -> None:
    """Raises RuntimeError, naming the parameters, if the unit is still on the meta device."""
    if self.unit.device.type == "meta":
        names = [fqn for g in self.unit.groups for fqn in g.fqns]
        raise RuntimeError(
            f"fully_shard'ed module '{self.unit.name}' runs forward with parameters on the meta device "
            f"({', '.join(names[:8])}{' ...' if len(names) > 8 else ''}): materialise them first with "
            f"module.to_empty(device=...) and initialise them (reset_parameters / init_weights) or load a "
            f"checkpoint into them")
