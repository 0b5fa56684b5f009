"""The prefetch policy: recorded order, changed order, explicit lists, in-flight limit."""

from __future__ import annotations

import pytest

from flashfsdp.runtime.schedule import ExecutionOrder, PrefetchPolicy


def _run(order: ExecutionOrder, keys):
    order.start_step()
    for k in keys:
        order.record(k)


def test_forward_prefetch_follows_the_previous_step():
    order, policy = ExecutionOrder(), PrefetchPolicy()
    _run(order, "abcd")
    order.start_step()
    order.record("a")
    assert policy.forward_targets("a", order) == ["b"]
    order.record("b")
    assert policy.forward_targets("b", order) == ["c"]


def test_first_step_has_no_forward_prefetch():
    order, policy = ExecutionOrder(), PrefetchPolicy()
    order.start_step()
    order.record("a")
    assert policy.forward_targets("a", order) == []


def test_changed_order_turns_implicit_prefetch_off_then_is_learned():
    order, policy = ExecutionOrder(), PrefetchPolicy()
    _run(order, "abcd")
    order.start_step()
    for k in "acb":
        order.record(k)
    assert policy.forward_targets("b", order) == []  # diverged: no guess
    order.record("d")
    order.start_step()
    for k in "acb":
        order.record(k)
        assert policy.forward_targets(k, order) == [{"a": "c", "c": "b", "b": "d"}[k]]


def test_module_run_twice_in_one_forward():
    order, policy = ExecutionOrder(), PrefetchPolicy()
    _run(order, "abab")
    order.start_step()
    for k, nxt in zip("abab", "bab"):
        order.record(k)
        assert policy.forward_targets(k, order) == [nxt]


def test_backward_prefetch_is_reverse_post_forward_order():
    order, policy = ExecutionOrder(), PrefetchPolicy()
    order.start_step()
    # root r's forward contains blocks a, b: pre-forward order r a b, post-forward order a b r
    for k in "rab":
        order.record(k)
    for k in "abr":
        order.record_post_forward(k)
    assert policy.backward_targets("r", order) == ["b"]  # the root prefetches the last block
    assert policy.backward_targets("b", order) == ["a"]
    assert policy.backward_targets("a", order) == []


def test_backward_of_a_unit_run_twice_prefetches_the_predecessor_of_each_forward():
    """Forward a b c a: backward runs a (its 2nd forward) c b a (its 1st). The first backward of a
    prefetches c; the second has nothing before it (it must not prefetch c again)."""
    order, policy = ExecutionOrder(), PrefetchPolicy()
    order.start_step()
    for k in "abca":
        order.record(k)
        order.record_post_forward(k)
    expected = {0: ["c"], 1: ["b"], 2: ["a"], 3: []}
    for i, k in enumerate("acba"):
        order.record_pre_backward(k)
        assert policy.backward_targets(k, order) == expected[i], (i, k)
    order.start_step()  # the count starts again each step
    for k in "abca":
        order.record(k)
        order.record_post_forward(k)
    order.record_pre_backward("a")
    assert policy.backward_targets("a", order) == ["c"]


def test_explicit_lists_win_and_in_flight_limit_applies():
    order, policy = ExecutionOrder(), PrefetchPolicy(max_inflight=2)
    _run(order, "abcd")
    assert policy.forward_targets("a", order, explicit=["c", "d"]) == ["c", "d"]
    assert policy.admit(["b", "c", "d"], inflight=1) == ["b"]
    assert policy.admit(["b"], inflight=2) == []
    with pytest.raises(ValueError, match="max_inflight must be >= 0"):
        PrefetchPolicy(max_inflight=-1)


def test_the_unit_ending_forward_just_before_the_root_is_kept_for_backward():
    """Root r around blocks a b: b's forward ends just before r's, so from the second step b keeps
    its parameters (backward needs it first); not with max_inflight 0, not once the order changed."""
    order, policy = ExecutionOrder(), PrefetchPolicy()

    def forward(keys_pre, keys_post, check):
        order.start_step()
        for k in keys_pre:
            order.record(k)
        kept = []
        for k in keys_post:
            order.record_post_forward(k)
            kept.append(check(k))
        return kept

    assert forward("rab", "abr", lambda k: policy.keep_for_backward(k, order)) == [False] * 3  # nothing recorded
    assert forward("rab", "abr", lambda k: policy.keep_for_backward(k, order)) == [False, True, False]
    lean = PrefetchPolicy(max_inflight=0)
    assert forward("rab", "abr", lambda k: lean.keep_for_backward(k, order)) == [False] * 3
    assert forward("rba", "bar", lambda k: policy.keep_for_backward(k, order)) == [False] * 3  # diverged
    # A unit that runs twice is kept only after its last forward.
    forward("raba", "abar", lambda k: False)
    assert forward("raba", "abar", lambda k: policy.keep_for_backward(k, order)) == [False, False, True, False]
