"""Pipeline parallelism (``torch.distributed.pipelining``) with flashfsdp units: a Llama's blocks
split into stages over ``pp`` ranks, each stage's blocks ``fully_shard``'ed over the ``dp`` ranks
of its pipeline rank (W = pp · dp · tp), as torchtitan builds it.

Per pipeline rank (``estimate_pipeline``):

- **stages**: ``pp · v`` stages (v = 1, or the virtual stages per rank of the interleaved
  schedule), each of ⌊L / (pp·v)⌋ blocks (the first L mod (pp·v) one more); rank r holds
  stages r, r + pp, ... (torch's looped placement). The first stage also holds the embedding,
  the last the final norm and the output projection.
- **states and unit working set**: :func:`~flashfsdp.estimate.estimate` of the rank's modules
  (a ``Llama`` of its blocks, with the embedding / norm and output only where it holds them)
  over the dp · tp ranks of its stage: ZeRO-3 states, unsharded units, gradients and
  reduce-scatter buffers, from the runtime's layout.
- **activations** of the micro-batches in flight (:func:`in_flight`): GPipe holds all M
  micro-batches' forwards before the first backward (Huang et al. 2019, "GPipe"); 1F1B holds
  min(M, pp − r) on rank r (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training
  on GPU Clusters Using Megatron-LM", §2.2.1; torch's ``Schedule1F1B`` warm-up); interleaved 1F1B
  holds its warm-up forwards plus one, each a virtual stage's, as torch's
  ``ScheduleInterleaved1F1B`` orders them (``_get_warmup_ops``: (v − 1) · M_round + 2 (pp − 1 − r),
  capped at v · M). A block's activations per micro-batch are the tensors autograd saves
  (:func:`block_activation_bytes`; no activation checkpointing).
- **the bubble**: (pp − 1) / (M + pp − 1) of the step for GPipe and 1F1B, (pp − 1) / (v · M + pp − 1)
  interleaved (Narayanan et al. 2021, §2.2: the bubble (p − 1)/(v·m) of the ideal time, as a
  share of the whole step).
- **point-to-point bytes**: per stage boundary and micro-batch, b · s · dim elements of the
  activation dtype forward and as many backward (the gradient); ``pp · v − 1`` boundaries.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from flashfsdp.models import Llama, LlamaConfig, config_from_preset

from .estimate import Estimate, estimate

SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


@dataclass(frozen=True)
class StageEstimate:
    """One pipeline rank (bytes per rank of its dp · tp group).

    Attributes:
        pp_rank: r; stages: the stage indices it holds; layers: its blocks' indices in the model.
        holds_embedding, holds_output: whether it holds the first / the last stage's extra modules.
        fsdp: the FSDP estimate of its modules over its dp · tp ranks (states, unit working set).
        in_flight: the micro-batches whose activations it holds at once (per stage it holds:
            interleaved counts virtual-stage forwards).
        activation_bytes: the activations of those micro-batches (see the module docstring).
    """

    pp_rank: int
    stages: tuple[int, ...]
    layers: tuple[int, ...]
    holds_embedding: bool
    holds_output: bool
    fsdp: Estimate
    in_flight: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        """States + the unit working set (``Estimate.total_bytes``) + activations."""
        return self.fsdp.total_bytes + self.activation_bytes


@dataclass(frozen=True)
class PipelineEstimate:
    """The estimate of a (pp, dp, tp) layout (see the module docstring).

    Attributes:
        pp, dp, tp: the mesh (W = pp · dp · tp); virtual_stages: v (1 unless interleaved).
        schedule: "gpipe", "1f1b" or "interleaved1f1b"; microbatches: M per step.
        microbatch_size: b, sequences per micro-batch; seq_len: s, tokens per sequence.
        activation_bytes_per_element: the activations' dtype size (``param_dtype``'s).
        dim: the model's hidden size; ranks: a :class:`StageEstimate` per pipeline rank.
    """

    pp: int
    dp: int
    tp: int
    virtual_stages: int
    schedule: str
    microbatches: int
    microbatch_size: int
    seq_len: int
    activation_bytes_per_element: int
    dim: int
    ranks: tuple[StageEstimate, ...]

    @property
    def world_size(self) -> int:
        """W = pp · dp · tp."""
        return self.pp * self.dp * self.tp

    @property
    def bubble_fraction(self) -> float:
        """The pipeline bubble's share of the step: (pp − 1) / (v · M + pp − 1)."""
        return bubble_fraction(self.pp, self.microbatches, self.virtual_stages)

    @property
    def boundaries(self) -> int:
        """Stage boundaries a micro-batch crosses: pp · v − 1."""
        return self.pp * self.virtual_stages - 1

    @property
    def p2p_bytes_per_microbatch(self) -> int:
        """Bytes one boundary moves one way for one micro-batch: b · s · dim · dtype bytes."""
        return self.microbatch_size * self.seq_len * self.dim * self.activation_bytes_per_element

    @property
    def p2p_bytes_per_step(self) -> int:
        """Bytes over all boundaries of one pipeline (one dp replica) per step, forward and
        backward: 2 · M · (pp · v − 1) · b · s · dim · dtype bytes."""
        return 2 * self.microbatches * self.boundaries * self.p2p_bytes_per_microbatch

    @property
    def p2p_sent_per_rank(self) -> int:
        """The most bytes one pipeline rank sends per step: each of its stages but the last
        sends its activations forward, each but the first their gradients backward."""
        sends = max(sum((s < self.boundaries) + (s > 0) for s in r.stages) for r in self.ranks)
        return sends * self.microbatches * self.p2p_bytes_per_microbatch

    @property
    def peak_rank(self) -> StageEstimate:
        """The pipeline rank that holds the most (the one that sets the memory needed)."""
        return max(self.ranks, key=lambda r: r.total_bytes)


