"""flashfsdp.checkpoint: a save interrupted at every step of its rename sequence loses nothing.

A crash is simulated by raising :class:`Crash` (a BaseException, which nothing in save handles) at
the k-th file-system step of rank 0's sequence (writing ``extra.pt`` / the marker, each rename,
each removal: a removal interrupted part-way has lost its marker). After each crash point,
``latest`` and ``load`` find the newest complete checkpoint, saying where; and the next save,
itself crashed at each of its steps, never removes the only complete copy (checked at every
removal) and, once it completes, leaves exactly one checkpoint directory.
"""

from __future__ import annotations

import os
import shutil
import warnings

from flashfsdp import checkpoint
from flashfsdp.checkpoint import atomic
from flashfsdp.checkpoint.marker import MARKER, complete_marker
from tests.checkpoint.common import assert_values, local_values, sharded_mlp


class Crash(BaseException):
    """The process dies here."""


class Faults:
    """Counts rank 0's file-system steps in ``atomic`` (writes, renames, removals of something) and
    crashes at step ``crash_at`` (None: never);
    every removal first checks that it does not remove the only complete copy of ``path``."""

    def __init__(self, monkeypatch, path: str, crash_at: int | None):
        self.path, self.crash_at, self.steps = path, crash_at, []
        for name in ("write_file", "_rename", "_remove"):
            monkeypatch.setattr(atomic, name, self._step(name, getattr(atomic, name)))

    def _step(self, name: str, real):
        def step(*args):
            if name == "_remove" and not os.path.lexists(args[0]):
                return real(*args)  # nothing to remove: not a step
            if name == "_remove" and complete_marker(args[0]) is not None:
                others = [d for d, _ in atomic.copies(self.path) if d != args[0]]
                assert others, f"removing {args[0]}, the only complete copy of {self.path}"
            self.steps.append((name, os.path.basename(args[0])))
            if len(self.steps) - 1 == self.crash_at:
                if name == "_remove" and os.path.isfile(os.path.join(args[0], MARKER)):
                    os.remove(os.path.join(args[0], MARKER))  # it died part-way through the removal
                raise Crash(f"crashed at {self.steps[-1]}")
            return real(*args)

        return step


def _crashed_save(monkeypatch, path: str, seed: int, step: int, crash_at: int | None) -> bool:
    """Save the MLP from ``seed`` as ``step``, crashing at step ``crash_at``; whether it crashed."""
    with monkeypatch.context() as patch:
        Faults(patch, path, crash_at)
        try:
            checkpoint.save(path, sharded_mlp(seed), step=step)
        except Crash:
            return True
    return False


def _newest(path: str) -> tuple[int, list[str]]:
    """(step loaded by ``load(path)``, the warnings it gave), checking the values too; and
    ``latest`` of the parent agrees."""
    model = sharded_mlp(seed=99)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step = checkpoint.load(path, model)["step"]
        found = checkpoint.latest(os.path.dirname(path))
    assert_values(model, local_values(sharded_mlp(seed=step)))  # saved from seed = step
    assert complete_marker(found)["step"] == step
    return step, [str(w.message) for w in caught]


def _sequence(monkeypatch, path: str) -> list:
    """The steps of an uninterrupted save over an existing checkpoint."""
    with monkeypatch.context() as patch:
        faults = Faults(patch, path, None)
        checkpoint.save(path, sharded_mlp(1), step=1)
    return faults.steps


def test_every_crash_point_of_save_keeps_the_newest_complete_checkpoint(tmp_path, monkeypatch):
    base = tmp_path / "base"
    path = str(base / "step")
    checkpoint.save(path, sharded_mlp(1), step=1)
    steps = _sequence(monkeypatch, path)
    assert ("write_file", MARKER) in steps and sum(name == "_rename" for name, _ in steps) == 2
    marker_written = steps.index(("write_file", MARKER))
    for k in range(len(steps)):
        shutil.rmtree(base)
        checkpoint.save(path, sharded_mlp(1), step=1)
        assert _crashed_save(monkeypatch, path, seed=2, step=2, crash_at=k)
        want = 2 if k > marker_written else 1
        step, said = _newest(path)
        assert step == want, (k, steps[k])
        source = [d for d, _ in atomic.copies(path)][0]
        if source != path:  # recovered from a hidden sibling: load and latest both say so, naming both
            assert len(said) == 2 and all(path in m and source in m and "interrupted" in m for m in said), said
        else:
            assert not said
        _next_save_crashed_anywhere(monkeypatch, tmp_path, base, path, want)


def _next_save_crashed_anywhere(monkeypatch, tmp_path, base, path: str, before: int) -> None:
    """From the state in ``base``: the next save (step 3) crashed at each of its steps keeps a
    complete copy (Faults checks every removal) of step ``before`` or 3; uninterrupted, it
    leaves ``path`` alone, holding step 3."""
    state = tmp_path / "state"
    shutil.rmtree(state, ignore_errors=True)
    shutil.copytree(base, state)
    j = 0
    while True:
        shutil.rmtree(base)
        shutil.copytree(state, base)
        if not _crashed_save(monkeypatch, path, seed=3, step=3, crash_at=j):
            break
        assert _newest(path)[0] in (before, 3), j
        j += 1
    assert _newest(path) == (3, [])
    assert os.listdir(base) == ["step"]
