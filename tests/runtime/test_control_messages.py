"""Control messages between ranks are data, never code: JSON with tagged containers
(``control.encode`` / ``control.decode``), and no unpickling of bytes from another process
anywhere in the library (``all_gather_object`` and friends included)."""

from __future__ import annotations

import ast
import os
import pickle

import pytest
import torch

from flashfsdp.runtime import agreement, control
from flashfsdp_dev.ranks import single_process_group

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# torch.distributed's object collectives unpickle what the other processes sent
OBJECT_COLLECTIVES = {"all_gather_object", "broadcast_object_list", "gather_object", "scatter_object_list",
                      "recv_object_list", "send_object_list", "_tensor_to_object"}


def test_values_round_trip_with_their_types():
    value = (None, True, 3, -2.5, "rank 1", b"\x00\xff", [1, (2, 3)], {"a": [None], 4: {"b": b""}, (1, 2): 0})
    assert control.decode(control.encode(value)) == value
    assert type(control.decode(control.encode((1,)))) is tuple and type(control.decode(control.encode([1]))) is list


def test_anything_else_is_refused_before_sending():
    for bad in (torch.ones(1), {1, 2}, object(), 1j):
        with pytest.raises(TypeError, match="a control message holds None, bool, int"):
            control.encode(bad)


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


@pytest.mark.parametrize("data", [pickle.dumps(_Boom()), b"{\"x\": 1}", b"[1, 2]", b"{\"b\": \"***\"}",
                                  b"{\"d\": [[{\"l\": []}, 1]]}", b"[" * 100000])
def test_bytes_that_are_not_a_message_are_refused(data):
    with pytest.raises(ValueError, match="not a control message"):
        control.decode(data)


def test_values_and_states_between_ranks_without_pickle():
    with single_process_group():
        assert agreement.all_gather_values({"out": "runs/a", "resume": None}) == [{"out": "runs/a", "resume": None}]
        assert agreement.broadcast_value(("lock", 3)) == ("lock", 3)
        state = {"state": {0: {"step": torch.tensor(2.0), "exp_avg": torch.ones(3)}}, "param_groups": [{"lr": 0.1}]}
        assert agreement.broadcast_state(state) is state


def _calls(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            owner = getattr(func.value, "id", None) if isinstance(func, ast.Attribute) else None
            yield node.lineno, owner, name


def test_no_unpickling_of_what_another_process_sent_in_the_library():
    found = []
    for package in ("flashfsdp", "flashfsdp_cli"):
        for folder, _, files in os.walk(os.path.join(ROOT, package)):
            for file in files:
                if not file.endswith(".py"):
                    continue
                path = os.path.join(folder, file)
                with open(path, encoding="utf-8") as f:
                    tree = ast.parse(f.read())
                for line, owner, name in _calls(tree):
                    if (owner == "pickle" and name in ("loads", "load", "Unpickler")) or name in OBJECT_COLLECTIVES:
                        found.append(f"{os.path.relpath(path, ROOT)}:{line}: {owner}.{name}")
    assert found == []
