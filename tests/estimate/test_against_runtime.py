"""The estimate against what the runtime really holds and gathers, on CPU gloo ranks.

Each rank shards a small Llama (one unit per block, then the root), trains three steps with AdamW
(``zero_grad(set_to_none=False)``: the gradient shards stay, as the estimate counts them) and, at
every unshard (a unit's own, or a bucket's: ``Buckets.unshard``, which gathers several units at
once without their ``unshard``), adds up what every unit holds (``ShardedUnit.memory_bytes``: master and gradient
shards, post-forward slices, unsharded buffers and gathered buffers not yet copied out) and the
buckets' gathered buffers not yet copied out. The largest sum over steps 2-3 is compared
with ``Estimate.unit_holdings_bytes`` (within 5%), the units gathered in step 3 with the estimate's
(their outputs' bytes: int8 packed buffers with ``all_gather_dtype=torch.int8``), the
all-gather and reduce-scatter collectives each rank's communicators ran in step 3 with the
estimate's counts, the reduce-scatters' inputs of step 3 on every rank with the estimate's (each
rank's segment: its shard and a flag per parameter, padded), and the optimizer state of the
busiest rank with ``Estimate.optimizer_bytes``. With buckets at the runtime's default (the whole
model in one), off, and of two blocks.
"""

from __future__ import annotations

import torch

import flashfsdp
from flashfsdp.bindings.autograd import in_backward
from flashfsdp.estimate import estimate
from flashfsdp.models import Llama, LlamaConfig
from flashfsdp.runtime.param_tags import unit_of
from flashfsdp.runtime.states import ShardState
from tests.harness import run_distributed

CONFIG = LlamaConfig(dim=32, n_layers=3, n_heads=2, multiple_of=16, max_seq_len=16)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _instrument(units: list, log: dict) -> None:
    """Wrap each unit's ``unshard``: count the units it gathers (bytes by pass) and sample the
    bytes all units hold right after it; wrap the communicators: count the collectives."""
    for unit in units:
        def unshard(unit=unit, original=unit.unshard):
            issues = unit.state in (ShardState.SHARDED, ShardState.SECONDARY)
            result = original()
            if issues:  # the all-gathers' outputs: int8 packed buffers, else the gathered ones
                packed = {id(q.group): q.packed.numel() for q in result.quantized or ()}
                log["gathers"].append(("backward" if in_backward() else "forward",
                                       sum(packed.get(id(g), g.layout.gathered_size * g.unsharded_flat.element_size())
                                           for g in unit.groups)))
            _sample(units, log)
            return result

        unit.unshard = unshard
    comms = {id(c): c for u in units for c in (u.comm, u.rs_comm, u.post_forward_comm) if c is not None}
    for comm in comms.values():
        def all_gather(out, inp, *args, original=comm.all_gather_into_tensor, **kwargs):
            log["all_gathers"] += 1
            return original(out, inp, *args, **kwargs)

        def reduce_scatter(out, inp, *args, original=comm.reduce_scatter_tensor, **kwargs):
            log["reduce_scatters"].append(inp.numel() * inp.element_size())
            return original(out, inp, *args, **kwargs)

        comm.all_gather_into_tensor = all_gather
        comm.reduce_scatter_tensor = reduce_scatter


def _instrument_buckets(buckets, units: list, log: dict) -> None:
    """Wrap the root's ``Buckets.unshard`` (known after the first forward): count the units it
    gathers and sample the holdings, its gathered buffers included until their copy-out."""
    def unshard(bucket_units, original=buckets.unshard):
        result = original(bucket_units)
        log["bucket_parts"] += result.bucket.parts
        for unit in bucket_units:
            log["gathers"].append(("backward" if in_backward() else "forward",
                                   sum(g.layout.gathered_size * g.unsharded_flat.element_size() for g in unit.groups)))
        _sample(units, log)
        return result

    buckets.unshard = unshard


def _sample(units: list, log: dict) -> None:
    held = [u.memory_bytes() for u in units]
    buckets = sum(p.gathered.untyped_storage().nbytes() for p in {id(p): p for p in log["bucket_parts"]}.values()
                  if not p.direct)
    log["held"].append(sum(h["sharded"] + h["secondary"] + h["unsharded"] + h["gathered"] for h in held) + buckets)


def _policy(param_dtype: str) -> flashfsdp.MixedPrecisionPolicy:
    """"bf16-int8": bf16 parameters all-gathered as int8."""
    dtype, _, gather = param_dtype.partition("-")
    return flashfsdp.MixedPrecisionPolicy(param_dtype=DTYPES[dtype], all_gather_dtype=torch.int8 if gather else None)


