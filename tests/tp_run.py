"""A 2x2 (dp, tp) run of the project's Llama with its TP plan on CPU gloo ranks, counting the bytes
of the collectives each rank dispatches in its second step: DTensor's functional collectives are
the TP ones ("tp"), c10d's the FSDP ones ("fsdp"). On gloo the runtime runs a reduce-scatter as an
all-to-all of its input (``runtime/process_group.py``), counted as ("fsdp", "reduce_scatter") of its
input buffer."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from flashfsdp.models import Llama, LlamaConfig

CONFIG = LlamaConfig(dim=32, n_layers=2, n_heads=4, multiple_of=16, max_seq_len=8)
ROWS = 3  # sequences per data-parallel rank


class Collectives(TorchDispatchMode):
    """Bytes of the collectives dispatched, by (kind, collective): an all-gather's output, a
    reduce-scatter's input, an all-reduce's tensor."""

    def __init__(self):
        super().__init__()
        self.bytes = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        kind = {"_c10d_functional": "tp", "c10d": "fsdp"}.get(func.namespace)
        name = func._opname
        if kind is not None and ("gather" in name or "scatter" in name or "reduce" in name or "alltoall" in name):
            gathered = "gather" in name
            tensor = out if gathered and kind == "tp" else args[1] if "alltoall" in name else args[0]
            tensor = tensor[0] if isinstance(tensor, (list, tuple)) else tensor
            op = ("all_gather" if gathered else "reduce_scatter" if "scatter" in name or "alltoall" in name
                  else "all_reduce")
            key = (kind, op)
            self.bytes[key] = self.bytes.get(key, 0) + tensor.numel() * tensor.element_size()
        return out


def measure_2x2(rank: int, world_size: int) -> dict:
    """Two AdamW steps at (dp, tp) = (2, 2), fp32; the second step's collective bytes
    (``"collectives"``) and this rank's optimizer state bytes (``"optimizer"``)."""
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
        with Collectives() as seen:
            logits = model(tokens[:, :-1])
            F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optim.step()
        optim.zero_grad()
    local = [t.to_local() if hasattr(t, "to_local") else t for s in optim.state.values() for t in s.values()]
    return {"collectives": seen.bytes, "optimizer": sum(t.numel() * t.element_size() for t in local)}
