"""Pipeline parallelism in the overlap simulator: the step time of a flashfsdp Llama on a
(pp, dp, tp) mesh, each pipeline rank's stages fully sharded over its dp ranks
(``flashfsdp.estimate.pipeline`` places the blocks and counts memory and bytes).

Each pipeline rank's step is simulated as without pipelining (:func:`~flashfsdp.sim.simulate`:
its units' compute for all M micro-batches' tokens, its FSDP collectives over the dp ranks
overlapping it, TP collectives on the compute path): the slowest rank's step, t_stage, is the
ideal time of the pipeline. A synchronous schedule adds the bubble, (pp − 1) / (v · M) of the
ideal time (GPipe, Huang et al. 2019; 1F1B and interleaved 1F1B, Narayanan et al. 2021, §2.2),
and the fill and drain cross the pp − 1 boundaries in each direction once on the critical path,
each a point-to-point send of one micro-batch's activations (b · s · dim, α + bytes / β on the
pipeline link); the steady state's sends overlap the compute:

    step = t_stage / (1 − bubble) + 2 (pp − 1) (α + b · s · dim · dtype bytes / β),
    bubble = (pp − 1) / (v · M + pp − 1).

Not modelled: the FSDP all-gathers repeated per micro-batch (each rank's units are gathered as
for one pass over its tokens), unequal stages' compute beyond taking the slowest, and
zero-bubble schedules.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace  # the dtypes estimate() reads of a policy (no bindings here)

import torch

from flashfsdp.estimate.pipeline import bubble_fraction, estimate_pipeline, stage_model
from flashfsdp.estimate.units import build_units, param_placement
from flashfsdp.models import config_from_preset

from .link import Link, get_link
from .simulate import Prediction, simulate
from .tensor_parallel import _flat, llama_tp_model


@dataclass(frozen=True)
class PipelinePrediction:
    """The pipeline's step (seconds) and its parts.

    Attributes:
        ranks: each pipeline rank's simulated step without the pipeline (its FSDP step).
        stage_s: the slowest of them (the ideal time t_stage).
        bubble_fraction: (pp − 1) / (v · M + pp − 1).
        p2p_s: the fill and drain's point-to-point time on the critical path.
        step_s: t_stage / (1 − bubble) + p2p_s.
        p2p_bytes_per_step: bytes over the pipeline's boundaries per step, both ways.
        peak_bytes: per pipeline rank, the estimate's total (states, unit working set, activations).
    """

    ranks: tuple[Prediction, ...]
    stage_s: float
    bubble_fraction: float
    p2p_s: float
    step_s: float
    p2p_bytes_per_step: int
    peak_bytes: tuple[int, ...]

    @property
    def bubble_s(self) -> float:
        """The idle time of the step: step − t_stage − p2p."""
        return self.step_s - self.stage_s - self.p2p_s


def _rank_model(config, r, est, tp: int, tokens: int, flops_per_s: float, param_dtype, reduce_dtype):
    """The simulator's model of pipeline rank ``r``: its blocks as ``llama_tp_model`` builds them,
    its root the modules it holds (the output projection's compute only on the last stage)."""
    sub = dataclasses.replace(config, n_layers=len(r.layers))
    model = llama_tp_model(sub, est.dp * tp, tp, tokens=tokens, flops_per_s=flops_per_s, param_dtype=param_dtype,
                           reduce_dtype=reduce_dtype)
    module = stage_model(config, len(r.layers), r.holds_embedding, r.holds_output)
    spec = build_units(module, None, est.dp, param_dtype, reduce_dtype, param_placement(module, tp))[0]
    root = model.root if r.holds_output else dataclasses.replace(model.root, forward_s=0.0, backward_s=0.0,
                                                                  tp_ops=())
    flat = _flat(spec) if spec.groups else {"numel": 0, "flat_numel": 0, "reduce_numel": 0}
    return dataclasses.replace(model, root=dataclasses.replace(root, **flat))


def simulate_pipeline(preset: str, world_size: int, *, pp: int, microbatches: int, schedule: str = "1f1b",
                      virtual_stages: int | None = None, tp: int = 1, microbatch_size: int = 1,
                      seq_len: int | None = None, flops_per_s: float = 400e12, link: "Link | str" = "ib400",
                      pp_link: "Link | str" = "ib400", tp_link: "Link | str" = "nvlink",
                      param_dtype: torch.dtype = torch.bfloat16,
                      reduce_dtype: torch.dtype = torch.float32) -> PipelinePrediction:
    """Predict a step of Llama ``preset`` on a (pp, W / (pp · tp), tp) mesh (see the module docstring).

    Args:
        preset: a ``flashfsdp.models.PRESETS`` name (an untied model).
        world_size: W = pp · dp · tp; pp, microbatches, schedule, virtual_stages, tp,
            microbatch_size, seq_len: as ``flashfsdp.estimate.pipeline.estimate_pipeline``.
        flops_per_s: achieved FLOP/s per GPU (an assumption); link: the dp ranks' link; pp_link:
            the pipeline's point-to-point link; tp_link: the TP ranks' link.
        param_dtype: parameters' and activations' dtype; reduce_dtype: the reduce-scatter's.

    Raises:
        ValueError: sizes that do not fit (named as ``estimate_pipeline`` names them), an unknown link.
    """
    config = config_from_preset(preset)
    est = estimate_pipeline(config, world_size, pp=pp, microbatches=microbatches, schedule=schedule,
                            virtual_stages=virtual_stages, tp=tp, microbatch_size=microbatch_size, seq_len=seq_len,
                            mp_policy=SimpleNamespace(param_dtype=param_dtype, reduce_dtype=reduce_dtype))
    tokens = microbatches * microbatch_size * est.seq_len
    preds = tuple(simulate(_rank_model(config, r, est, tp, tokens, flops_per_s, param_dtype, reduce_dtype),
                           est.dp * tp, link, tp_link=tp_link) for r in est.ranks)
    stage_s = max(p.step_s for p in preds)
    hop = get_link(pp_link)
    p2p_s = 2 * (pp - 1) * (hop.alpha_s + est.p2p_bytes_per_microbatch / tp / hop.bandwidth)
    bubble = bubble_fraction(pp, microbatches, est.virtual_stages)
    return PipelinePrediction(preds, stage_s, bubble, p2p_s, stage_s / (1 - bubble) + p2p_s,
                              est.p2p_bytes_per_step, tuple(r.total_bytes for r in est.ranks))
