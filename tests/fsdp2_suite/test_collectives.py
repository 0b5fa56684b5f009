"""Port of upstream ``test/distributed/_composable/fsdp/test_fully_shard_collectives.py``.

Upstream drives FSDP2's private collectives directly (``FSDPParamGroup``, ``foreach_all_gather`` /
``foreach_all_gather_copy_out``, ``foreach_reduce_scatter``) at W = 128 on one GPU (threads), with
many unevenly sized fp32 parameters, over the combinations of CUDA streams and ``async_op``. What
those tests check is observable through the public API, and that is what is ported (W = 2, and the
reduce-scatter also at W = 4):

- all-gather: after ``module.unshard()`` (``async_op`` False, and True + ``handle.wait()``) the
  module's parameters are plain full parameters exactly equal to the originals; before it (and
  after ``reshard()``) each is sharded and its local shard is exactly its part of the original
  (possibly empty: a pure-padding shard);
- reduce-scatter: with every unsharded gradient = rank (what upstream feeds
  ``foreach_reduce_scatter``), produced here by a backward, each sharded gradient is this rank's
  part of the mean over ranks, for every parameter, those whose shard on this rank is pure padding
  included (their gradient's local tensor is empty); then again with gradient = rank + a pattern
  (which a misplaced element would not survive).

The parameter sizes are upstream's (uneven: 17 and 297 rows...), plus ``[1, 33]`` and ``[3]``, which
give FSDP2's dim-0 sharding pure-padding shards at W = 2 and 4. Parameters and gradients are
DTensors for both implementations; their types, placements and local shapes are recorded and
compared with torch's (``Impl.record_types``). Not applicable: the CUDA stream variants
(``all_gather_copy_in_stream``, ``all_gather_stream``, ``reduce_scatter_stream``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.fsdp2_suite.common import FP32
from tests.fsdp2_suite.runner import CaseSet

cases = CaseSet(__name__)

UPSTREAM = "test/distributed/_composable/fsdp/test_fully_shard_collectives.py"

PARAM_SIZES = [
    torch.Size([17, 257]),
    torch.Size([17]),
    torch.Size([64, 312]),
    torch.Size([64]),
    torch.Size([64, 64]),
    torch.Size([512, 64]),
    torch.Size([256]),
    torch.Size([64, 297]),
    torch.Size([1, 33]),  # pure padding on ranks >= 1
    torch.Size([3]),  # pure padding on rank 3 at W = 4
]


class ParamsModule(nn.Module):
    """Holds ``params``; ``forward(coeffs)`` is sum_i <params[i], coeffs[i]>, so the gradient of
    ``params[i]`` is ``coeffs[i]``."""

    def __init__(self, params: list[nn.Parameter]):
        super().__init__()
        self.params = nn.ParameterList(params)

    def forward(self, coeffs: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * c).sum() for p, c in zip(self.params, coeffs))


def _init_params() -> list[torch.Tensor]:
    """The original parameters, the same on every rank (broadcast from rank 0, as upstream)."""
    torch.manual_seed(42)
    orig = [torch.randn(size) for size in PARAM_SIZES]
    for t in orig:
        dist.broadcast(t, src=0)
    return orig


def _sharded_module(impl, orig: list[torch.Tensor]) -> ParamsModule:
    module = ParamsModule([nn.Parameter(t.clone()) for t in orig])
    impl.fully_shard(module)
    return module


def _check_shards(impl, module: ParamsModule, orig: list[torch.Tensor], where: str) -> int:
    """Every parameter sharded, its local shard exactly its part of the original; returns how many
    are pure padding on this rank (empty local shard)."""
    empty = 0
    impl.record_types(f"{where}: params", list(module.params))
    for i, (p, o) in enumerate(zip(module.params, orig)):
        assert impl.is_sharded(p), f"{where}: params.{i} is not sharded"
        assert impl.full_shape(p) == o.shape, f"{where}: params.{i} has full shape {impl.full_shape(p)}"
        local, want = impl.local(p), impl.shard_of(o, p)
        assert local.numel() == want.numel(), f"{where}: params.{i} local numel {local.numel()} vs {want.numel()}"
        if local.numel() == 0:
            empty += 1
            continue
        torch.testing.assert_close(local, want, rtol=0, atol=0, msg=lambda m, i=i: f"{where}: params.{i}'s shard: {m}")
    return empty


def assert_some_padding(here: bool) -> None:
    """Some rank has a pure-padding shard (collective): the sizes exercise that path."""
    flag = torch.tensor([int(here)])
    dist.all_reduce(flag)
    assert flag.item() > 0, "no rank has a pure-padding shard: the parameter sizes exercise none"


@cases.case()
def all_gather_fp32(rank, world_size, impl):
    """Upstream: test_fully_shard_collectives.py::TestFullyShardCollectives::test_all_gather_fp32:
    many unevenly sized fp32 parameters; each local shard is exactly its part of the original
    (pure-padding shards empty); ``unshard()`` (sync, and ``async_op=True`` + ``wait()``) gives back
    plain ``nn.Parameter``s exactly equal to the originals; ``reshard()`` gives the shards back."""
    orig = _init_params()
    module = _sharded_module(impl, orig)
    empties = []
    for async_op in (False, True):
        where = f"async_op={async_op}"
        empties.append(_check_shards(impl, module, orig, f"{where}, before unshard"))
        handle = module.unshard(async_op=async_op)
        if async_op:
            assert handle is not None, "unshard(async_op=True) returned no handle"
            handle.wait()
        for i, (p, o) in enumerate(zip(module.params, orig)):
            assert isinstance(p, nn.Parameter) and not impl.is_sharded(p), f"{where}: params.{i} is still sharded"
            assert p.shape == o.shape, f"{where}: params.{i} unsharded shape {p.shape} vs {o.shape}"
            torch.testing.assert_close(p.detach(), o, rtol=0, atol=0,
                                       msg=lambda m, i=i, where=where: f"{where}: unsharded params.{i}: {m}")
        module.reshard()
        _check_shards(impl, module, orig, f"{where}, after reshard")
    assert_some_padding(sum(empties) > 0)
    return {"orig_norms": torch.stack([o.norm() for o in orig])}


def _reduce_scatter(rank, world_size, impl):
    orig = _init_params()
    module = _sharded_module(impl, orig)
    pattern = [(torch.arange(o.numel()) % 7).to(o.dtype).view(o.shape) for o in orig]
    results, any_padding = [], False
    for label, extra in (("grad = rank", [torch.zeros_like(o) for o in orig]), ("grad = rank + pattern", pattern)):
        for p in module.parameters():
            p.grad = None
        unsharded_grads = [torch.full_like(o, float(rank)) + e for o, e in zip(orig, extra)]
        module(unsharded_grads).backward()
        # The reference: the mean over ranks of the unsharded gradients (upstream: all_reduce / W).
        reduced = [g.clone() for g in unsharded_grads]
        for g in reduced:
            dist.all_reduce(g)
            g /= world_size
        for i, (p, want_full) in enumerate(zip(module.params, reduced)):
            assert impl.is_sharded(p), f"{label}: params.{i} is not sharded after backward"
            want = impl.shard_of(want_full, p)
            assert p.grad is not None, f"{label}: params.{i} has no gradient"
            if want.numel() == 0:  # pure padding on this rank: an empty local gradient
                any_padding = True
            torch.testing.assert_close(impl.local(p.grad), want, **FP32,
                                       msg=lambda m, i=i, label=label: f"{label}: params.{i}'s sharded gradient: {m}")
        impl.record_types(f"{label}: gradients", [p.grad for p in module.params])
        # The full gradients (collective) as well: equal to the mean everywhere.
        full = impl.full_grads(module)
        for i, want_full in enumerate(reduced):
            torch.testing.assert_close(full[f"params.{i}"], want_full, **FP32,
                                       msg=lambda m, i=i, label=label: f"{label}: params.{i}'s full gradient: {m}")
        results.append(full)
    assert_some_padding(any_padding)
    return results


@cases.case()
def reduce_scatter_fp32(rank, world_size, impl):
    """Upstream: test_fully_shard_collectives.py::TestFullyShardCollectives::test_reduce_scatter_fp32
    (W = 2): unsharded gradient = rank (then rank + a pattern) for every parameter; each sharded
    gradient equals this rank's part of the mean over ranks (pure-padding shards: an empty local
    gradient); the full gradients equal the mean."""
    return _reduce_scatter(rank, world_size, impl)


@cases.case(world_size=4)
def reduce_scatter_fp32_w4(rank, world_size, impl):
    """Upstream: test_fully_shard_collectives.py::TestFullyShardCollectives::test_reduce_scatter_fp32
    at W = 4 (mean 1.5 + pattern; more and other pure-padding shards)."""
    return _reduce_scatter(rank, world_size, impl)


test_case = cases.pytest_tests()
