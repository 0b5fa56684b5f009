"""Overlap simulator: predict step time, exposed communication and peak memory of sharded training.

From a model's units (parameter bytes, forward/backward compute per unit, measured by
``flashfsdp.profile()`` or derived from FLOPs), the world size W and an α–β link model, the
simulator replays the runtime's own schedule policy (:mod:`flashfsdp.runtime.schedule`) on a
compute stream and two communication streams and predicts one step. Times are seconds, sizes bytes.

    >>> from flashfsdp import sim
    >>> p = sim.simulate(sim.llama3_8b(), world_size=64, link="ib400")
    >>> round(p.efficiency, 2)  # doctest: +SKIP

``simulate_ranks`` runs several ranks, each with its own compute, coupled by their collectives (a
collective starts when the last rank issued it); a :class:`Contention` makes compute and in-flight
collectives slow each other down, as on CPU hosts where gloo's thread shares the cores. Passing a
:class:`Hierarchy` as the link models HSDP: sharding within groups of S ranks on a fast link
(NVLink), and an all-reduce of each reduced shard across the W / S replicas on a slow one
(InfiniBand), e.g. ``sim.simulate(sim.llama3_8b(), 4096, sim.Hierarchy("nvlink", "ib400", 8))``.
A model built by :func:`llama_tp_model` runs on a (dp, tp) layout (FSDP + tensor parallelism):
compute divided by tp, FSDP over the W / tp data-parallel ranks of the TP-local pieces, the TP
plan's activation collectives on the compute path over ``tp_link``, e.g.
``sim.simulate(sim.llama_tp_model("70b", 64, 8), 64, "ib400", tp_link="nvlink")``;
``python -m flashfsdp.sim --preset 70b --world-size 64 --tp 8`` prints such a prediction.
``bucket_bytes`` lets small units that run back to back share one all-gather and one
reduce-scatter, as the runtime's buckets do (its default, ``runtime.step.DEFAULT_BUCKET_BYTES``;
the simulator's default 0 predicts unit by unit).

Modules: :mod:`~flashfsdp.sim.engine` (the event engine: compute and side streams on one clock),
:mod:`~flashfsdp.sim.replay` (the runtime's step replayed on it), :mod:`~flashfsdp.sim.simulate`
(the entry points), :mod:`~flashfsdp.sim.settings` (schedule settings, comparisons and sweeps),
:mod:`~flashfsdp.sim.calibrate` (traces and probes to the simulator's inputs),
:mod:`~flashfsdp.sim.link`, :mod:`~flashfsdp.sim.hierarchy`, :mod:`~flashfsdp.sim.contention` and
:mod:`~flashfsdp.sim.model` (the cost models and the model description),
:mod:`~flashfsdp.sim.tensor_parallel` (a Llama on a (dp, tp) layout).

``python -m benchmarks.overlap`` validates it against measured W = 2 gloo steps on CPU (against a
null model, step = compute, too) and sweeps Llama-style 8B and 70B models over W and link speeds.

What the CPU validation can and cannot show: there, every input is measured on the same machine
(the link from stand-alone collectives, compute from a run without communication, contention from
a separate probe), and the simulator predicts the non-compute part of the step. The GPU
predictions (NVLink, InfiniBand, Ethernet; no contention) rest on assumed link speeds and FLOP
rates and are not validated by it. Known gaps on CPU: contention is two average rates measured
with one kernel; per-step jitter of a rank is sampled by one comm-free step per round; the
wake-up latency of a thread blocked in a wait and the runtime's own Python overhead are not
modelled.
"""

from .contention import Contention, contention_rates, fit_contention
from .hierarchy import Hierarchy
from .link import LINKS, Link, fit_alpha_beta, fit_link, get_link, ring_all_reduce_s, ring_collective_s
from .model import (
    LLAMA3_70B,
    LLAMA3_8B,
    LlamaShape,
    Model,
    TPOp,
    Unit,
    llama3_70b,
    llama3_8b,
    llama_model,
    model_from_measurements,
)
from .settings import SETTINGS, Setting, compare_settings, prefetch_ahead, sweep
from .simulate import Prediction, Span, simulate, simulate_ranks
from .tensor_parallel import attention_fraction, llama_tp_model

__all__ = [
    "Contention", "contention_rates", "fit_contention",
    "Hierarchy", "LINKS", "Link", "fit_alpha_beta", "fit_link", "get_link", "ring_all_reduce_s", "ring_collective_s",
    "LLAMA3_8B", "LLAMA3_70B", "LlamaShape", "Model", "TPOp", "Unit", "llama3_8b", "llama3_70b", "llama_model",
    "model_from_measurements", "attention_fraction", "llama_tp_model",
    "SETTINGS", "Prediction", "Setting", "Span", "compare_settings", "prefetch_ahead", "simulate",
    "simulate_ranks", "sweep",
]
