"""No hang on a one-rank failure: flashfsdp's own collective-bearing calls (its full state-dict
functions, clip_grad_norm_, the first forward's checks) raise on every rank. DSD's getters and
setters are torch's own over the DTensors, as on FSDP2, and are not cases here.

One spawn of W = 2 gloo ranks runs every case in turn (each on a fresh tiny model); a case gives
one rank bad input (or a failure injected on one rank) and records what each rank raised. A case
that left a rank waiting would hold the spawn past its timeout; a rank that raised alone would
show up as None on the other.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn as nn

import flashfsdp
from flashfsdp import fully_shard
from flashfsdp.bindings.state_dict import full as fsd_module
from tests.harness import run_distributed


def _model(seed: int = 0, out_features: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, out_features))
    fully_shard(model[0])
    fully_shard(model[2])
    return fully_shard(model)


def _reference_state(seed: int = 1) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).state_dict()


def _trained(rank: int) -> tuple[nn.Sequential, torch.optim.Optimizer]:
    model = _model()
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(10 + rank)
    model(torch.randn(3, 8)).sum().backward()
    optim.step()
    return model, optim


def _injected(rank: int, name: str, on_rank: int = 0):
    """On ``on_rank``: ``state_dict.full.<name>`` raises MemoryError (a failure after the ranks agreed)."""
    if rank != on_rank:
        return mock.patch.object(fsd_module, name, getattr(fsd_module, name))
    return mock.patch.object(fsd_module, name, mock.Mock(side_effect=MemoryError("injected: out of memory")))


def _load_max_error(rank: int, dtype: torch.dtype) -> float:
    """Load the reference values cast to ``dtype``; the largest difference from the reference
    values cast back to float32 after the round trip (0 if exact)."""
    model, ref = _model(), _reference_state()
    flashfsdp.set_full_state_dict(model, {k: v.to(dtype) for k, v in ref.items()} if rank == 0 else None)
    loaded = flashfsdp.get_full_state_dict(model, rank0_only=False)
    assert all(v.dtype == torch.float32 for v in loaded.values())
    return max((loaded[k] - ref[k].to(dtype).float()).abs().max().item() for k in ref)


def _set_int64(rank):
    flashfsdp.set_full_state_dict(_model(), {k: v.long() for k, v in _reference_state().items()} if rank == 0 else None)


def _set_bad_strict_on_rank1(rank):
    flashfsdp.set_full_state_dict(_model(), _reference_state() if rank == 0 else None, strict="yes" if rank == 1 else True)


def _set_fails_after_agreement(rank):
    model = _model()
    with _injected(rank, "flatten"):
        flashfsdp.set_full_state_dict(model, _reference_state() if rank == 0 else None)


def _get_bad_flag_on_rank1(rank):
    flashfsdp.get_full_state_dict(_model(), cpu_offload="no" if rank == 1 else True)


def _get_fails_on_rank0(rank):
    model = _model()
    with _injected(rank, "unflatten"):
        flashfsdp.get_full_state_dict(model)


def _clip_bad_max_norm_on_rank1(rank):
    model, _ = _trained(rank)
    flashfsdp.clip_grad_norm_(model, 0.0 if rank == 1 else 1.0)


def _clip_no_grads_on_rank1(rank):
    model, optim = _trained(rank)
    if rank == 1:
        optim.zero_grad(set_to_none=True)
    return flashfsdp.clip_grad_norm_(model, 1.0).item()


def _clip_nonfinite_replicated_on_rank1(rank):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    fully_shard(model, ignored_params={model[1].bias})
    model(torch.randn(3, 8)).sum().backward()
    if rank == 1:
        model[1].bias.grad.fill_(float("inf"))
    flashfsdp.clip_grad_norm_(model, 1.0, error_if_nonfinite=True)


def _forward_model_differs(rank):
    model = nn.Sequential(nn.Linear(64, 64 if rank == 0 else 65))
    fully_shard(model[0])
    fully_shard(model)
    model(torch.randn(2, 64))


def _get_model_differs_before_forward(rank):
    flashfsdp.get_full_state_dict(_model(out_features=4 if rank == 0 else 5))


def _max_inflight_on_a_non_root_of_rank1(rank):
    model = _model()
    if rank == 1:
        model[0].set_max_inflight_all_gathers(0)
    model(torch.randn(2, 8))


CASES = {
    "set_float64": lambda rank: _load_max_error(rank, torch.float64),
    "set_bfloat16": lambda rank: _load_max_error(rank, torch.bfloat16),
    "set_int64": _set_int64,
    "set_bad_strict_on_rank1": _set_bad_strict_on_rank1,
    "set_fails_after_agreement": _set_fails_after_agreement,
    "get_bad_flag_on_rank1": _get_bad_flag_on_rank1,
    "get_fails_on_rank0": _get_fails_on_rank0,
    "clip_bad_max_norm_on_rank1": _clip_bad_max_norm_on_rank1,
    "clip_no_grads_on_rank1": _clip_no_grads_on_rank1,
    "clip_nonfinite_replicated_on_rank1": _clip_nonfinite_replicated_on_rank1,
    "forward_model_differs": _forward_model_differs,
    "get_model_differs_before_forward": _get_model_differs_before_forward,
    "max_inflight_on_a_non_root_of_rank1": _max_inflight_on_a_non_root_of_rank1,
}


def _run_cases(rank, world_size):
    """Per case: ("ok", value) or ("error", exception class name, message)."""
    outcomes = {}
    for name, case in CASES.items():
        try:
            outcomes[name] = ("ok", case(rank))
        except Exception as exc:  # noqa: BLE001 - what each rank raised is the result
            outcomes[name] = ("error", type(exc).__name__, str(exc))
    return outcomes


@pytest.fixture(scope="module")
def outcomes():
    return run_distributed(_run_cases, 2, timeout=240)


def _assert_every_rank_raised(outcomes, case: str, kind: str, *fragments: str) -> None:
    """Every rank raised ``kind`` in ``case``, with each of ``fragments`` in its message."""
    results = [by_rank[case] for by_rank in outcomes]
    assert all(r[0] == "error" for r in results), f"{case}: not every rank raised: {results}"
    for _, raised, message in results:
        assert raised == kind and all(f in message for f in fragments), (case, raised, message)


@pytest.mark.parametrize("case", ["set_float64", "set_bfloat16"])
def test_set_full_state_dict_casts_any_floating_dtype(outcomes, case):
    for by_rank in outcomes:
        assert by_rank[case] == ("ok", 0.0)


def test_set_full_state_dict_refuses_integer_values_on_every_rank(outcomes):
    _assert_every_rank_raised(outcomes, "set_int64", "TypeError",
                              "'0.weight' has dtype torch.int64 in state_dict but torch.float32 in the model")


def test_set_full_state_dict_bad_argument_on_one_rank(outcomes):
    _assert_every_rank_raised(outcomes, "set_bad_strict_on_rank1", "TypeError", "strict must be a bool, got 'yes' (rank 1)")


def test_set_full_state_dict_failure_after_agreement(outcomes):
    _assert_every_rank_raised(outcomes, "set_fails_after_agreement", "RuntimeError",
                              "MemoryError: injected: out of memory", "partly loaded", "(rank 0)")


def test_get_full_state_dict_bad_argument_on_one_rank(outcomes):
    _assert_every_rank_raised(outcomes, "get_bad_flag_on_rank1", "TypeError", "cpu_offload must be a bool, got 'no' (rank 1)")


def test_full_state_dict_getter_failure_on_one_rank_after_agreement(outcomes):
    _assert_every_rank_raised(outcomes, "get_fails_on_rank0", "MemoryError", "injected: out of memory (rank 0)")


def test_clip_grad_norm_bad_argument_on_one_rank(outcomes):
    _assert_every_rank_raised(outcomes, "clip_bad_max_norm_on_rank1", "ValueError", "max_norm must be > 0, got 0.0 (rank 1)")


def test_clip_grad_norm_without_gradients_on_one_rank(outcomes):
    norms = [by_rank["clip_no_grads_on_rank1"] for by_rank in outcomes]
    assert all(kind == "ok" and value > 0 for kind, value in norms), norms


def test_clip_grad_norm_non_finite_on_one_rank(outcomes):
    _assert_every_rank_raised(outcomes, "clip_nonfinite_replicated_on_rank1", "RuntimeError",
                              "total norm of order 2.0 is not finite")


def test_model_that_differs_across_ranks_at_the_first_forward(outcomes):
    _assert_every_rank_raised(outcomes, "forward_model_differs", "ValueError",
                              "unit '0' parameter '0.weight' has shape (64, 64), dtype torch.float32 (flat group 0) on "
                              "rank 0 but shape (65, 64), dtype torch.float32 (flat group 0) on rank 1")


def test_model_that_differs_across_ranks_before_a_full_state_dict(outcomes):
    _assert_every_rank_raised(outcomes, "get_model_differs_before_forward", "ValueError",
                              "parameter '2.weight' has shape (4, 8)", "(5, 8)")


def test_refused_setting_on_one_rank_at_the_first_forward(outcomes):
    _assert_every_rank_raised(outcomes, "max_inflight_on_a_non_root_of_rank1", "ValueError",
                              "set_max_inflight_all_gathers was called on '0'", "instead (rank 1)")
