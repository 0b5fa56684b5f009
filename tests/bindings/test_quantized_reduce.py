"""MixedPrecisionPolicy(reduce_quantization=QuantizedReduce(...)): ZeRO++ qgZ through fully_shard.

At W = 4 on gloo (2 "nodes" x 2): one backward's gradient shards lie within the kernels' bound of
the unquantised (fp32) reduction's; a few training steps stay close to the unquantised run at int8
and int4; each unit's reduction is the flight recorder's qgZ hops (its unit named), not a
reduce-scatter of its gradients; HSDP, a local_size that does not divide W and a bad value are
refused naming ``reduce_quantization``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import flashfsdp
from flashfsdp import MixedPrecisionPolicy, QuantizedReduce
from tests.harness import run_distributed
from tests.models import loss_fn, make_batch
from tests.training import local_rows, make_model, train_flashfsdp, units_of

FP32 = MixedPrecisionPolicy(reduce_dtype=torch.float32)


def _policy(bits: int, local_size: int = 2) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(reduce_dtype=torch.float32,
                                reduce_quantization=QuantizedReduce(bits=bits, local_size=local_size))


def _grads_after_one_backward(rank, world_size, policy):
    """The full gradients (``full_tensor()`` of the sharded ones) after one backward of the mlp."""
    model = make_model("mlp")
    for unit in units_of("mlp", model):
        flashfsdp.fully_shard(unit, mp_policy=policy)
    x, y = make_batch("mlp", 0, 8 * world_size)
    loss_fn("mlp", model(local_rows(x, rank, world_size)), local_rows(y, rank, world_size)).backward()
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters()}


def _float64_reference(rank, world_size):
    """(the float64 mean over ranks of the unsharded model's local gradients, the largest |local
    gradient| of any rank and parameter)."""
    model = make_model("mlp")
    x, y = make_batch("mlp", 0, 8 * world_size)
    loss_fn("mlp", model(local_rows(x, rank, world_size)), local_rows(y, rank, world_size)).backward()
    mean, largest = {}, torch.zeros(())
    for n, p in model.named_parameters():
        g = p.grad.double()
        largest = torch.maximum(largest, g.abs().max())
        dist.all_reduce(g)
        mean[n] = g / world_size
    dist.all_reduce(largest, op=dist.ReduceOp.MAX)
    return mean, float(largest)


def _qgz_ranks(rank, world_size):
    from flashfsdp.runtime import flight  # noqa: PLC0415

    exact = _float64_reference(rank, world_size)
    before = flight.entries()[-1].seq if flight.entries() else 0
    got = {bits: _grads_after_one_backward(rank, world_size, _policy(bits)) for bits in (8, 4)}
    hops = [(e.kind, e.unit) for e in flight.entries() if e.seq > before]
    runs = {name: train_flashfsdp("mlp", rank, world_size, steps=4, mp_policy=policy)["losses"]
            for name, policy in (("fp32", FP32), ("int8", _policy(8)), ("int4", _policy(4)))}
    errors = _refusals(world_size)
    return exact, got, hops, runs, errors


def _refusals(world_size) -> list[str]:
    """The messages of the refused settings at W = 4."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    messages = []
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    for kwargs in ({"mp_policy": _policy(4), "mesh": hsdp}, {"mp_policy": _policy(4, local_size=3)}):
        try:
            flashfsdp.fully_shard(make_model("mlp"), **kwargs)
        except ValueError as exc:
            messages.append(str(exc))
    dist.barrier()
    return messages


def test_two_nodes_of_two_reduce_close_to_fp32_and_train_alike():
    results = run_distributed(_qgz_ranks, 4)
    for exact, got, hops, runs, errors in results:
        mean, largest = exact
        for bits, qmax in ((8, 127), (4, 7)):
            # per element: half a block scale of each of the W = 4 ranks' contributions (each
            # <= largest / W after the divide) and of the N = 2 partial sums of L = 2 (<= 2·largest / W):
            # (4 + 2·2)·largest / (2·QMAX·4) = largest / QMAX, plus fp32 rounding
            bound = largest / qmax * 1.001 + 1e-6
            for name, g in mean.items():
                err = float((got[bits][name].double() - g).abs().max())
                assert err <= bound, (bits, name, err, bound)
            assert any(float((got[bits][n].double() - mean[n]).abs().max()) > 1e-6 for n in mean)  # quantised
        kinds = {k for k, _ in hops}
        assert {"all_to_all (qgZ intra)", "all_to_all (qgZ inter)"} <= kinds
        assert all(u for k, u in hops if k.startswith("all_to_all")), hops  # each hop names its unit
        fp32 = runs["fp32"]
        for name in ("int8", "int4"):
            assert all(abs(a - b) <= 0.02 * abs(b) + 1e-3 for a, b in zip(runs[name], fp32)), (name, runs)
        assert runs["int4"] != fp32  # (quantised: not the same run)
        assert len(errors) == 2
        assert "reduce_quantization (ZeRO++ qgZ) is refused under HSDP" in errors[0]
        assert "reduce_quantization=QuantizedReduce(local_size=3) must divide the unit's world size 4" in errors[1]


def test_a_bad_value_is_refused_naming_the_field():
    with pytest.raises(TypeError, match="MixedPrecisionPolicy.reduce_quantization must be a QuantizedReduce"):
        MixedPrecisionPolicy(reduce_quantization=4)


def test_one_process_trains_with_qgz():
    """W = 1: the one hop is a copy; the gradients are the quantised-dequantised ones and training runs."""
    policy = _policy(8, local_size=1)
    model = make_model("mlp")
    for unit in units_of("mlp", model):
        flashfsdp.fully_shard(unit, mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(3):
        x, y = make_batch("mlp", step, 8)
        loss = loss_fn("mlp", model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
