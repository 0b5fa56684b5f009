"""ZeRO++ qgZ's runtime path (``runtime/quantized_reduce.py``) on gloo at W = 4 (2 "nodes" x 2):
the reducer's output equals the kernels' hand-simulated hierarchy bit for bit and lies within its
per-element bound of the float64 sum; the flags region is summed exactly; exactly representable
gradients give the unquantised reduce-scatter's result bit for bit; each hop is its own flight
recorder entry with the bytes it sends; bad settings are refused naming the argument."""

from __future__ import annotations

import pytest
import torch

from flashfsdp.kernels import reference
from flashfsdp.kernels.quantize import QMAX_BY_BITS, packed_nbytes
from flashfsdp.runtime.communicator import LocalCommunicator
from flashfsdp.runtime.quantized_reduce import QuantizedReduce, QuantizedReducer, check_reduce_quantization
from tests.harness import run_distributed
from tests.kernels.test_quantize_grad import _hierarchical

NODES, LOCAL = 2, 2
S, F = 700, 9  # shard values (not a multiple of the 256-value block) and flags region per segment


def _reducer(local_size: int = LOCAL):
    from flashfsdp.runtime.comm_factory import node_communicators  # noqa: PLC0415
    from flashfsdp.runtime.process_group import ProcessGroupCommunicator  # noqa: PLC0415

    comm = ProcessGroupCommunicator()
    intra, inter = node_communicators(comm, local_size, "process_group", torch.device("cpu"))
    return QuantizedReducer(QuantizedReduce(bits=4, local_size=local_size), comm, intra, inter)


def _inputs(rank: int, world: int) -> torch.Tensor:
    """W segments of S + F values: gradients of magnitude ~100 (one rank's of ~1e4), flags 0/1."""
    gen = torch.Generator().manual_seed(rank)
    packed = torch.randn(world, S + F, generator=gen) * (100.0 if rank else 1e4)
    packed[:, S:] = (torch.rand(world, F, generator=gen) < 0.5).float()
    return packed.reshape(-1)


def _reduce_ranks(rank, world, bits, local_size):
    import torch.distributed as dist  # noqa: PLC0415

    from flashfsdp.runtime import flight  # noqa: PLC0415

    reducer = _reducer(local_size)
    reducer.config = QuantizedReduce(bits=bits, local_size=local_size)
    packed = _inputs(rank, world)
    original = packed.clone()
    out = torch.empty(S + F)
    work = reducer.reduce_scatter(out, packed, S)
    work.set_unit("layers.0")
    work.wait()
    everyone = [torch.empty_like(original) for _ in range(world)]
    dist.all_gather(everyone, original)
    hops = [(e.kind, e.nbytes, e.unit) for e in flight.entries()]
    # the exactly representable case: every block's max is QMAX·2^e and every rank sends the same
    # integers times that power of two (every sum requantises exactly): the plain reduce-scatter's bits
    qmax = QMAX_BY_BITS[bits]
    gen = torch.Generator().manual_seed(7)
    values = torch.randint(-qmax, qmax + 1, (world, S + F), generator=gen).float()
    values[:, :: reducer.config.block_size] = qmax
    values[:, S:] = torch.randint(0, 2, (world, F), generator=gen).float()
    exact_in = (values * 2.0 ** -3).reshape(-1)
    exact_out, plain = torch.empty(S + F), torch.empty(S + F)
    reducer.comm.reduce_scatter_tensor(plain, exact_in.clone()).wait()
    reducer.reduce_scatter(exact_out, exact_in.clone(), S).wait()
    return out, everyone, hops, exact_out, plain


