"""Memory per rank and communication per step of a sharded model, estimated before running it.

    >>> from flashfsdp.estimate import estimate
    >>> est = estimate("8b", world_size=64)             # a preset, a LlamaConfig or a (meta) model
    >>> est.total_bytes / 2**30                          # GiB per rank, activations excluded

``python -m flashfsdp.estimate --preset 8b --world-size 64`` prints the breakdown, the step's
communication against DDP and a table over world sizes beside DeepSpeed's ZeRO-3 formula.
"""

from flashfsdp.estimate.comm import CommVolume, ring_sent
from flashfsdp.estimate.deepspeed import DeepSpeedZero3, model_params, zero3_model_states
from flashfsdp.estimate.estimate import OPTIMIZER_STATES, SHARDINGS, Estimate, estimate

__all__ = ["estimate", "Estimate", "CommVolume", "ring_sent", "DeepSpeedZero3", "model_params",
           "zero3_model_states", "OPTIMIZER_STATES", "SHARDINGS"]
