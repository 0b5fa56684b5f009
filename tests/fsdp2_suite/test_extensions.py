"""Port of upstream ``test/distributed/_composable/fsdp/test_fully_shard_extensions.py``.

Upstream tests FSDP2's all-gather extension points: a parameter's tensor subclass (or a monkey-
patched local tensor) defines ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` to choose what is
all-gathered per parameter (``TwoTensor``'s two inner tensors, a bf16 cast) and how the unsharded
parameter is rebuilt. flashfsdp all-gathers each unit's flat shard (every parameter's dim-0 chunk
back to back) in one collective and copies the parameters out of the gathered buffer: no
per-parameter hook runs, and a parameter's tensor subclass is not kept (its sharded parameter is a
plain DTensor), so those hooks have no counterpart (see the table in
``docs/fsdp2_compatibility.md``).

What the extension tests exercise besides the hooks is ported here: the plain-parameter flows
they run through (uneven dim-0 sizes with a fused optimizer; meta-device initialisation with
bf16 mixed precision, for reshard_after_forward True and False).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.testing._internal.common_fsdp import MLP

from tests.fsdp2_suite.common import rank_seed
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)


@cases.case(world_size=2)
def all_gather_extension_outer_size_stride(rank, world_size, impl):
    """Upstream: test_fully_shard_extensions.py::TestFullyShardAllGatherExtensionsMultiThread::test_all_gather_extension_outer_size_stride
    without the ``BFloat16AllGatherTensor`` weights (the subclass hook is n/a): MLP(dim=3,
    dim_multiplier=3) (dim-0 sizes 9 and 3, not divisible by W) as one unit with
    reshard_after_forward=False, one fused-AdamW step; loss and parameters compared."""
    torch.manual_seed(42)
    model = MLP(dim=3, dim_multiplier=3)
    impl.fully_shard(model, reshard_after_forward=False)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    rank_seed(rank)
    inp = torch.randn((2, 3))
    loss = model(inp).sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return {"loss": loss.detach(), "params": impl.full_params(model)}


def _init_mlps() -> nn.Module:
    # Upstream's _init_two_tensor_mlp without the TwoTensor wrapping: 3 MLP(8, bias=False)
    return nn.Sequential(*[MLP(8, bias=False) for _ in range(3)])


def _end_to_end(rank, world_size, impl, reshard_after_forward):
    with torch.device("meta"):
        model = _init_mlps()
    for param in model.parameters():
        assert param.device == torch.device("meta")
    mp = impl.MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for mlp in model:
        impl.fully_shard(mlp, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    impl.fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    model.to_empty(device="cpu")
    for param in model.parameters():
        nn.init.trunc_normal_(param)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2, foreach=True)
    rank_seed(rank)
    inp = torch.randn((2, 8))
    for _ in range(3):  # upstream: a few iterations to check for errors
        loss = model(inp).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        assert torch.isfinite(loss).all(), loss
    for name, param in model.named_parameters():
        assert impl.is_sharded(param) and param.device.type == "cpu", name
        assert torch.isfinite(impl.local(param)).all(), name


# The sharded parameters are initialised by nn.init.trunc_normal_ on each implementation's own
# shards (DTensor's distributed RNG vs flashfsdp's init window): the values are not comparable.
@cases.case(world_size=2, compare=False)
def all_gather_extensions_end_to_end(rank, world_size, impl):
    """Upstream: test_fully_shard_extensions.py::TestFullyShardAllGatherExtensionsMultiThread::test_all_gather_extensions_end_to_end
    without ``TwoTensor`` parameters (the pre/post-all-gather hooks are n/a): the meta-device
    flow (build on meta, fully_shard with bf16 ``param_dtype``, ``to_empty``, ``trunc_normal_`` on
    the sharded parameters, 3 Adam steps) runs, for reshard_after_forward True and False, and
    leaves finite sharded parameters."""
    for reshard_after_forward in (True, False):
        _end_to_end(rank, world_size, impl, reshard_after_forward)
    return {}


test_case = cases.pytest_tests()