def bubble_fraction(pp: int, microbatches: int, virtual_stages: int = 1) -> float:
    """(pp − 1) / (v · M + pp − 1): the idle share of a synchronous pipeline's step (GPipe,
    Huang et al. 2019; 1F1B and interleaved 1F1B, Narayanan et al. 2021, §2.2)."""
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)


def stage_layers(n_layers: int, stages: int) -> list[range]:
    """The blocks of each of ``stages`` stages: ⌊L / stages⌋ each, the first L mod stages one more."""
    base, extra = divmod(n_layers, stages)
    starts = [s * base + min(s, extra) for s in range(stages + 1)]
    return [range(starts[s], starts[s + 1]) for s in range(stages)]


def in_flight(schedule: str, pp: int, pp_rank: int, microbatches: int, virtual_stages: int = 1) -> int:
    """Micro-batch forwards (of one stage each) whose activations rank ``pp_rank`` holds at its
    peak, as torch's schedules order them (see the module docstring)."""
    if schedule == "gpipe":
        return microbatches * virtual_stages
    if schedule == "1f1b":
        return min(microbatches, pp - pp_rank)
    per_round = microbatches // max(1, microbatches // pp)
    warmup = (virtual_stages - 1) * per_round + 2 * (pp - 1 - pp_rank)
    return min(warmup + 1, microbatches * virtual_stages)


def block_activation_bytes(config: LlamaConfig, batch: int, seq: int, act_bytes: int, tp: int = 1) -> int:
    """Bytes a flashfsdp Llama block saves for backward for ``batch`` sequences of ``seq`` tokens
    (no activation checkpointing), each tensor autograd keeps counted once: per token, in the
    activation dtype (``act_bytes``), each RMSNorm's normalised input and its output (4·dim), q and
    k after the rotary embedding and v (dim + 2·kv), attention's output, which is wo's input
    (dim: the flash kernels lay it out (batch, seq, heads, head_dim), so the reshape is a view),
    w1's and w3's outputs, SiLU's output and w2's input (4·ffn); in fp32 each RMSNorm's fp32 input
    and inverse RMS (2·dim + 2) and attention's log-sum-exp (one per head: the flash kernels keep
    no seq² score matrix); per sequence position the rotary cos and sin (2·head_dim fp32).
    Under tensor parallelism with sequence parallelism every term is split over the tp ranks
    (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
    §4.2.2). Equal to autograd's saved tensors on CPU (``tests/estimate/test_pipeline.py``)."""
    d, kv, f = config.dim, config.kv_heads * config.head_dim, config.ffn_dim
    per_token = act_bytes * (6 * d + 2 * kv + 4 * f) + 4 * (2 * d + 2 + config.n_heads)
    return (batch * seq * per_token + 2 * seq * config.head_dim * 4) // tp


