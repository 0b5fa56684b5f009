"""Finding and replacing the tensors inside forward inputs and outputs.

Module inputs and outputs are arbitrary nests: tuples, lists, dicts (also ``OrderedDict`` and
Hugging Face's ``ModelOutput``), named tuples, dataclasses, and types registered with
``torch.utils._pytree``. Both functions here walk all of them — FSDP2 walks the same kinds
(``torch.distributed.utils._apply_to_tensors``) — so that a dataclass of activations gets its
backward hooks and its casts like a tuple would.

Anything else is a leaf: an object that is none of these kinds is not searched for tensors (an
arbitrary object's attributes may lead anywhere, e.g. back to the model).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any, Callable

import torch

from flashfsdp._torch_private import pytree


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """Every tensor in ``tree`` (depth first, each object once), in a deterministic order.

    A loop over an explicit stack, not a nested recursive function: such a function refers to
    itself through its closure, so every call would leave a reference cycle for the garbage
    collector (this runs twice per unit and step; the cycles made a collection of the young
    generation, about 1-2 ms on a CPU, happen at nearly every step)."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            found.append(x)
            continue
        if id(x) in seen:
            continue
        seen.add(id(x))
        children = _children(x)
        children.reverse()
        stack.extend(children)
    return found


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], tree: Any) -> Any:
    """``tree`` with every tensor ``t`` replaced by ``fn(t)``.

    Containers are rebuilt only where a tensor inside them changed (``fn`` returned another
    object); otherwise the original object is returned, so that identity is kept when nothing is
    cast. Dataclasses and ``Mapping`` subclasses are shallow-copied and their changed fields or
    entries set, which keeps their type (and ``ModelOutput``'s key/attribute pairing).
    """
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        changes = {}
        for f in dataclasses.fields(tree):
            old = getattr(tree, f.name)
            new = map_tensors(fn, old)
            if new is not old:
                changes[f.name] = new
        if not changes:
            return tree
        out = copy.copy(tree)
        for name, value in changes.items():
            try:
                setattr(out, name, value)
            except dataclasses.FrozenInstanceError:
                object.__setattr__(out, name, value)
        return out
    if isinstance(tree, Mapping):
        changes = {}
        for key, old in tree.items():
            new = map_tensors(fn, old)
            if new is not old:
                changes[key] = new
        if not changes:
            return tree
        try:
            out = copy.copy(tree)
            for key, value in changes.items():
                out[key] = value
            return out
        except TypeError:  # an immutable mapping
            return {**tree, **changes}
    if isinstance(tree, (tuple, list)):
        new_items = [map_tensors(fn, x) for x in tree]
        if all(n is o for n, o in zip(new_items, tree)):
            return tree
        if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # a named tuple
            return type(tree)(*new_items)
        try:
            return type(tree)(new_items)
        except TypeError:
            return tuple(new_items) if isinstance(tree, tuple) else new_items
    if _is_pytree_node(tree):
        leaves, spec = pytree.tree_flatten(tree)
        new_leaves = [map_tensors(fn, x) for x in leaves]
        if all(n is o for n, o in zip(new_leaves, leaves)):
            return tree
        return pytree.tree_unflatten(new_leaves, spec)
    return tree


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor of another dtype cast to ``dtype`` (the rest as it
    is; containers rebuilt only where something was cast, as :func:`map_tensors` does)."""
    return map_tensors(lambda x: x.to(dtype) if x.is_floating_point() and x.dtype != dtype else x, tree)


def _children(x: Any) -> list:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return [getattr(x, f.name) for f in dataclasses.fields(x)]
    if isinstance(x, Mapping):
        return list(x.values())
    if isinstance(x, (tuple, list, set, frozenset)):
        return list(x)
    if _is_pytree_node(x):
        return pytree.tree_flatten(x)[0]
    return []


def _is_pytree_node(x: Any) -> bool:
    """A type registered with torch's pytree (other than the built-in containers handled above)."""
    return type(x) in pytree.SUPPORTED_NODES and not isinstance(x, (tuple, list, dict))
