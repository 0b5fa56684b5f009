"""The estimate at a (dp, tp) layout: states divided by dp·tp for split weights and by dp for the
replicated norms, FSDP collectives over the dp ranks, the TP plan's activation collectives; checked
against flashfsdp at a 2x2 (dp, tp) layout on CPU gloo ranks (collectives counted as they are
dispatched: DTensor's functional collectives are the TP ones, c10d's the FSDP ones; optimizer
state of the busiest rank); bad input named; shard_placement_fn lays out along its dim."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard
from torch.utils._python_dispatch import TorchDispatchMode

from flashfsdp.estimate import estimate
from flashfsdp.models import Llama, LlamaConfig
from tests.harness import run_distributed

CONFIG = LlamaConfig(dim=32, n_layers=2, n_heads=4, multiple_of=16, max_seq_len=8)
ROWS = 3  # sequences per data-parallel rank


def test_split_weights_are_divided_by_dp_tp_and_norms_by_dp():
    one_d, two_d = estimate(CONFIG, 4), estimate(CONFIG, 4, tp=2)
    assert two_d.tp == 2 and two_d.shard_group_size == 2 and two_d.replicas == 1 and one_d.tp_comm is None
    norms = (2 * CONFIG.n_layers + 1) * CONFIG.dim
    split = CONFIG.num_params() - norms
    # AdamW's two fp32 moments of the busiest rank's pieces (each divides evenly here) + a step each
    scalars = 4 * len(list(Llama(CONFIG).parameters()))
    assert two_d.optimizer_bytes - scalars == 2 * 4 * (split // 4 + norms // 2)
    assert one_d.optimizer_bytes - scalars == 2 * 4 * CONFIG.num_params() // 4
    assert two_d.comm.all_gather_forward < estimate(CONFIG, 2).comm.all_gather_forward


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=3), "tp=3 must divide world_size=4"),
    (dict(tp=0), "tp must be an integer >= 1"),
    (dict(tp=4), "tp 4 does not divide the model's n_kv_heads"),
])
def test_bad_tp_is_named(kwargs, message):
    config = LlamaConfig(**{**CONFIG.__dict__, "n_kv_heads": 2})
    with pytest.raises(ValueError, match=message):
        estimate(config, 4, **kwargs)
    with pytest.raises(ValueError, match="tp=2 needs a flashfsdp Llama"):
        estimate(torch.nn.Sequential(torch.nn.Linear(4, 4)), 2, tp=2)


def test_shard_placement_fn_lays_out_along_its_dim():
    model = torch.nn.Sequential(torch.nn.Linear(16, 3, bias=False))  # weight (3, 16)
    along_0 = estimate(model, 4)
    along_1 = estimate(model, 4, shard_placement_fn=lambda p: Shard(1))
    assert along_0.master_bytes == 4 * 16  # ceil(3 / 4) = 1 row of 16 per rank
    assert along_1.master_bytes == 4 * 12  # 4 columns of 3 per rank


class _Collectives(TorchDispatchMode):
    """Bytes of the collectives dispatched: DTensor's functional ones ("tp") and c10d's ("fsdp")."""

    def __init__(self):
        super().__init__()
        self.bytes = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = {"_c10d_functional": "tp", "c10d": "fsdp"}.get(func.namespace)
        name = func._opname
        if kind is not None and ("gather" in name or "scatter" in name or "reduce" in name):
            gathered = "gather" in name
            tensor = out if gathered and kind == "tp" else args[0]
            tensor = tensor[0] if isinstance(tensor, (list, tuple)) else tensor
            op = "all_gather" if gathered else "reduce_scatter" if "scatter" in name else "all_reduce"
            key = (kind, op)
            self.bytes[key] = self.bytes.get(key, 0) + tensor.numel() * tensor.element_size()
        return out


def _measure(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from flashfsdp import fully_shard  # noqa: PLC0415
    from flashfsdp.models.tp_plan import parallelize_llama_tp  # noqa: PLC0415

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = Llama(CONFIG)
    model.init_weights(0)
    parallelize_llama_tp(model, mesh["tp"])
    for block in model.layers:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, CONFIG.vocab_size, (ROWS, CONFIG.max_seq_len + 1),
                           generator=torch.Generator().manual_seed(mesh["dp"].get_local_rank()))
    for _ in range(2):
        with _Collectives() as seen:
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optim.step()
        optim.zero_grad()
    local = [t.to_local() if hasattr(t, "to_local") else t for s in optim.state.values() for t in s.values()]
    return {"collectives": seen.bytes, "optimizer": sum(t.numel() * t.element_size() for t in local)}


def test_estimate_matches_a_2x2_dp_tp_run():
    results = run_distributed(_measure, 4)
    est = estimate(CONFIG, 4, tp=2, tokens=ROWS * CONFIG.max_seq_len)
    assert max(r["optimizer"] for r in results) == est.optimizer_bytes
    for r in results:
        seen = r["collectives"]
        assert seen[("tp", "all_gather")] == est.tp_comm.all_gather
        assert seen[("tp", "reduce_scatter")] == est.tp_comm.reduce_scatter
        assert seen.get(("tp", "all_reduce"), 0) == est.tp_comm.all_reduce, seen
        assert seen[("fsdp", "all_gather")] == est.comm.all_gather_forward + est.comm.all_gather_backward, seen