def _measure(rank: int, param_dtype: str, reshard, bucket_bytes) -> dict:
    torch.manual_seed(0)
    model = Llama(CONFIG)
    policy = _policy(param_dtype)
    for block in model.layers:
        flashfsdp.fully_shard(block, mp_policy=policy, reshard_after_forward=reshard)
    flashfsdp.fully_shard(model, mp_policy=policy, reshard_after_forward=reshard)
    if bucket_bytes is not None:
        model.set_bucket_bytes(bucket_bytes)
    units = list({id(unit_of(p)): unit_of(p) for p in model.parameters()}.values())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    log = {"gathers": [], "held": [], "reduce_scatters": [], "all_gathers": 0, "bucket_parts": []}
    _instrument(units, log)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.max_seq_len), generator=torch.Generator().manual_seed(rank))
    held_from_step_2 = []
    for step in range(3):
        if step == 1:
            _instrument_buckets(model.__dict__["_flashfsdp_state"].ctx.buckets, units, log)
        log["gathers"], log["held"], log["reduce_scatters"], log["all_gathers"] = [], [], [], 0
        model(tokens).float().logsumexp(-1).mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=False)
        if step:
            held_from_step_2 += log["held"]
    # the state of a DTensor parameter is a DTensor: this rank holds its local tensor
    local = [getattr(t, "to_local", lambda t=t: t)() for s in optim.state.values() for t in s.values() if torch.is_tensor(t)]
    optim_bytes = sum(t.numel() * t.element_size() for t in local)
    return {"held": max(held_from_step_2), "gathers": log["gathers"], "optimizer": optim_bytes,
            "reduce_scatter": sum(log["reduce_scatters"]), "reduce_scatters": len(log["reduce_scatters"]),
            "all_gathers": log["all_gathers"]}


def _cases(rank: int, world_size: int, cases: list) -> list:
    return [_measure(rank, *case) for case in cases]


def _check(cases: list, results: list, world_size: int) -> None:
    for i, (dtype, reshard, bucket_bytes) in enumerate(cases):
        buckets = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}  # None: both at their default
        est = estimate(CONFIG, world_size, reshard_after_forward=reshard, mp_policy=_policy(dtype), **buckets)
        measured = [r[i] for r in results]
        case = f"{dtype}, reshard_after_forward={reshard}, bucket_bytes={bucket_bytes}, W={world_size}"
        held = max(m["held"] for m in measured)
        assert abs(held - est.unit_holdings_bytes) <= 0.05 * held, (case, held, est.unit_holdings_bytes)
        gathers = measured[0]["gathers"]
        assert len(gathers) == est.comm.units_gathered, (case, gathers)
        forward = sum(n for phase, n in gathers if phase == "forward")
        assert (forward, sum(n for _, n in gathers) - forward) == (
            est.comm.all_gather_forward, est.comm.all_gather_backward), case
        assert {(m["all_gathers"], m["reduce_scatters"]) for m in measured} == {
            (est.comm.all_gathers, est.comm.reduce_scatters)}, case
        assert max(m["optimizer"] for m in measured) == est.optimizer_bytes, case
        # the reduce-scatters' inputs: every rank's segment holds its shard and a flag per parameter
        assert {m["reduce_scatter"] for m in measured} == {est.comm.reduce_scatter}, case


# bf16 at W = 2: the root gathers 16,448 bytes, each block 26,752 (reduce-scatters: 16,480 and 26,816)
TWO_BLOCKS = 2 * 26_816


def test_estimate_matches_runtime_holdings_at_two_ranks():
    cases = [("fp32", None, None), ("bf16", None, None), ("fp32", True, None), ("bf16", False, None),
             ("bf16-int8", None, None), ("fp32", None, 0), ("bf16", None, TWO_BLOCKS), ("bf16", True, TWO_BLOCKS)]
    _check(cases, run_distributed(_cases, 2, cases), 2)


def test_estimate_matches_runtime_holdings_with_post_forward_groups_at_four_ranks():
    cases = [("bf16", 2, None), ("bf16-int8", 2, None)]
    _check(cases, run_distributed(_cases, 4, cases), 4)


def _tensor_parallel_layout(rank: int, world_size: int) -> tuple:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: PLC0415
    from torch.testing._internal.common_fsdp import MLP  # noqa: PLC0415

    from flashfsdp.estimate.units import unit_spec  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(MLP(6, dim_multiplier=3), mesh["tp"],
                               {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()})
    estimated = unit_spec("mlp", list(model.parameters()), 1, None, None).groups[0].layout.shapes
    flashfsdp.fully_shard(model, mesh=mesh["dp"])
    return estimated, unit_of(next(model.parameters())).groups[0].layout.shapes


def test_tensor_parallel_parameters_are_estimated_as_the_runtime_shards_them():
    """A parallelize_module'd model's units shard the TP-local tensors: the estimate's layout is
    the runtime's, not one of the TP global shapes."""
    for estimated, runtime in run_distributed(_tensor_parallel_layout, 2):
        assert estimated == runtime == ((9, 6), (9,), (6, 9), (6,)), (estimated, runtime)
