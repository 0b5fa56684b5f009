"""Bytes the tensor-parallel ranks exchange per step: the activations of the Llama TP plan with
sequence parallelism (`flashfsdp.models.tp_plan`, torchtitan's), per rank of one TP group.

Between the blocks the activations are cut along the sequence (`Shard(1)`); each block gathers
them before attention and before the feed-forward and reduce-scatters the row-parallel outputs
back (Korthikanti et al. 2022, §4.2.2: 4 all-gathers and 4 reduce-scatters of b·s·h elements per
block and step, forward and backward together: the backward of an all-gather is a reduce-scatter
and the other way round). The root adds the embedding's reduce-scatter (its backward an
all-gather), the output projection's input all-gather (backward: a reduce-scatter) and the
all-gather of the vocabulary-sharded logits (b·s·V; backward: a local slice). The RMSNorm weights,
replicated over the TP ranks, get partial gradients from each rank's sequence shard: one all-reduce
of h elements per norm. Activation checkpointing repeats the forward's collectives in backward
(not counted here).
"""

from __future__ import annotations

from dataclasses import dataclass

from flashfsdp.models import LlamaConfig

from .comm import ring_sent


@dataclass(frozen=True)
class TPVolume:
    """One step's TP communication on one rank (bytes; ring model for `sent`).

    Attributes:
        tp: ranks of the TP group.
        tokens: tokens of the step on the group (batch rows times sequence length).
        all_gather: the all-gathers' output bytes; reduce_scatter: the reduce-scatters' input
            bytes; all_reduce: the norm gradients' all-reduced bytes.
        collectives: how many collectives the step runs.
        sent: bytes this rank sends in them.
    """

    tp: int
    tokens: int
    all_gather: int
    reduce_scatter: int
    all_reduce: int
    collectives: int
    sent: float


def tp_step_volume(config: LlamaConfig, tp: int, tokens: int, activation_bytes: int, grad_bytes: int) -> TPVolume:
    """The TP collectives of one training step (forward and backward) of `config`'s Llama.

    Args:
        config: the model's shape (h = dim, V = vocab_size, n_layers blocks).
        tp: the TP degree (1: no TP collectives).
        tokens: tokens the TP group computes in the step (rows per data-parallel rank times the
            sequence length, all micro-batches).
        activation_bytes: bytes per element of the activations (the compute dtype).
        grad_bytes: bytes per element of the norm weights' gradients (the compute dtype).

    Raises:
        ValueError: `tp` < 1 or `tokens` < 1.
    """
    if tp < 1 or tokens < 1:
        raise ValueError(f"tp_step_volume: tp ({tp}) and tokens ({tokens}) must be >= 1")
    if tp == 1:
        return TPVolume(1, tokens, 0, 0, 0, 0, 0.0)
    hidden = tokens * config.dim * activation_bytes
    gathers = 4 * config.n_layers + 2  # + the embedding's backward, the output's input
    scatters = 4 * config.n_layers + 2  # + the embedding's forward, the output's input gradient
    logits = tokens * config.vocab_size * activation_bytes
    norms = 2 * config.n_layers + 1
    all_gather = gathers * hidden + logits
    reduce_scatter = scatters * hidden
    all_reduce = norms * config.dim * grad_bytes
    sent = (ring_sent(all_gather, tp, "all_gather") + ring_sent(reduce_scatter, tp, "reduce_scatter")
            + sum(ring_sent(config.dim * grad_bytes, tp, "all_reduce") for _ in range(norms)))
    return TPVolume(tp, tokens, all_gather, reduce_scatter, all_reduce, gathers + 1 + scatters + norms, sent)
