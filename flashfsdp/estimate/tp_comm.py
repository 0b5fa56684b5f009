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

:func:`block_tp_collectives` and :func:`root_tp_collectives` list them in the order a step runs
them, with where each sits in its unit's compute (the overlap simulator places them on the
compute path from these lists); :func:`tp_step_volume` adds them up.
"""

from __future__ import annotations

from dataclasses import dataclass

from flashfsdp.models import LlamaConfig

from .comm import ring_sent

POSITIONS = ("start", "between", "end")


@dataclass(frozen=True)
class TPCollective:
    """One TP collective of one unit's forward or backward, per rank of the TP group.

    Attributes:
        what: what it moves ("attention input", "logits", ...).
        kind: "all_gather" (``nbytes``: its output), "reduce_scatter" (its input) or "all_reduce".
        nbytes: the buffer's bytes.
        pass_: "forward" or "backward".
        part: 0 or 1: for the root, before (0) or after (1) the blocks' compute in that pass (the
            forward: the embedding before, the output projection after; the backward: the output
            projection's first, the embedding's after the blocks'); a block's are all in part 0.
        at: where in that part's compute: "start", "end", or "between" (a block's attention and
            feed-forward: in forward after the attention, in backward after the feed-forward's
            backward, which runs first).
    """

    what: str
    kind: str
    nbytes: int
    pass_: str
    part: int = 0
    at: str = "start"


def block_tp_collectives(config: LlamaConfig, tokens: int, activation_bytes: int,
                         grad_bytes: int) -> tuple[TPCollective, ...]:
    """One block's TP collectives in step order (forward, then backward; see the module
    docstring); ``tokens``, ``activation_bytes`` and ``grad_bytes`` as :func:`tp_step_volume`."""
    hidden = tokens * config.dim * activation_bytes
    norm = config.dim * grad_bytes
    return (
        TPCollective("attention input", "all_gather", hidden, "forward", 0, "start"),
        TPCollective("attention output", "reduce_scatter", hidden, "forward", 0, "between"),
        TPCollective("feed-forward input", "all_gather", hidden, "forward", 0, "between"),
        TPCollective("feed-forward output", "reduce_scatter", hidden, "forward", 0, "end"),
        TPCollective("feed-forward output gradient", "all_gather", hidden, "backward", 0, "start"),
        TPCollective("feed-forward input gradient", "reduce_scatter", hidden, "backward", 0, "between"),
        TPCollective("attention output gradient", "all_gather", hidden, "backward", 0, "between"),
        TPCollective("attention input gradient", "reduce_scatter", hidden, "backward", 0, "end"),
        TPCollective("attention norm weight gradient", "all_reduce", norm, "backward", 0, "end"),
        TPCollective("feed-forward norm weight gradient", "all_reduce", norm, "backward", 0, "end"),
    )


def root_tp_collectives(config: LlamaConfig, tokens: int, activation_bytes: int,
                        grad_bytes: int) -> tuple[TPCollective, ...]:
    """The root's TP collectives in step order (the embedding, the output projection and its
    logits, the final norm; see the module docstring); arguments as :func:`tp_step_volume`."""
    hidden = tokens * config.dim * activation_bytes
    return (
        TPCollective("embedding output", "reduce_scatter", hidden, "forward", 0, "end"),
        TPCollective("output projection input", "all_gather", hidden, "forward", 1, "start"),
        TPCollective("logits", "all_gather", tokens * config.vocab_size * activation_bytes, "forward", 1, "end"),
        TPCollective("output projection input gradient", "reduce_scatter", hidden, "backward", 0, "end"),
        TPCollective("embedding output gradient", "all_gather", hidden, "backward", 1, "start"),
        TPCollective("final norm weight gradient", "all_reduce", config.dim * grad_bytes, "backward", 1, "end"),
    )


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
    """The TP collectives of one training step (forward and backward) of `config`'s Llama: every
    block's (:func:`block_tp_collectives`) and the root's (:func:`root_tp_collectives`).

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
    step = (config.n_layers * block_tp_collectives(config, tokens, activation_bytes, grad_bytes)
            + root_tp_collectives(config, tokens, activation_bytes, grad_bytes))
    total = {kind: sum(c.nbytes for c in step if c.kind == kind) for kind in ("all_gather", "reduce_scatter")}
    norms = [c.nbytes for c in step if c.kind == "all_reduce"]
    sent = (ring_sent(total["all_gather"], tp, "all_gather") + ring_sent(total["reduce_scatter"], tp, "reduce_scatter")
            + sum(ring_sent(n, tp, "all_reduce") for n in norms))
    return TPVolume(tp, tokens, total["all_gather"], total["reduce_scatter"], sum(norms), len(step), sent)
