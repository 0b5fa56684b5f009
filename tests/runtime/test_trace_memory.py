"""flashfsdp.profile() held open over many steps keeps bounded memory.

What the profile and the communicators' Work handles keep alive is counted by walking Python
references (deterministic: no RSS, no timing): after N and after 2N profiled steps, the profile
holds no tensor and no Work once the waits are over, and the Work handles still alive hold the
same bytes (a gradient shard per unit per step used to stay alive until the profile ended).
"""

from __future__ import annotations

import gc
import types

import torch

import flashfsdp
from flashfsdp.kernels.dispatch import use_backend
from flashfsdp.runtime.communicator import Work
from tests.harness import run_distributed
from tests.models import loss_fn, make_batch
from tests.runtime.test_trace import _UntimedCommunicator
from tests.training import local_rows, make_model, units_of

STEPS = 3  # N; the second count is taken after 2N


def held(roots) -> dict:
    """Tensors (count, storage bytes) and Work handles reachable from ``roots`` through Python
    references; the walk stops at tensors, types, modules and functions."""
    seen, storages, tensors, works = set(), {}, 0, 0
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (type, types.ModuleType, types.FunctionType)):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            tensors += 1
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
            continue
        works += issubclass(type(obj), Work)
        stack.extend(gc.get_referents(obj))
    return {"tensors": tensors, "bytes": sum(storages.values()), "works": works}


def live_works() -> list:
    gc.collect()
    return [obj for obj in gc.get_objects() if issubclass(type(obj), Work)]


def _profiled_counts(rank: int, world_size: int, communicator="auto", live: bool = True) -> dict:
    """One warm-up step, then 2N profiled steps of the MLP; what is held after N and after 2N (by
    the live Work handles too, if ``live``: a walk over every object, about a second)."""
    model = make_model("mlp")
    for unit in units_of("mlp", model):
        flashfsdp.fully_shard(unit, communicator=communicator)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)

    def step(i: int) -> None:
        x, y = make_batch("mlp", i, 2 * world_size)
        loss_fn("mlp", model(local_rows(x, rank, world_size)), local_rows(y, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()

    step(0)
    counts = []
    with flashfsdp.profile("cpu") as prof:
        for i in range(2 * STEPS):
            step(i + 1)
            if i + 1 in (STEPS, 2 * STEPS):
                counts.append({"profile": held([prof]), "works": held(live_works()) if live else None,
                               "spans": len(prof.spans)})
    return {"counts": counts, "inexact": prof.summary()["inexact_spans"]}


def test_profile_over_many_steps_holds_no_gradient_shards_at_w2():
    for r in run_distributed(_profiled_counts, 2, timeout=120):
        after_n, after_2n = r["counts"]
        assert after_2n["spans"] == 2 * after_n["spans"] > 0  # it did record every step
        for counts in (after_n, after_2n):
            assert counts["profile"] == {"tensors": 0, "bytes": 0, "works": 0}
        assert after_2n["works"]["bytes"] == after_n["works"]["bytes"]
        assert after_2n["works"]["works"] == after_n["works"]["works"]
        assert r["inexact"] == 0  # every gloo collective still ends at its completion


def test_untimed_works_are_bounded_and_let_go_at_the_next_step():
    """A Work that never reports its completion: the profile keeps it at most until the next step."""
    with use_backend("reference"):
        r = _profiled_counts(0, 1, communicator=_UntimedCommunicator(), live=False)
    after_n, after_2n = r["counts"]
    assert after_n["profile"]["tensors"] == after_2n["profile"]["tensors"] == 0
    assert 0 < after_2n["profile"]["works"] == after_n["profile"]["works"]  # the last step's only
    assert r["inexact"] > 0
