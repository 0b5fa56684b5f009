"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) for `flashfsdp.models.Llama`, with
sequence parallelism (Korthikanti et al. 2022): torchtitan's plan (`apply_tp` in
`torchtitan/models/llama3/infra/parallelize.py`) written with `torch.distributed.tensor.parallel`.

Per block: the RMSNorms run on sequence shards (`SequenceParallel`: weights replicated over the TP
mesh, activations `Shard(1)`); attention and feed-forward all-gather their input along the
sequence (`PrepareModuleInput`), wq/wk/wv and w1/w3 are column-parallel (each rank computes
`n_heads / tp` heads, `ffn_dim / tp` hidden units) and wo/w2 row-parallel with a reduce-scatter
back to sequence shards. The token embedding is row-parallel (vocabulary rows) with sequence-
sharded output; the output projection column-parallel (vocabulary columns), its logits
all-gathered (`Replicate`, a plain full tensor) or left vocabulary-sharded for `loss_parallel`.
A tied output projection shares the embedding's `Shard(0)` DTensor.

Then `fully_shard(block, mesh=mesh["dp"])` per block and for the root shards every TP-local
piece over the data-parallel ranks (FSDP2's 2-D parallelism).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module)

from flashfsdp.models.llama import Llama, LlamaConfig


# The dim each weight is split along over the TP ranks: column-parallel projections and the
# embedding's vocabulary rows 0, row-parallel projections 1 (input features). The RMSNorm weights
# (and anything else) stay whole: replicated over the TP ranks.
BLOCK_SHARD_DIMS = {"attention.wq": 0, "attention.wk": 0, "attention.wv": 0, "attention.wo": 1,
                    "feed_forward.w1": 0, "feed_forward.w2": 1, "feed_forward.w3": 0}
ROOT_SHARD_DIMS = {"tok_embeddings": 0, "output": 0}


def tp_local_shape(name: str, shape: tuple[int, ...], tp: int) -> tuple[tuple[int, ...], bool]:
    """The shape of the piece of parameter `name` (as `Llama.named_parameters` names it, e.g.
    "layers.0.attention.wq.weight") that the busiest of `tp` TP ranks holds under the plan, and
    whether the plan splits it (False: replicated over the TP ranks).

    Shapes: `shape` is the full (global) shape; the split dim becomes ceil(d / tp), as
    `torch.chunk` cuts it for a DTensor's `Shard`.
    """
    module = name.rsplit(".", 1)[0]
    block_module = module.split(".", 2)[2] if module.startswith("layers.") else None
    dim = BLOCK_SHARD_DIMS.get(block_module) if block_module is not None else ROOT_SHARD_DIMS.get(module)
    if dim is None or tp == 1:
        return tuple(shape), dim is not None
    local = list(shape)
    local[dim] = -(-local[dim] // tp)
    return tuple(local), True


def check_tp_degree(config: LlamaConfig, tp: int, option: str = "tp", sequence_parallel: bool = True) -> None:
    """Check that `config` splits over `tp` tensor-parallel ranks.

    Args:
        config: the model's shape.
        tp: the TP degree (ranks of one TP group).
        option: the name given in the messages (a command line says "--tp").
        sequence_parallel: also check `max_seq_len`, which sequence parallelism cuts evenly.

    Raises:
        ValueError: `tp` < 1, or `n_heads`, the key/value heads, `ffn_dim` or (with
            `sequence_parallel`) `max_seq_len` not divisible by `tp` (the message names `option`
            and the field).
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"{option} must be a positive integer, got {tp!r}")
    fields = [("n_heads", config.n_heads), ("n_kv_heads", config.kv_heads), ("ffn_dim", config.ffn_dim)]
    if sequence_parallel:
        fields.append(("max_seq_len", config.max_seq_len))
    for field, value in fields:
        if value % tp:
            raise ValueError(f"{option} {tp} does not divide the model's {field} ({value}); "
                             f"give a {option} that divides {field}")


def parallelize_llama_tp(model: Llama, tp_mesh: DeviceMesh, *, sequence_parallel: bool = True,
                         loss_parallel: bool = False) -> Llama:
    """Apply the tensor-parallel plan to `model` in place (before any `fully_shard`).

    The parameters become DTensors on `tp_mesh`: wq/wk/wv/w1/w3 and the output projection
    `Shard(0)` (output features), wo/w2 `Shard(1)` (input features), the embedding `Shard(0)`
    (vocabulary rows); with `sequence_parallel` the RMSNorm weights are `Replicate()` DTensors,
    without it they stay plain tensors and the blocks' activations stay replicated.

    Shapes: the model still maps int64 tokens (batch, seq), the same on every TP rank, to logits
    (batch, seq, vocab_size): a plain tensor (full logits), or with `loss_parallel` a DTensor
    `Shard(-1)` over the vocabulary for `torch.distributed.tensor.parallel.loss_parallel()`.
    With `sequence_parallel`, seq is cut over the TP ranks between the blocks (`Shard(1)`): it
    must be a multiple of the TP degree (`model.seq_multiple` says it; `generate` pads to it).

    Args:
        model: a `Llama` (on the meta device or materialised, identical on every TP rank).
        tp_mesh: a 1-D mesh of the TP ranks (`mesh["tp"]` of a (dp, tp) mesh).
        sequence_parallel: shard the norms' activations over the sequence (SP).
        loss_parallel: leave the logits vocabulary-sharded.

    Returns:
        `model`.

    Raises:
        ValueError: `tp_mesh` not 1-D, or the model's heads, hidden width or (with
            `sequence_parallel`) max_seq_len not divisible by its size (`check_tp_degree`).
    """
    if tp_mesh.ndim != 1:
        raise ValueError(f"parallelize_llama_tp: tp_mesh must be 1-D, got a {tp_mesh.ndim}-D mesh; "
                         "pass mesh['tp'] of a (dp, tp) mesh")
    check_tp_degree(model.config, tp_mesh.size(), "tp_mesh.size()", sequence_parallel)
    seq = Shard(1) if sequence_parallel else Replicate()
    root_plan = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                  use_local_output=not loss_parallel),
    }
    if sequence_parallel:
        root_plan["norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, root_plan)
    if model.config.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight  # both Shard(0) over the vocabulary
    if sequence_parallel:
        model.seq_multiple = tp_mesh.size()
    for block in model.layers:
        parallelize_module(block, tp_mesh, _block_plan(sequence_parallel))
    return model


def _block_plan(sequence_parallel: bool) -> dict[str, nn.Module]:
    """One block's plan: torchtitan's (SP) or plain Megatron (activations replicated)."""
    seq = Shard(1) if sequence_parallel else Replicate()
    plan = {
        "attention": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
        "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
    }
    for name, dim in BLOCK_SHARD_DIMS.items():
        plan[name] = ColwiseParallel() if dim == 0 else RowwiseParallel(output_layouts=seq)
    if sequence_parallel:
        plan["attention_norm"] = SequenceParallel()
        plan["ffn_norm"] = SequenceParallel()
    return plan
