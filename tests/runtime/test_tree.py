"""``runtime/tree.py``: the tensors inside forward inputs and outputs, found and replaced."""

from __future__ import annotations

import dataclasses
import gc
from collections import OrderedDict, namedtuple

import torch

from flashfsdp.runtime.tree import cast_floating, map_tensors, tensors_in

Pair = namedtuple("Pair", "first second")


@dataclasses.dataclass
class Activations:
    hidden: torch.Tensor
    extra: tuple


@dataclasses.dataclass(frozen=True)
class Frozen:
    value: torch.Tensor


def _nest():
    a, b, c, d, e = (torch.full((1,), float(i)) for i in range(5))
    shared = [c]
    tree = (a, {"x": Pair(b, shared), "y": shared}, Activations(d, (e, "text", 3)), OrderedDict(z=a))
    return tree, [a, b, c, d, e, a]


def test_tensors_are_found_depth_first_and_each_container_once():
    tree, want = _nest()
    got = tensors_in(tree)
    # depth first, in each container's order; the list held twice is walked once; a tensor
    # held in two places is listed each time it is met (containers are de-duplicated, not tensors)
    assert [id(t) for t in got] == [id(t) for t in want]


def test_a_self_containing_list_and_leaves_end_the_walk():
    x = torch.ones(1)
    loop = [x]
    loop.append(loop)
    assert tensors_in((loop, object(), "s", None, 3.0)) == [x]
    assert tensors_in(x) == [x]
    assert tensors_in({}) == []


def test_finding_tensors_leaves_no_garbage_for_the_collector():
    tree, _ = _nest()
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(10):
            tensors_in(tree)
        assert gc.collect() == 0, "tensors_in left reference cycles behind"
    finally:
        if was_enabled:
            gc.enable()


def test_map_tensors_rebuilds_only_what_changed_and_keeps_types():
    tree, _ = _nest()
    assert map_tensors(lambda t: t, tree) is tree
    doubled = map_tensors(lambda t: t * 2, tree)
    assert isinstance(doubled[1]["x"], Pair) and isinstance(doubled[2], Activations)
    assert isinstance(doubled[3], OrderedDict)
    # the shared list is rebuilt where each of its two holders is: two lists now
    assert [float(t) for t in tensors_in(doubled)] == [0.0, 2.0, 4.0, 4.0, 6.0, 8.0, 0.0]
    assert doubled[2].extra[1:] == ("text", 3)
    frozen = map_tensors(lambda t: t + 1, Frozen(torch.zeros(1)))
    assert isinstance(frozen, Frozen) and float(frozen.value) == 1.0


def test_cast_floating_casts_floating_tensors_only():
    f, i = torch.ones(2), torch.ones(2, dtype=torch.int64)
    out = cast_floating((f, i), torch.bfloat16)
    assert out[0].dtype == torch.bfloat16 and out[1] is i
    same = (torch.ones(1, dtype=torch.bfloat16),)
    assert cast_floating(same, torch.bfloat16) is same
