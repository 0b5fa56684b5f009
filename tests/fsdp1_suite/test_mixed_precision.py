"""Port of upstream ``test/distributed/fsdp/test_fsdp_mixed_precision.py``: ``MixedPrecision``
trains like torch's FSDP1 (fp16 compute, fp32 reduction and master weights), and FSDP1's input
casting rules (``cast_root_forward_inputs`` for the root, ``cast_forward_inputs`` for the others)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp.wrap import ModuleWrapPolicy

from tests.fsdp1_suite.common import Block, api, batch, full_params, make_net, wrap
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)


@cases.case(rtol=1e-3, atol=1e-4)
def fp16_training_matches_torch(rank, world_size, impl):
    """test_mixed_precision_e2e_full_shard: three Adam steps in fp16 with fp32 reduction; the master
    parameters stay fp32 and match torch's FSDP1 (the runner compares)."""
    mp = api(impl).MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float32, buffer_dtype=torch.float16)
    fsdp_model = wrap(impl, make_net(), auto_wrap_policy=ModuleWrapPolicy({Block}), mixed_precision=mp,
                      use_orig_params=True)
    optim = torch.optim.Adam(fsdp_model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        out = fsdp_model(batch(step, rank, world_size)[0])
        assert out.dtype == torch.float16
        out.float().sum().backward()
        assert all(p.grad.dtype == torch.float32 for p in fsdp_model.parameters() if p.grad is not None)
        optim.step()
        optim.zero_grad()
        loss = out.detach().float().sum()
        dist.all_reduce(loss)
        losses.append(loss)
    params = full_params(impl, fsdp_model)
    assert all(v.dtype == torch.float32 for v in params.values())
    return {"losses": losses, "params": params}


class _Recorder(nn.Module):
    """A linear that records the dtype of its input."""

    def __init__(self):
        super().__init__()
        self.lin, self.seen = nn.Linear(4, 4), []

    def forward(self, x):
        self.seen.append(x.dtype)
        return self.lin(x.to(self.lin.weight.dtype)).float()  # hands fp32 on, whatever it computed in


@cases.case()
def input_casting_rules(rank, world_size, impl):
    """test_fsdp_mixed_precision cast_forward_inputs / cast_root_forward_inputs: the root casts
    (default), a nested wrapper only with ``cast_forward_inputs=True``."""
    MP = api(impl).MixedPrecision
    inner_cast, inner_plain, root = _Recorder(), _Recorder(), _Recorder()
    model = nn.Sequential(root, inner_cast, inner_plain)
    model[1] = wrap(impl, inner_cast, mixed_precision=MP(param_dtype=torch.float16, cast_forward_inputs=True))
    model[2] = wrap(impl, inner_plain, mixed_precision=MP(param_dtype=torch.float16))
    fsdp_model = wrap(impl, model, mixed_precision=MP(param_dtype=torch.float16))
    fsdp_model(torch.randn(2, 4))
    assert (root.seen, inner_cast.seen, inner_plain.seen) == ([torch.float16], [torch.float16], [torch.float32]), (
        root.seen, inner_cast.seen, inner_plain.seen)
    return {}


test_case = cases.pytest_tests()