def root_activation_bytes(config: LlamaConfig, tokens: int, act_bytes: int, first: bool, last: bool,
                          tp: int = 1) -> int:
    """The embedding's (its int64 indices) and the output's activations per micro-batch: the final
    RMSNorm's (as a block's), the output projection's input, and the logits in the activation
    dtype with their fp32 log-softmax for the cross-entropy (4 + act_bytes per vocabulary entry)."""
    nbytes = 8 * tokens if first else 0
    if last:
        d = config.dim
        norm = act_bytes * 2 * d + 4 * (d + 1)
        nbytes += tokens * (norm + (act_bytes + 4) * config.vocab_size // tp)
    return nbytes


def _check(pp: int, tp: int, world_size: int, microbatches: int, schedule: str, virtual_stages: int,
           n_layers: int, microbatch_size: int) -> None:
    """One-line errors naming the arguments (the CLI prints them with its flags' names)."""
    for name, value in (("pp (--pp)", pp), ("microbatches (--microbatches)", microbatches),
                        ("virtual_stages (--virtual-stages)", virtual_stages), ("microbatch_size (--microbatch-size)",
                                                                                  microbatch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule (--schedule): unknown {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if isinstance(tp, int) and tp >= 1 and world_size % (pp * tp):
        raise ValueError(f"world_size (--world-size) {world_size} must be pp x dp x tp: pp (--pp) {pp} x tp (--tp) "
                         f"{tp} = {pp * tp} does not divide it")
    if virtual_stages > 1 and schedule != "interleaved1f1b":
        raise ValueError(f"virtual_stages (--virtual-stages) {virtual_stages} > 1 needs schedule (--schedule) "
                         f"interleaved1f1b")
    if schedule == "interleaved1f1b" and microbatches % max(1, microbatches // pp):
        raise ValueError(f"microbatches (--microbatches) {microbatches}: interleaved1f1b needs a multiple of its "
                         f"rounds, max(1, M // pp) = {max(1, microbatches // pp)}, as torch's schedule does")
    if pp * virtual_stages > n_layers:
        raise ValueError(f"pp (--pp) {pp} x virtual_stages (--virtual-stages) {virtual_stages} = "
                         f"{pp * virtual_stages} stages, but the model has {n_layers} blocks")


class LlamaStage(Llama):
    """A pipeline stage of a ``Llama`` (torchtitan's stage modules): the modules it does not hold
    are None; it embeds token ids where it holds the embedding, else takes the previous stage's
    hidden states (batch, seq, dim), and returns logits where it holds the output, else hidden states."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids or hidden states -> hidden states or logits (see the class docstring)."""
        h = self.tok_embeddings(x) if self.tok_embeddings is not None else x
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h)) if self.output is not None else h


def stage_model(config: LlamaConfig, layers: int, first: bool, last: bool, device: str = "meta") -> LlamaStage:
    """The modules of a pipeline rank (on the meta device unless told): a :class:`LlamaStage` of
    its ``layers`` blocks, its embedding only where it holds the first stage, its final norm and
    output projection only where it holds the last (torchtitan's stage modules)."""
    with torch.device(device):
        model = LlamaStage(dataclasses.replace(config, n_layers=layers))
    if not first:
        model.tok_embeddings = None
    if not last:
        model.norm = model.output = None
    return model


def estimate_pipeline(model_or_config: LlamaConfig | str, world_size: int, *, pp: int, microbatches: int,
                      schedule: str = "1f1b", virtual_stages: int | None = None, tp: int = 1,
                      microbatch_size: int = 1, seq_len: int | None = None, master_dtype: torch.dtype | None = None,
                      **fsdp_options) -> PipelineEstimate:
    """The memory per pipeline rank, the bubble and the point-to-point bytes of a flashfsdp Llama
    on a (pp, dp, tp) mesh (see the module docstring).

    Args:
        model_or_config: a ``LlamaConfig`` or a preset name (a ``Llama``'s config is taken).
        world_size: W = pp · dp · tp.
        pp: pipeline ranks; microbatches: M per step; schedule: one of :data:`SCHEDULES`.
        virtual_stages: stages per rank (interleaved1f1b only; None: 2 there, else 1).
        tp: the tensor-parallel degree within a stage.
        microbatch_size: sequences per micro-batch (b); seq_len: tokens per sequence (None: the
            config's ``max_seq_len``).
        master_dtype: the parameters' dtype (None: fp32).
        **fsdp_options: :func:`~flashfsdp.estimate.estimate`'s options (``mp_policy``,
            ``optimizer``, ``bucket_bytes``, ...) for each rank's stages over its dp · tp ranks.

    Raises:
        ValueError: a size that does not fit (the message names the argument), tied embeddings
            (they would span the first and the last stage), or what ``estimate`` refuses.
    """
    config = model_or_config.config if isinstance(model_or_config, Llama) else model_or_config
    config = config_from_preset(config) if isinstance(config, str) else config
    v = virtual_stages if virtual_stages is not None else (2 if schedule == "interleaved1f1b" else 1)
    _check(pp, tp, world_size, microbatches, schedule, v, config.n_layers, microbatch_size)
    if config.tie_embeddings and pp * v > 1:
        raise ValueError("pp (--pp): the model ties its embedding and output projection, which would live on the first "
                         "and the last stage; use an untied model")
    seq_len = seq_len or config.max_seq_len
    dtype = master_dtype or torch.float32
    act = (getattr(fsdp_options.get("mp_policy"), "param_dtype", None) or dtype).itemsize
    splits = stage_layers(config.n_layers, pp * v)
    ranks = []
    for r in range(pp):
        stages = tuple(range(r, pp * v, pp))
        layers = tuple(i for s in stages for i in splits[s])
        first, last = 0 in stages, pp * v - 1 in stages
        module = stage_model(config, len(layers), first, last).to(dtype)
        fsdp = estimate(module, world_size // pp, tp=tp, **fsdp_options)
        count = in_flight(schedule, pp, r, microbatches, v)
        tokens = microbatch_size * seq_len
        chunk = max(len(splits[s]) for s in stages) * block_activation_bytes(config, microbatch_size, seq_len, act, tp)
        extra = root_activation_bytes(config, tokens, act, first, last, tp)
        # each in-flight forward holds a stage's blocks; the first/last stage's extras per micro-batch of theirs
        own = min(count, microbatches) if schedule != "interleaved1f1b" else -(-count // v)
        ranks.append(StageEstimate(r, stages, layers, first, last, fsdp, count, count * chunk + own * extra))
    return PipelineEstimate(pp, world_size // (pp * tp), tp, v, schedule, microbatches, microbatch_size, seq_len,
                            act, config.dim, tuple(ranks))
