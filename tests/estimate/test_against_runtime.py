"""The estimate against what the runtime really holds and gathers, on CPU gloo ranks.

Each rank shards a small Llama (one unit per block, then the root), trains three steps with AdamW
(``zero_grad(set_to_none=False)``: the gradient shards stay, as the estimate counts them) and, at
every unshard, adds up what every unit holds (``ShardedUnit.memory_bytes``: master and gradient
shards, post-forward slices, unsharded buffers and gathered buffers not yet copied out). The largest sum over steps 2-3 is compared
with ``Estimate.unit_holdings_bytes`` (within 5%), the all-gathers of step 3 with the estimate's
(their outputs' bytes: int8 packed buffers with ``all_gather_dtype=torch.int8``), the
reduce-scatters' inputs of step 3 on every rank with the estimate's (each rank's segment: its shard
and a flag per parameter, padded), and the optimizer state of the busiest rank with
``Estimate.optimizer_bytes``.
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
    """Wrap each unit's ``unshard``: count the all-gathers it issues (bytes by pass) and sample the
    bytes all units hold right after it."""
    for unit in units:
        def unshard(unit=unit, original=unit.unshard):
            issues = unit.state in (ShardState.SHARDED, ShardState.SECONDARY)
            result = original()
            if issues:  # the all-gathers' outputs: int8 packed buffers, else the gathered ones
                packed = {id(q.group): q.packed.numel() for q in result.quantized or ()}
                log["gathers"].append(("backward" if in_backward() else "forward",
                                       sum(packed.get(id(g), g.layout.gathered_size * g.unsharded_flat.element_size())
                                           for g in unit.groups)))
            held = [u.memory_bytes() for u in units]
            log["held"].append(sum(h["sharded"] + h["secondary"] + h["unsharded"] + h["gathered"] for h in held))
            return result

        unit.unshard = unshard
    for comm in {id(c): c for c in (u.rs_comm or u.comm for u in units)}.values():
        def reduce_scatter(out, inp, *args, original=comm.reduce_scatter_tensor, **kwargs):
            log["reduce_scatters"].append(inp.numel() * inp.element_size())
            return original(out, inp, *args, **kwargs)

        comm.reduce_scatter_tensor = reduce_scatter


def _policy(param_dtype: str) -> flashfsdp.MixedPrecisionPolicy:
    """"bf16-int8": bf16 parameters all-gathered as int8."""
    dtype, _, gather = param_dtype.partition("-")
    return flashfsdp.MixedPrecisionPolicy(param_dtype=DTYPES[dtype], all_gather_dtype=torch.int8 if gather else None)


def _measure(rank: int, param_dtype: str, reshard) -> dict:
    torch.manual_seed(0)
    model = Llama(CONFIG)
    policy = _policy(param_dtype)
    for block in model.layers:
        flashfsdp.fully_shard(block, mp_policy=policy, reshard_after_forward=reshard)
    flashfsdp.fully_shard(model, mp_policy=policy, reshard_after_forward=reshard)
    units = list({id(unit_of(p)): unit_of(p) for p in model.parameters()}.values())
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    log = {"gathers": [], "held": [], "reduce_scatters": []}
    _instrument(units, log)
    tokens = torch.randint(0, CONFIG.vocab_size, (2, CONFIG.max_seq_len), generator=torch.Generator().manual_seed(rank))
    held_from_step_2 = []
    for step in range(3):
        log["gathers"], log["held"], log["reduce_scatters"] = [], [], []
        model(tokens).float().logsumexp(-1).mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=False)
        if step:
            held_from_step_2 += log["held"]
    # the state of a DTensor parameter is a DTensor: this rank holds its local tensor
    local = [getattr(t, "to_local", lambda t=t: t)() for s in optim.state.values() for t in s.values() if torch.is_tensor(t)]
    optim_bytes = sum(t.numel() * t.element_size() for t in local)
    return {"held": max(held_from_step_2), "gathers": log["gathers"], "optimizer": optim_bytes,
            "reduce_scatter": sum(log["reduce_scatters"])}


def _cases(rank: int, world_size: int, cases: list) -> list:
    return [_measure(rank, dtype, reshard) for dtype, reshard in cases]


def _check(cases: list, results: list, world_size: int) -> None:
    for i, (dtype, reshard) in enumerate(cases):
        est = estimate(CONFIG, world_size, reshard_after_forward=reshard, mp_policy=_policy(dtype))
        measured = [r[i] for r in results]
        case = f"{dtype}, reshard_after_forward={reshard}, W={world_size}"
        held = max(m["held"] for m in measured)
        assert abs(held - est.unit_holdings_bytes) <= 0.05 * held, (case, held, est.unit_holdings_bytes)
        gathers = measured[0]["gathers"]
        assert len(gathers) == est.comm.all_gathers, (case, gathers)
        forward = sum(n for phase, n in gathers if phase == "forward")
        assert (forward, sum(n for _, n in gathers) - forward) == (
            est.comm.all_gather_forward, est.comm.all_gather_backward), case
        assert max(m["optimizer"] for m in measured) == est.optimizer_bytes, case
        # the reduce-scatters' inputs: every rank's segment holds its shard and a flag per parameter
        assert {m["reduce_scatter"] for m in measured} == {est.comm.reduce_scatter}, case


def test_estimate_matches_runtime_holdings_at_two_ranks():
    cases = [("fp32", None), ("bf16", None), ("fp32", True), ("bf16", False), ("bf16-int8", None)]
    _check(cases, run_distributed(_cases, 2, cases), 2)


def test_estimate_matches_runtime_holdings_with_post_forward_groups_at_four_ranks():
    cases = [("bf16", 2), ("bf16-int8", 2)]
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
