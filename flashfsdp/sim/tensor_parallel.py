"""A Llama on a (dp, tp) layout for the overlap simulator: FSDP + tensor parallelism.

``parallelize_llama_tp(model, mesh["tp"])`` then ``fully_shard(block, mesh=mesh["dp"])``
(``flashfsdp.models.tp_plan``, torchtitan's plan with sequence parallelism) changes three things
of a rank's step, which :func:`llama_tp_model` builds into a :class:`~flashfsdp.sim.model.Model`:

- **compute**: the plan splits every matmul over the tp ranks (column-parallel wq/wk/wv/w1/w3 and
  the output projection, row-parallel wo/w2; the attention heads with them), so each unit's FLOPs
  (``llama_model``'s 6·N·D, Kaplan et al. 2020) are divided by tp for the same tokens;
- **FSDP bytes**: each unit shards its TP-local pieces over the dp = W / tp data-parallel ranks,
  laid out as the runtime lays them out (``flashfsdp.estimate.units``: alignment and padding
  included; ``Unit.flat_numel``; the reduce-scatter's input packed as ``runtime/reduce.py`` packs
  it, with a flag per parameter: ``Unit.reduce_numel``), so the all-gathers and reduce-scatters move those bytes over dp
  ranks on the data-parallel link;
- **TP collectives**: the activations' all-gathers and reduce-scatters (and the norm weights'
  gradient all-reduces) of ``flashfsdp.estimate.tp_comm`` (Korthikanti et al. 2022, §4.2.2),
  placed on the compute path (``Unit.tp_ops``): in forward an all-gather before and a
  reduce-scatter after attention and after the feed-forward, in backward their transposes, the
  root's embedding, output projection and logits collectives around the blocks. They run over
  the tp ranks on the TP link (``simulate(..., tp_link=...)``, NVLink by default: a TP group
  within a node) and the compute waits for them; the FSDP collectives overlap as without TP.

Not modelled: TP collectives overlapped with compute (asynchronous TP), activation
checkpointing's repeated forward collectives, HSDP together with TP, and activations' memory.
"""

from __future__ import annotations

import dataclasses

import torch

from flashfsdp.estimate.tp_comm import TPCollective, block_tp_collectives, root_tp_collectives
from flashfsdp.estimate.units import UnitSpec, build_units, param_placement
from flashfsdp.models import Llama, LlamaConfig, config_from_preset
from flashfsdp.models.tp_plan import check_tp_degree

from .link import check_world_size
from .model import LlamaShape, Model, TPOp, Unit, llama_model

__all__ = ["attention_fraction", "llama_tp_model"]


def attention_fraction(config: LlamaConfig, seq_len: int | None = None) -> float:
    """The attention's share of a block's matmul FLOPs (the rest is the feed-forward's): wq, wk,
    wv, wo (2·d² + 2·d·kv parameters, 6 FLOPs per parameter and token) and, with ``seq_len``, the
    attention scores (12·d·seq_len per token, as ``llama_model`` counts them), against w1, w2, w3
    (3·d·ffn_dim). Where a block's TP collectives between the two sit in its compute."""
    d, kv = config.dim, config.kv_heads * config.head_dim
    attention = 6 * (2 * d * d + 2 * d * kv) + (12 * d * seq_len if seq_len else 0)
    return attention / (attention + 18 * d * config.ffn_dim)


def _ops(collectives: tuple[TPCollective, ...], attention: float) -> tuple[TPOp, ...]:
    """The collectives as ``TPOp``s: "start" at 0, "end" at 1, "between" after the attention's
    share of the forward and after the feed-forward's share of the backward (which runs first)."""
    where = {("forward", "between"): attention, ("backward", "between"): 1 - attention}
    return tuple(TPOp(c.kind, c.nbytes, c.pass_, c.part, where.get((c.pass_, c.at), 1.0 if c.at == "end" else 0.0),
                      c.what) for c in collectives)


