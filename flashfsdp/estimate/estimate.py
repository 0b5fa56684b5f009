"""``flashfsdp.estimate``: memory per rank and communication per step of a sharded model, before
running it (a model on the meta device, a ``LlamaConfig`` or a preset name: nothing is allocated).

Per rank, from the units as ``fully_shard`` would build them (``units.py``: the runtime's own flat
layout, alignment and padding included) and the runtime's step walked through its own prefetch
policy (``replay.py``):

- model states, kept between steps (ZeRO's "model states", Rajbhandari et al. 2020, §3.1): the
  master shard and the gradient shard (S elements of the original dtype per flat group, S = T/W
  with T the padded flat size), the optimizer state (AdamW/Adam: two moments of each local piece's
  size in its dtype plus a 4-byte step per parameter; SGD with momentum: one buffer; SGD: none).
  Gradients are counted for the whole step, as after ``zero_grad(set_to_none=False)``; with the
  default ``set_to_none=True`` they are freed during the forward (then allocated unit by unit in
  backward), so the forward may hold less.
- what the step allocates on top (transient): the unsharded parameters of the units gathered at
  once (the root, the unit computing, the ones prefetched, the last block kept for backward; with
  an int ``reshard_after_forward`` k, the 1/k slices kept after forward and until the backward
  ends), the unsharded gradients
  of the unit in backward (and of the root, whose backward spans the whole backward), the
  reduce-scatter buffers (in ``reduce_dtype``, two reductions' at once: the packed input of W
  segments and the reduced segment, each segment R the shard's S elements and one flag per
  parameter, padded to the alignment, as ``runtime/reduce.py`` packs them). With buckets
  (``bucket_bytes``, the runtime's default 4 MiB) units that run back to back are gathered
  together, beside their bucket's gathered buffer, and reduced together, their gradients held
  until the bucket is packed (``replay.py``): a model of small units holds more at once.
  Activations are not counted (they depend on batch, sequence and checkpointing).

With ``tp`` > 1 the W ranks form a (W / tp, tp) mesh: the Llama TP plan (``flashfsdp.models.tp_plan``,
sequence parallel) splits each weight over the tp ranks, and FSDP shards each TP-local piece over the
W / tp data-parallel ranks: the split weights' states are divided by W, the replicated RMSNorm
weights' by W / tp; the FSDP collectives run over the data-parallel ranks, and ``Estimate.tp_comm``
counts the activations' TP collectives (``tp_comm.py``).

Per step: the all-gathers (forward and backward), reduce-scatters and hybrid all-reduces, their
bytes and how many collectives carry them (with ``bucket_bytes``, the runtime's default, small
units that run back to back share one: ``replay.py``), compared with DDP's all-reduce (``comm.py``: 3Ψ against 2Ψ, the 1.5× of ZeRO §7.2 and of the FSDP paper,
Zhao et al. 2023). DeepSpeed's ZeRO-3 formula for comparison is in ``deepspeed.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn

from flashfsdp.runtime.step import DEFAULT_BUCKET_BYTES, check_bucket_bytes, resolve_reshard_after_forward
from flashfsdp.models import Llama, LlamaConfig, config_from_preset
from flashfsdp.models.tp_plan import check_tp_degree

from .comm import CommVolume, step_volume
from .replay import StepHoldings, walk_steady_step
from .tp_comm import TPVolume, tp_step_volume
from .units import UnitSpec, build_units, param_placement

# Optimizer state: buffers of each local piece's size, and bytes per parameter of scalars (Adam's step).
OPTIMIZER_STATES = {"adamw": (2, 4), "adam": (2, 4), "sgd_momentum": (1, 0), "sgd": (0, 0), "none": (0, 0)}
SHARDINGS = ("full", "grad_op", "hybrid")


@dataclass(frozen=True)
class Estimate:
    """The estimate for one rank (bytes) and one step (see the module docstring).

    Attributes:
        world_size: W; shard_group_size: S, ranks that shard one replica (W / tp unless hybrid);
            replicas: W / (S · tp).
        num_params: distinct parameters of the model; units: the unit specs (root first).
        master_bytes, grad_bytes, optimizer_bytes: the sharded model states.
        params_peak_bytes: most unsharded parameter bytes (and post-forward slices) at once.
        units_at_peak: the units unsharded at that moment.
        largest_unit: the unit with the largest unsharded buffers.
        unsharded_grad_bytes, reduce_buffer_bytes: the peaks of unsharded gradients and of
            reduce-scatter buffers.
        transient_peak_bytes: the most the step allocates at once on top of the model states.
        comm: the step's FSDP communication (over the data-parallel ranks).
        tp: the TP degree; tp_comm: the step's TP communication (None without TP).
        bucket_bytes: the bucket size the step was walked with (0: no buckets).
    """

    world_size: int
    shard_group_size: int
    num_params: int
    units: tuple[UnitSpec, ...]
    master_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    params_peak_bytes: int
    units_at_peak: tuple[str, ...]
    unsharded_grad_bytes: int
    reduce_buffer_bytes: int
    transient_peak_bytes: int
    comm: CommVolume
    optimizer: str
    sharding: str
    tp: int = 1
    tp_comm: TPVolume | None = None
    bucket_bytes: int = 0

    @property
    def replicas(self) -> int:
        """W / (S · tp): replicas of the sharded model (1 unless hybrid)."""
        return self.world_size // (self.shard_group_size * self.tp)

    @property
    def largest_unit(self) -> UnitSpec:
        """The unit whose unsharded buffers are the largest."""
        return max(self.units, key=UnitSpec.unsharded_bytes)

    @property
    def model_state_bytes(self) -> int:
        """Master + gradient shards + optimizer state."""
        return self.master_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def unit_holdings_bytes(self) -> int:
        """The most the units themselves hold at once: master and gradient shards plus the
        unsharded parameters at their peak (what ``ShardedUnit.memory_bytes`` adds up)."""
        return self.master_bytes + self.grad_bytes + self.params_peak_bytes

    @property
    def total_bytes(self) -> int:
        """Model states + the step's transient peak (activations excluded)."""
        return self.model_state_bytes + self.transient_peak_bytes


