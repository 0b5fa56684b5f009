"""Run many multi-rank cases in few process groups, each case against both implementations.

The ported FSDP2 suite has well over a hundred (case, implementation) pairs; spawning W fresh
processes for each would cost minutes of interpreter start-up alone. So a test module declares its
cases with :meth:`CaseSet.case`, and the first pytest test of a (module, world size) pair runs every
case of that pair, for ``torch`` and for ``flashfsdp``, in one set of W gloo ranks
(``flashfsdp_dev.ranks.spawn_ranks``, one intra-op thread each, the reference kernels), one after
another. Each case starts from the same seed whatever ran before it. The ranks are forked from a
server that imported torch and flashfsdp once (``tests.harness.start_method``).

A case that raises on one rank leaves the other ranks inside collectives that will never match, so
the rank that failed records its traceback and exits at once; the ranks that remain are killed,
and the remaining cases run in a fresh set of processes. Each (case, implementation) pair is then
one pytest test: it fails with the rank's traceback, and the ``flashfsdp`` test also compares what
the case returned with what the ``torch`` run of the same case returned (see :meth:`CaseSet.case`),
and the types the case logged (``Impl.record_types``: every parity check's parameter and gradient
types, placements and shapes, and the state-dict value types cases record) with torch's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
import tempfile
import traceback
from typing import Callable

import pytest
import torch
import torch.distributed as dist

from flashfsdp_dev.ranks import RanksFailed, spawn_ranks
from flashfsdp.bindings.root import BUCKET_BYTES_ENV
from tests.harness import start_method

IMPLS = ("torch", "flashfsdp")
_TIMEOUT_S = 300.0


@dataclasses.dataclass(frozen=True)
class Case:
    """One ported upstream case.

    Attributes:
        fn: ``fn(rank, world_size, impl) -> result`` (``impl``: a ``tests.fsdp2_suite.common.Impl``).
        world_size: W.
        impls: the implementations it runs against.
        compare: compare the ``flashfsdp`` result with the ``torch`` one (``torch.testing.assert_close``
            on the returned tree, at ``rtol``/``atol``).
        torch_reason: why torch's own ``fully_shard`` is not run (empty if it is).
        per_unit_collectives: the case counts collectives or orders unshards as FSDP2 issues them,
            one unit at a time: flashfsdp runs it with buckets off (``FLASHFSDP_BUCKET_BYTES=0``;
            units that share collectives issue fewer, see ``tests/bindings/test_buckets.py``).
    """

    fn: Callable
    world_size: int
    impls: tuple[str, ...]
    compare: bool
    rtol: float
    atol: float
    torch_reason: str = ""
    per_unit_collectives: bool = False

    @property
    def name(self) -> str:
        return self.fn.__name__


class CaseSet:
    """The cases of one test module; ``pytest_tests()`` turns them into parametrized tests."""

    def __init__(self, module_name: str):
        self.module_name = module_name
        self.cases: dict[str, Case] = {}
        self._results: dict[int, dict[tuple[str, str], dict]] = {}

    def case(self, world_size: int = 2, *, compare: bool = True, rtol: float = 1e-5, atol: float = 1e-6,
             torch_reason: str = "", per_unit_collectives: bool = False):
        """Register ``fn(rank, world_size, impl)`` as a case run at ``world_size`` ranks.

        ``torch_reason``: run only against flashfsdp, because torch's ``fully_shard`` cannot run this
        case (the reason is shown as the torch test's skip reason). The result ``fn`` returns on each
        rank (tensors, numbers, and lists/tuples/dicts of them) is compared between the two
        implementations when ``compare`` is set. ``per_unit_collectives``: see :class:`Case`.
        """

        def register(fn):
            impls = ("flashfsdp",) if torch_reason else IMPLS
            self.cases[fn.__name__] = Case(fn, world_size, impls, compare and not torch_reason, rtol, atol,
                                           torch_reason, per_unit_collectives)
            return fn

        return register

    def pytest_tests(self):
        """A pytest test function parametrized over (case, implementation)."""
        params = [
            pytest.param(name, impl, id=f"{name}-{impl}")
            for name in self.cases for impl in IMPLS
        ]

        @pytest.mark.parametrize("case_name, impl", params)
        def test_case(case_name: str, impl: str) -> None:
            case = self.cases[case_name]
            if impl not in case.impls:
                pytest.skip(f"torch's fully_shard: {case.torch_reason}")
            outcome = self._outcome(case, impl)
            if "error" in outcome:
                pytest.fail(outcome["error"], pytrace=False)
            if impl == "flashfsdp" and case.compare:
                want = self._outcome(case, "torch")
                if "error" in want:
                    pytest.fail(f"torch's fully_shard failed this case, so there is nothing to compare:\n"
                                f"{want['error']}", pytrace=False)
                for rank, (got, exp) in enumerate(zip(outcome["results"], want["results"])):
                    torch.testing.assert_close(
                        got, exp, rtol=case.rtol, atol=case.atol,
                        msg=lambda m, rank=rank: f"flashfsdp vs torch fully_shard, rank {rank}: {m}")
            if impl == "flashfsdp" and "torch" in case.impls:
                want = self._outcome(case, "torch")
                if "error" not in want:
                    for rank, (got, exp) in enumerate(zip(outcome["types"], want["types"])):
                        _assert_same_types(got, exp, rank)

        return test_case

    def _outcome(self, case: Case, impl: str) -> dict:
        results = self._results.get(case.world_size)
        if results is None:
            jobs = [(c.name, i) for c in self.cases.values() if c.world_size == case.world_size for i in c.impls]
            results = self._results[case.world_size] = run_cases(self.module_name, jobs, case.world_size)
        return results[(case.name, impl)]


def _assert_same_types(got: list, want: list, rank: int) -> None:
    """flashfsdp's logged types (``Impl.record_types``) equal torch's, entry by entry."""
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"flashfsdp vs torch fully_shard, rank {rank}, types of {w[0]!r}: {g[1]} vs torch's {w[1]}"
    assert len(got) == len(want), (f"flashfsdp vs torch fully_shard, rank {rank}: {len(got)} type records vs "
                                   f"torch's {len(want)} (first extra: {(got + want)[min(len(got), len(want))]})")


def run_cases(module_name: str, jobs: list[tuple[str, str]], world_size: int) -> dict[tuple[str, str], dict]:
    """Run ``jobs`` ((case name, impl) pairs of ``module_name``'s CaseSet) on ``world_size`` ranks.

    Returns per job ``{"results": [result of rank 0, ...]}`` or ``{"error": text}``.
    """
    outcomes: dict[tuple[str, str], dict] = {}
    start = 0
    while start < len(jobs):
        with tempfile.TemporaryDirectory() as tmp:
            _spawn(module_name, jobs[start:], world_size, tmp)
            done = start
            for index, job in enumerate(jobs[start:], start):
                per_rank = [_load(tmp, rank, index - start) for rank in range(world_size)]
                if all(r is not None and "ok" in r for r in per_rank):
                    outcomes[job] = {"results": [r["ok"] for r in per_rank],
                                     "types": [r.get("types", []) for r in per_rank]}
                    done = index + 1
                    continue
                errors = [f"--- rank {rank} ---\n{r['error']}" for rank, r in enumerate(per_rank)
                          if r is not None and "error" in r]
                outcomes[job] = {"error": "\n".join(errors) or
                                 f"case {job[0]} [{job[1]}]: a rank died or hung without a traceback"}
                done = index + 1
                break
            start = done
    return outcomes


def _save(obj: dict, path: str) -> None:
    """Write ``obj`` whole or not at all: a rank killed while writing (its peer failed a case and
    the parent stops every rank) leaves no truncated file behind."""
    torch.save(obj, path + ".part")
    os.replace(path + ".part", path)


def _load(tmp: str, rank: int, index: int):
    path = os.path.join(tmp, f"rank{rank}-{index}.pt")
    return torch.load(path, weights_only=False) if os.path.exists(path) else None


def _spawn(module_name: str, jobs: list[tuple[str, str]], world_size: int, tmp: str) -> None:
    """Run ``jobs`` on one set of ranks until one fails or hangs; what each rank finished is in ``tmp``."""
    try:
        spawn_ranks(_run_jobs, world_size, (module_name, jobs, tmp), threads=1, kernels="reference",
                    timeout=_TIMEOUT_S, start_method=start_method())
    except (RanksFailed, TimeoutError):
        pass  # a case failed on some rank (its traceback is on disk) or hung: the ranks are gone


def _run_jobs(rank: int, world_size: int, module_name: str, jobs, tmp: str) -> None:
    from .common import impl_named  # noqa: PLC0415

    cases: CaseSet = importlib.import_module(module_name).cases
    for index, (name, impl) in enumerate(jobs):
        path = os.path.join(tmp, f"rank{rank}-{index}.pt")
        try:
            torch.manual_seed(0)
            impl_obj = impl_named(impl)
            impl_obj.take_type_log()
            with _per_unit_collectives(cases.cases[name].per_unit_collectives):
                result = cases.cases[name].fn(rank, world_size, impl_obj)
            _save({"ok": result, "types": impl_obj.take_type_log()}, path)
            dist.barrier()
        except BaseException:
            _save({"error": traceback.format_exc()}, path)
            os._exit(1)  # the other ranks may be inside a collective: do not try to resume


@contextlib.contextmanager
def _per_unit_collectives(enabled: bool):
    """Inside the block, flashfsdp roots initialised without ``set_bucket_bytes`` give every unit its
    own collectives (``FLASHFSDP_BUCKET_BYTES=0``), when ``enabled``."""
    if not enabled:
        yield
        return
    saved = os.environ.get(BUCKET_BYTES_ENV)
    os.environ[BUCKET_BYTES_ENV] = "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ[BUCKET_BYTES_ENV]
        else:
            os.environ[BUCKET_BYTES_ENV] = saved
