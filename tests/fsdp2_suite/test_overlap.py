"""Port of upstream ``test/distributed/_composable/fsdp/test_fully_shard_overlap.py``.

Upstream times CUDA streams: collectives and compute are emulated by ``torch.cuda._sleep`` and it
checks that FSDP's run is no slower than a baseline that exposes every collective. CUDA timing
has no CPU counterpart; what makes those timings hold is observable here, as an order of events:

- backward: the all-gather of the unit whose backward comes next is issued (prefetched) before
  the current unit's backward compute starts, and each unit's reduce-scatter is issued before the
  next unit's backward compute (only the first all-gather and the last reduce-scatter exposed);
- ``set_post_optim_event``: training with a post-optimizer event set every step is unchanged.

Upstream's forward overlap relies on the CPU running ahead of the GPU (FSDP2 has no implicit
forward prefetch); on a CPU run there is nothing to run ahead of, so it is not asserted.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor.experimental import implicit_replication

from tests.fsdp2_suite.common import average_grads, rank_seed
from tests.fsdp2_suite.runner import CaseSet
from tests.fsdp2_suite.test_comm import record_events

cases = CaseSet(__name__)

_LOG: list | None = None  # compute events, appended by Matmul while a case records


class Matmul(torch.autograd.Function):
    """Upstream's Matmul without the CUDA sleeps: logs ("forward"/"backward", tag) instead."""

    @staticmethod
    def forward(ctx, input, weight, tag):
        ctx.save_for_backward(input, weight)
        ctx.tag = tag
        if _LOG is not None:
            _LOG.append(("forward", tag))
        return input @ weight

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        if _LOG is not None:
            _LOG.append(("backward", ctx.tag))
        return grad_output @ weight.T, input.T @ grad_output, None


class LinearWithLog(nn.Module):
    """Upstream's LinearWithSleep (one (dim, dim) weight, relu), logging instead of sleeping."""

    def __init__(self, dim: int, tag: str):
        super().__init__()
        self.weight = nn.Parameter(torch.randn((dim, dim)))
        self.tag = tag

    def forward(self, x):
        return nn.functional.relu(Matmul.apply(x, self.weight, self.tag))


@cases.case(world_size=2, per_unit_collectives=True)
def fully_shard_training_overlap(rank, world_size, impl):
    """Upstream: test_fully_shard_overlap.py::TestFullyShardOverlap::test_fully_shard_training_overlap
    (3 one-weight linears, each a unit, reshard_after_forward=True; a warm-up step, then the
    measured one): in backward, the all-gather of linear i-1 is issued before linear i's backward
    compute (prefetch), and linear i's reduce-scatter before linear i-1's backward compute; the
    losses and gradients equal the replicated reference's."""
    global _LOG
    torch.manual_seed(42)
    dim, num_linears = 4, 3
    model = nn.Sequential(*[LinearWithLog(dim, str(i)) for i in range(num_linears)])
    ref_model = copy.deepcopy(model)
    for lin in model:
        assert len(list(lin.parameters())) == 1, "expects only one weight"
        impl.fully_shard(lin, reshard_after_forward=True)
    impl.fully_shard(model, reshard_after_forward=True)
    rank_seed(rank)
    inp = torch.randn((2, dim))
    out = []
    failures = []
    for step in range(2):  # upstream: a warm-up step, then the timed ones
        ref_model.zero_grad()
        ref_loss = ref_model(inp).sum()
        ref_loss.backward()
        average_grads(ref_model)
        model.zero_grad()
        loss = model(inp).sum()
        with record_events(impl, ("unshard",)) as events:
            _LOG = events
            orig_rs = _patch_reduce_scatter_log(impl, events)
            try:
                loss.backward()
            finally:
                _unpatch_reduce_scatter_log(impl, orig_rs)
                _LOG = None
        log = list(events)
        for i in range(1, num_linears):
            compute = log.index(("backward", str(i)))
            gathered = ("unshard", str(i - 1))
            if gathered in log and log.index(gathered) > compute:
                failures.append(f"step {step}: linear {i - 1}'s all-gather issued after linear {i}'s backward "
                                f"compute started (not prefetched): {log}")
            next_compute = log.index(("backward", str(i - 1)))
            reduced = [k for k, e in enumerate(log) if e == ("reduce_scatter", "")]
            if sum(1 for k in reduced if k < next_compute) < num_linears - i:
                failures.append(f"step {step}: linear {i}'s reduce-scatter not issued before linear {i - 1}'s "
                                f"backward compute: {log}")
        torch.testing.assert_close(loss, ref_loss)
        impl.check_sharded_parity(ref_model, model)
        out.append(loss.detach())
    if failures:
        raise AssertionError("\n".join(failures))
    return out


def _patch_reduce_scatter_log(impl, events):
    """Append ("reduce_scatter", "") to ``events`` whenever the implementation issues one."""
    if impl.name == "torch":
        owner, names = dist, ("reduce_scatter_tensor", "reduce_scatter_single")
    else:
        from flashfsdp.runtime.process_group import ProcessGroupCommunicator  # noqa: PLC0415

        owner, names = ProcessGroupCommunicator, ("reduce_scatter_tensor",)
    saved = []
    for name in names:
        orig = getattr(owner, name, None)
        if orig is None:
            continue

        def logged(*args, _orig=orig, **kwargs):
            events.append(("reduce_scatter", ""))
            return _orig(*args, **kwargs)

        saved.append((owner, name, orig))
        setattr(owner, name, logged)
    return saved


def _unpatch_reduce_scatter_log(impl, saved):
    for owner, name, orig in saved:
        setattr(owner, name, orig)


@cases.case(world_size=2)
def fully_shard_post_optim_event_overlap(rank, world_size, impl):
    """Upstream: test_fully_shard_overlap.py::TestFullyShardOverlap::test_fully_shard_post_optim_event_overlap
    (a plain linear then a fully_shard'ed one, reshard_after_forward=False; AdamW; 5 steps after a
    warm-up): upstream times that the root's all-gather waits only for the event given to
    ``set_post_optim_event`` (CUDA streams: n/a); what is kept: with a new event recorded and set
    after every optimizer step, training is unchanged (losses equal those of the same model
    trained without events)."""
    dim = 4
    losses = {}
    for use_post_optim_event in (False, True):
        torch.manual_seed(42)
        model = nn.Sequential(LinearWithLog(dim, "plain"), nn.Linear(dim, dim))
        impl.fully_shard(model[1], reshard_after_forward=False)
        optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(42 + rank)
        inp = torch.randn((2, dim))
        run = []
        for _ in range(1 + 5):  # warm-up + upstream's num_iters
            optim.zero_grad()
            loss = model(inp).sum()
            loss.backward()
            with implicit_replication():  # the plain linear's parameters beside the DTensors
                optim.step()
            if use_post_optim_event:
                # A CPU event cannot be recorded ("cpu backend doesn't support events"): CPU work
                # is done when the optimizer step returns, so an unrecorded one stands for it.
                model[1].set_post_optim_event(torch.Event(device="cpu"))
            run.append(loss.detach())
        losses[use_post_optim_event] = run
    torch.testing.assert_close(losses[True], losses[False], rtol=0, atol=0)
    return losses[True]


test_case = cases.pytest_tests()