def estimate(model_or_config: nn.Module | LlamaConfig | str, world_size: int, *, mp_policy=None,
             optimizer: str = "adamw", units=None, reshard_after_forward: bool | int | None = None,
             max_inflight: int = 2, sharding: str | None = None, mesh=None,
             shard_group_size: int | None = None, tp: int = 1, tokens: int | None = None,
             shard_placement_fn=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Estimate:
    """Memory per rank and communication per step of ``model_or_config`` sharded over W ranks
    (with ``tp`` > 1, a (W / tp, tp) mesh: see the module docstring).

    Args:
        model_or_config: an ``nn.Module`` (the meta device is enough: only shapes and dtypes are
            read), a ``LlamaConfig``, or a preset name of ``flashfsdp.models.PRESETS`` ("8b", ...)
            (both built as ``Llama`` on the meta device, in fp32).
        world_size: W, ranks in all (>= 1).
        mp_policy: a ``MixedPrecisionPolicy`` (flashfsdp's or torch's): ``param_dtype`` of the
            unsharded parameters, ``reduce_dtype`` of the reduce-scatter, flashfsdp's
            ``all_gather_dtype=torch.int8`` for the bytes of int8 all-gathers (their transient int8
            buffer, about one byte per element of each unit being gathered, is not in the memory
            figures); None: full precision. Backward all-gather elision is not modelled: every
            unit's backward all-gather is counted (an upper bound).
        optimizer: "adamw", "adam", "sgd_momentum", "sgd" or "none".
        units: the modules (or their qualified names) given their own ``fully_shard`` call, in
            forward order; the root unit holds the rest. None: each of ``model.layers``.
        reshard_after_forward: as ``fully_shard``'s, for every unit (None: the default).
        max_inflight: ``set_max_inflight_all_gathers`` (2 by default).
        sharding: "full" (ZeRO-3), "grad_op" (parameters kept from forward to backward:
            ``reshard_after_forward=False``, FSDP1's SHARD_GRAD_OP) or "hybrid" (full sharding within
            groups of ``shard_group_size`` ranks, replicated across the W/S groups). None: "hybrid"
            with a 2-D mesh, else "full".
        mesh: the data-parallel ``DeviceMesh`` (or its shape): 1-D, or 2-D (replicas, S).
        shard_group_size: S for ``sharding="hybrid"`` without a 2-D mesh.
        tp: the tensor-parallel degree (1: none) of a ``Llama``; tokens: tokens of a TP group's
            step, for ``tp_comm`` (None: one sequence of ``max_seq_len``).
        shard_placement_fn: as ``fully_shard``'s (``Shard(k)`` or None per parameter).
        bucket_bytes: the root's ``set_bucket_bytes`` (default: the runtime's, 4 MiB): the most
            bytes units that share a collective move (``replay.py``); 0: every unit has its own.

    Returns:
        An :class:`Estimate` (bytes; ``flashfsdp.estimate.report`` formats it).

    Raises:
        ValueError: an unknown preset, optimizer or sharding; ``world_size`` < 1; a ``tp`` that
            does not divide W or the model (or > 1 for a model not a ``Llama``); a mesh whose
            size is not W / tp; hybrid sharding without a shard group size, or one that does
            not divide W; ``reshard_after_forward`` not allowed (see ``fully_shard``); a negative
            ``max_inflight``; a negative ``bucket_bytes``; ``units`` that are not submodules.
        TypeError: ``model_or_config`` of another type; ``bucket_bytes`` not an int.
    """
    _check_args(world_size, max_inflight, optimizer, bucket_bytes)
    model = _as_model(model_or_config)
    sharding, group = _resolve_sharding(sharding, _check_tp(model, world_size, tp), mesh, shard_group_size)
    reshard_after_forward = _grad_op_reshard(sharding, reshard_after_forward)
    param_dtype = getattr(mp_policy, "param_dtype", None)
    reduce_dtype = getattr(mp_policy, "reduce_dtype", None)
    all_gather_dtype = getattr(mp_policy, "all_gather_dtype", None)
    specs = build_units(model, units, group, param_dtype, reduce_dtype, param_placement(model, tp, shard_placement_fn))
    resolved = resolve_reshard_after_forward(reshard_after_forward, group)
    held = walk_steady_step(specs, {u.name: resolved for u in specs}, group, max_inflight, bucket_bytes,
                            all_gather_dtype)
    est = _assemble(specs, held, world_size, group, optimizer, sharding, model, all_gather_dtype, tp, bucket_bytes)
    return est if tp == 1 else replace(est, tp_comm=_tp_volume(model, tp, tokens, param_dtype))


def _tp_volume(model: Llama, tp: int, tokens: int | None, param_dtype: torch.dtype | None) -> TPVolume:
    """The TP collectives of a step of ``tokens`` (None: one sequence) in the compute dtype."""
    compute = (param_dtype or next(model.parameters()).dtype).itemsize
    return tp_step_volume(model.config, tp, tokens or model.config.max_seq_len, compute, compute)


def _grad_op_reshard(sharding: str, reshard_after_forward: bool | int | None) -> bool | int | None:
    """``reshard_after_forward`` as ``sharding`` has it: False for "grad_op" (which an explicit
    other value contradicts), else as given."""
    if sharding != "grad_op":
        return reshard_after_forward
    if reshard_after_forward not in (None, False):
        raise ValueError(f"estimate: sharding='grad_op' keeps the parameters from forward to backward; "
                         f"reshard_after_forward={reshard_after_forward!r} contradicts it: leave it unset")
    return False


def _check_tp(model: nn.Module, world_size: int, tp: int) -> int:
    """The data-parallel size W / tp, after checking ``tp`` (see ``estimate``'s errors)."""
    _check_count("tp", tp, 1)
    if world_size % tp:
        raise ValueError(f"estimate: tp={tp} must divide world_size={world_size}")
    if tp > 1:
        if not isinstance(model, Llama):
            raise ValueError(f"estimate: tp={tp} needs a flashfsdp Llama (its TP plan names the weights), got "
                             f"{type(model).__name__}")
        check_tp_degree(model.config, tp, "estimate: tp")
    return world_size // tp


def _assemble(specs: list[UnitSpec], held: StepHoldings, world_size: int, group: int, optimizer: str,
              sharding: str, model: nn.Module, all_gather_dtype: torch.dtype | None, tp: int,
              bucket_bytes: int) -> Estimate:
    buffers, scalar_bytes = OPTIMIZER_STATES[optimizer]
    optimizer_bytes = sum(u.optimizer_state_bytes(buffers) + scalar_bytes * u.trainable_params() for u in specs)
    return Estimate(
        world_size=world_size, shard_group_size=group,
        num_params=sum(p.numel() for p in dict.fromkeys(model.parameters())), units=tuple(specs),
        master_bytes=sum(u.master_bytes() for u in specs), grad_bytes=sum(u.grad_shard_bytes() for u in specs),
        optimizer_bytes=optimizer_bytes, params_peak_bytes=held.params_peak, units_at_peak=held.units_at_peak,
        unsharded_grad_bytes=held.grads_peak, reduce_buffer_bytes=held.buffers_peak,
        transient_peak_bytes=held.transient_peak,
        comm=step_volume(specs, held.all_gathers, world_size // tp, group, all_gather_dtype,
                         (held.all_gather_collectives, held.reduce_scatter_collectives)),
        optimizer=optimizer, sharding=sharding, tp=tp, bucket_bytes=bucket_bytes)


def _check_args(world_size, max_inflight, optimizer, bucket_bytes) -> None:
    """The checks of ``estimate``'s plain arguments (its errors, each naming the argument)."""
    _check_count("world_size", world_size, 1)
    _check_count("max_inflight", max_inflight, 0)
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"estimate: unknown optimizer {optimizer!r}; choose one of {', '.join(OPTIMIZER_STATES)}")
    try:
        check_bucket_bytes(bucket_bytes)
    except (TypeError, ValueError) as err:
        raise type(err)(f"estimate: {err}") from None


