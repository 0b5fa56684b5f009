"""Which flat group (and unit) a sharded parameter belongs to, kept beside the parameter.

The optimizers, the clipping, the state dicts and the loss scaler need to know, for a DTensor
parameter they are given, the flat group whose shard its local tensor views and its index there.
That link is kept here, keyed by the parameter's identity, and not as attributes on the
parameter: a parameter must deep-copy and pickle as FSDP2's do (``copy.deepcopy(optimizer.state)``
copies its keys, the parameters; ``torch.save`` of a module pickles them), and attributes would
drag the unit, its communicator and its process group along — which cannot be pickled, and a copy
is no member of the unit anyway. Nothing refers to the parameter weakly either (``module.to``
swaps a DTensor parameter's contents with ``torch.utils.swap_tensors``, which refuses tensors
with weak references): an entry is valid while its group is alive and still holds that very
parameter at that index, and goes with the group.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class ParamTag:
    """A sharded parameter's place.

    Attributes:
        group: its flat group (``FlatParam``).
        index: its position in the group.
    """

    group: object
    index: int

    @property
    def unit(self):
        """The unit (``ShardedUnit``) that owns the group."""
        return self.group.unit

    @property
    def fqn(self) -> str:
        """The parameter's fully-qualified name."""
        return self.group.fqns[self.index]


_TAGS: dict[int, tuple[weakref.ref, int]] = {}  # id(param) -> (its group, weakly; its index)
_GROUP_REFS: dict[int, weakref.ref] = {}  # id(group) -> the weak reference its entries share


def _group_ref(group) -> weakref.ref:
    """One weak reference per group, whose callback drops the group's entries."""
    ref = _GROUP_REFS.get(id(group))
    if ref is None or ref() is not group:
        def forget(dead, key=id(group)):
            for param_key in [k for k, (r, _) in _TAGS.items() if r is dead]:
                del _TAGS[param_key]
            if _GROUP_REFS.get(key) is dead:
                del _GROUP_REFS[key]

        ref = _GROUP_REFS[id(group)] = weakref.ref(group, forget)
    return ref


def set_tag(param: torch.Tensor, group, index: int) -> None:
    """Record that ``param`` is parameter ``index`` of ``group`` (replacing an earlier record)."""
    _TAGS[id(param)] = (_group_ref(group), index)


def tag_of(param: object) -> ParamTag | None:
    """``param``'s record, or None if it is not a flashfsdp sharded parameter (a copy of one
    included)."""
    entry = _TAGS.get(id(param))
    if entry is None:
        return None
    group, index = entry[0](), entry[1]
    if group is None or index >= len(group.sharded_params) or group.sharded_params[index] is not param:
        return None
    return ParamTag(group, index)


def group_of(param: object):
    """The flat group of a sharded parameter, or None."""
    tag = tag_of(param)
    return None if tag is None else tag.group


def unit_of(param: object):
    """The unit of a sharded parameter, or None."""
    tag = tag_of(param)
    return None if tag is None else tag.group.unit