@pytest.mark.parametrize("bits", [4, 8])
def test_two_nodes_of_two_reduce_within_the_kernels_bound(bits):
    world = NODES * LOCAL
    results = run_distributed(_reduce_ranks, world, bits, LOCAL)
    grads = results[0][1]
    zeroed = [g.view(world, S + F).clone() for g in grads]
    for z in zeroed:
        z[:, S:] = 0  # the reducer quantises the segments with their flags zeroed ([Note: exact flags])
    shards, bounds, _ = _hierarchical(reference, [z.reshape(-1) for z in zeroed], NODES, LOCAL, bits, bits)
    exact = sum(g.double() for g in grads).view(world, S + F)
    c1, c2 = packed_nbytes(S + F, bits=bits), packed_nbytes(S + F, bits=bits)
    for rank, (out, _, hops, exact_out, plain) in enumerate(results):
        assert torch.equal(out[:S], shards[rank][:S])  # the same kernels in the same order
        assert bool(((out[:S].double() - exact[rank, :S]).abs() <= bounds[rank][:S]).all())
        assert torch.equal(out[S:].double(), exact[rank, S:])  # flags: exact, though next to 1e4-sized values
        assert out[S:].max() >= 1  # (and some are set)
        assert ("all_to_all (qgZ intra)", world * c1, "layers.0") in hops
        assert ("all_to_all (qgZ inter)", NODES * c2, "layers.0") in hops
        assert ("reduce_scatter", 4 * world * F, "layers.0") in hops  # the flags, unquantised
        assert torch.equal(exact_out, plain)


def test_one_node_is_one_hop():
    """local_size = W: one all-to-all over the whole group, dequantised at once."""
    results = run_distributed(_reduce_ranks, 2, 8, 2)
    for out, grads, hops, exact_out, plain in results:
        assert [k for k, *_ in hops if k.startswith("all_to_all")][:1] == ["all_to_all (qgZ intra)"]
        assert not any(k == "all_to_all (qgZ inter)" for k, *_ in hops)
        assert torch.equal(exact_out, plain)
    exact = sum(g.double() for g in results[0][1]).view(2, S + F)
    for rank, (out, *_rest) in enumerate(results):
        scale_sum = sum(g.view(2, S + F)[rank, :S].abs().max().double() for g in results[0][1]) / 127
        assert float((out[:S].double() - exact[rank, :S]).abs().max()) <= float(scale_sum) / 2 * 1.001


def test_settings_are_checked_naming_the_argument():
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        QuantizedReduce(bits=2)
    with pytest.raises(TypeError, match="local_size must be an int"):
        QuantizedReduce(local_size=2.0)
    with pytest.raises(ValueError, match="local_size must be >= 1"):
        QuantizedReduce(local_size=0)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        QuantizedReduce(block_size=100)
    local = LocalCommunicator()
    with pytest.raises(TypeError, match="unit 'u': reduce_quantization must be a QuantizedReduce"):
        check_reduce_quantization("int4", local, None, "u")
    with pytest.raises(ValueError, match="refused under HSDP"):
        check_reduce_quantization(QuantizedReduce(), local, local, "u")
    with pytest.raises(ValueError, match=r"local_size=2\) must divide the unit's world size 1"):
        check_reduce_quantization(QuantizedReduce(local_size=2), local, None, "u")
    assert check_reduce_quantization(None, local, None, "u") is None


def test_one_rank_quantises_and_dequantises_in_place_of_the_copy():
    """W = 1 (LocalCommunicator): the one hop is a copy; the shard is the dequantised input within
    half a block scale, the flags exact."""
    comm = LocalCommunicator()
    reducer = QuantizedReducer(QuantizedReduce(bits=8), comm, comm, comm)
    packed = torch.cat([torch.randn(S) * 3, torch.ones(F)])
    want = packed.clone()
    out = torch.empty(S + F)
    reducer.reduce_scatter(out, packed, S).wait()
    assert torch.equal(out[S:], want[S:])
    blocks = want[:S].split(256)
    bound = torch.cat([torch.full((len(b),), float(b.abs().max()) / 127 / 2 * 1.001) for b in blocks])
    assert bool(((out[:S] - want[:S]).abs() <= bound).all())
    assert not torch.equal(out[:S], want[:S])  # it did quantise