def _check_count(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"estimate: {name} must be an integer >= {minimum}, got {value!r}")


def _mesh_shape(mesh) -> tuple[int, ...]:
    """The shape of a ``DeviceMesh`` (or of a tuple standing for one)."""
    shape = tuple(mesh) if isinstance(mesh, (tuple, list)) else tuple(getattr(mesh, "shape", ()))
    if not shape or len(shape) > 2 or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in shape):
        raise ValueError(f"estimate: mesh must be a 1-D or 2-D DeviceMesh (or its shape, e.g. (replicas, "
                         f"shard)), got {mesh!r}")
    return shape


def _resolve_sharding(sharding: str | None, world_size: int, mesh, shard_group_size: int | None) -> tuple[str, int]:
    """(sharding, S): the sharding strategy and the ranks that shard one replica."""
    shape = _mesh_shape(mesh) if mesh is not None else None
    if shape is not None and math.prod(shape) != world_size:
        raise ValueError(f"estimate: the mesh has {math.prod(shape)} ranks (shape {shape}) but world_size is "
                         f"{world_size}; pass the mesh's size as world_size")
    if sharding is None:
        sharding = "hybrid" if shape is not None and len(shape) == 2 else "full"
    if sharding not in SHARDINGS:
        raise ValueError(f"estimate: unknown sharding {sharding!r}; choose one of {', '.join(SHARDINGS)}")
    if sharding != "hybrid":
        if shape is not None and len(shape) == 2:
            raise ValueError(f"estimate: a 2-D mesh {shape} means hybrid sharding; pass sharding='hybrid'")
        return sharding, world_size
    if shape is not None and len(shape) == 2:
        if shard_group_size not in (None, shape[1]):
            raise ValueError(f"estimate: shard_group_size={shard_group_size} differs from the mesh's shard "
                             f"dimension {shape[1]}")
        shard_group_size = shape[1]
    if shard_group_size is None:
        raise ValueError("estimate: sharding='hybrid' needs the shard group size: pass shard_group_size=S "
                         "(the ranks that shard one replica) or a 2-D mesh of shape (replicas, S)")
    _check_count("shard_group_size", shard_group_size, 1)
    if world_size % shard_group_size:
        raise ValueError(f"estimate: shard_group_size={shard_group_size} must divide world_size={world_size}")
    return sharding, shard_group_size


def _as_model(model_or_config) -> nn.Module:
    """The module to read shapes from (a config or preset is built on the meta device)."""
    if isinstance(model_or_config, nn.Module):
        return model_or_config
    if isinstance(model_or_config, str):
        model_or_config = config_from_preset(model_or_config)
    if isinstance(model_or_config, LlamaConfig):
        with torch.device("meta"):
            return Llama(model_or_config)
    raise TypeError(f"estimate: model_or_config must be an nn.Module, a LlamaConfig or a preset name, "
                    f"got {type(model_or_config).__name__}")
