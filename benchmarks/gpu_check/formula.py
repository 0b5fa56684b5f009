"""The memory a FSDP / ZeRO-3 rank needs, from parameter counts: what the `gpu` memory test and
``benchmarks.gpu_check`` compare measured peaks with.

Model states (ZeRO, Rajbhandari et al. 2020, §3 and Figure 1, for stage 3 with mixed-precision
Adam: 2 + 2 + K bytes per parameter over N_d ranks) take, in FSDP2's layout (fp32 master
parameters, fp32 gradient shards, AdamW's two fp32 moments; bf16 parameters and gradients exist
only for the units in flight), 4 + 4 + 8 = 16 bytes per parameter over W ranks. The working set
on top of them during forward and backward, per the largest unit of P_u parameters: the bf16
parameters of two units (the one computing and the one prefetched), the bf16 gradients of one
unit, the fp32 reduce-scatter inputs of two units (one held until the next unit's reduction, as
FSDP2's ``reduce_scatter_state``) and one fp32 reduce-scatter output (P_u / W).
"""

from __future__ import annotations


def zero3_state_bytes(params: int, world_size: int) -> float:
    """Bytes of the model states per rank: 16 bytes per parameter over W (fp32 master + fp32
    gradient + AdamW's two fp32 moments).

    Raises:
        ValueError: a negative parameter count or a world size below 1.
    """
    if params < 0 or world_size < 1:
        raise ValueError(f"zero3_state_bytes: params must be >= 0 and world_size >= 1, got {params}, {world_size}")
    return 16.0 * params / world_size


def zero3_working_bytes(unit_params: int, world_size: int, param_bytes: int = 2, reduce_bytes: int = 4) -> float:
    """Bytes of the forward/backward working set above the model states for units of at most
    ``unit_params`` parameters: 2 units of parameters and 1 of gradients in ``param_bytes`` each,
    2 reduce-scatter inputs and 1/W output in ``reduce_bytes`` each (see the module docstring).

    Raises:
        ValueError: a negative parameter count or a world size below 1.
    """
    if unit_params < 0 or world_size < 1:
        raise ValueError(f"zero3_working_bytes: unit_params must be >= 0 and world_size >= 1, got "
                         f"{unit_params}, {world_size}")
    return unit_params * (3 * param_bytes + (2 + 1 / world_size) * reduce_bytes)


def zero3_peak_bytes(params: int, unit_params: int, world_size: int, param_bytes: int = 2,
                     reduce_bytes: int = 4) -> float:
    """:func:`zero3_state_bytes` + :func:`zero3_working_bytes`: the forward/backward peak per rank
    without activations (which the caller adds, or keeps negligible)."""
    return zero3_state_bytes(params, world_size) + zero3_working_bytes(unit_params, world_size, param_bytes,
                                                                       reduce_bytes)