def _flat(spec: UnitSpec) -> dict:
    """``Unit`` fields of the unit's runtime layout: its gathered flat size, its reduce-scatter's
    input size (``UnitSpec.reduce_scatter_numel``, the runtime's packing: per rank the shard and a
    flag per parameter, padded) and bytes per element.

    Raises:
        ValueError: the unit's flat groups differ in ``param_dtype`` or ``reduce_dtype`` (one
            ``Unit`` has one of each).
    """
    kinds = {(g.param_bytes, g.reduce_bytes) for g in spec.groups}
    if len(kinds) > 1:
        raise ValueError(f"llama_tp_model: unit {spec.name!r} has flat groups of several dtypes {sorted(kinds)}")
    param_bytes, reduce_bytes = kinds.pop()
    return {"numel": spec.numel, "flat_numel": sum(g.layout.gathered_size for g in spec.groups),
            "reduce_numel": spec.reduce_scatter_numel(), "param_bytes": param_bytes, "reduce_bytes": reduce_bytes}


def llama_tp_model(config: LlamaConfig | str, world_size: int, tp: int, *, tokens: int = 8192,
                   flops_per_s: float = 400e12, param_dtype: torch.dtype | None = torch.bfloat16,
                   reduce_dtype: torch.dtype | None = torch.float32, state_bytes: int = 16,
                   seq_len: int | None = None, name: str | None = None) -> Model:
    """A :class:`Model` of one rank of a Llama on a (W / tp, tp) mesh (see the module docstring);
    simulate it at the same ``world_size``.

    Args:
        config: a ``LlamaConfig`` or a preset name of ``flashfsdp.models.PRESETS`` ("70b", ...).
        world_size: W, ranks in all (dp · tp).
        tp: the TP degree (1: FSDP alone, on the runtime's layout).
        tokens: tokens of one TP group's step (rows per data-parallel rank times the sequence
            length), which each of its ranks computes 1/tp of.
        flops_per_s: achieved FLOP/s per rank (an assumption, as in ``llama_model``).
        param_dtype: the unsharded parameters' and the activations' dtype (None: fp32).
        reduce_dtype: the reduce-scatter's dtype (None: ``param_dtype``).
        state_bytes: bytes per sharded element kept between steps (``Unit.state_bytes``).
        seq_len: add the attention-score FLOPs of this sequence length (``llama_model``).
        name: the model's label (default: "Llama <preset> tp<N>").

    Raises:
        ValueError: ``world_size`` < 1, a ``tp`` that is not an integer >= 1 or does not divide
            ``world_size``, a ``tp`` that does not split the model (``check_tp_degree``), an
            unknown preset, or a bad ``tokens`` / ``flops_per_s`` / ``seq_len`` (``llama_model``).
    """
    check_world_size(world_size)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or world_size % tp:
        raise ValueError(f"llama_tp_model: tp must be an integer >= 1 dividing world_size={world_size}, got {tp!r}")
    label = name or f"Llama {config if isinstance(config, str) else 'model'} tp{tp}"
    config = config_from_preset(config) if isinstance(config, str) else config
    check_tp_degree(config, tp)
    shape = LlamaShape(config.n_layers, config.dim, config.ffn_dim, config.vocab_size, config.n_heads,
                       config.kv_heads, config.tie_embeddings)
    activation = (param_dtype or torch.float32).itemsize
    base = llama_model(shape, tokens_per_rank=tokens, flops_per_s=flops_per_s, param_bytes=activation,
                       reduce_bytes=(reduce_dtype or param_dtype or torch.float32).itemsize,
                       state_bytes=state_bytes, seq_len=seq_len, name=label)
    with torch.device("meta"):
        module = Llama(config)
    specs = {s.name: s for s in build_units(module, None, world_size // tp, param_dtype, reduce_dtype,
                                            param_placement(module, tp))}
    attention = attention_fraction(config, seq_len)
    ops = {"<root>": root_tp_collectives(config, tokens, activation, activation) if tp > 1 else (),
           "block": block_tp_collectives(config, tokens, activation, activation) if tp > 1 else ()}

    def unit(u: Unit) -> Unit:
        return dataclasses.replace(u, forward_s=u.forward_s / tp, backward_s=u.backward_s / tp,
                                   tp_ops=_ops(ops.get(u.name, ops["block"]), attention), **_flat(specs[u.name]))

    info = {**base.info, "tp": tp, "dp": world_size // tp, "tokens": tokens}
    return dataclasses.replace(base, root=unit(base.root), blocks=tuple(map(unit, base.blocks)), tp=tp, info=info)
