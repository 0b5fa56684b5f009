"""DeepSpeed's ZeRO-3 model-state estimate, written out from its source (no deepspeed import).

Source: microsoft/DeepSpeed, ``deepspeed/runtime/zero/stage3.py``:
``estimate_zero3_model_states_mem_needs`` (the formula), ``model_to_params`` (its inputs) and
``estimate_zero3_model_states_mem_needs_all_live`` (the table it prints over offload options).
With T parameters, L those of the largest layer (the module with the most parameters of its own),
G = nodes × GPUs per node and a buffer factor f (1.5):

- no offload: GPU 4L + 18T/G (fp16 parameter and gradient of the largest layer, gathered; then
  18 bytes per sharded parameter: fp16 parameter 2 + fp32 master 4, momentum 4, variance 4,
  gradient 4); CPU f·4L·(GPUs per node) with ``zero_init``, f·4T·(GPUs per node) without.
  The formula takes no dtypes: it always assumes 16-bit (fp16 or bf16) parameters with fp32 master
  weights, fp32 gradients and Adam, whatever the model trains in (:data:`ZERO3_ASSUMPTIONS`).
- optimizer offloaded: GPU 4L + 2T/G; CPU f·16T/nodes (``zero_init``), else f·T·max(4·GPUs per
  node, 16/nodes).
- optimizer and parameters offloaded: GPU 4L; CPU f·18T/nodes (``zero_init``), else
  f·T·max(4·GPUs per node, 18/nodes).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

# What DeepSpeed's formula assumes (no offload), stated beside every comparison with it.
ZERO3_ASSUMPTIONS = ("DeepSpeed's estimate_zero3_model_states_mem_needs, no offload: 18 bytes per parameter / W "
                     "(a 16-bit parameter 2, fp32 master 4, Adam's two fp32 moments 8, fp32 gradient 4), whatever "
                     "the dtypes and optimizer, + 4 bytes per parameter of the largest layer (its 16-bit "
                     "parameter and gradient, gathered)")


@dataclass(frozen=True)
class DeepSpeedZero3:
    """DeepSpeed's estimate for one option set (bytes).

    Attributes:
        cpu_bytes: per CPU (node).
        gpu_bytes: per GPU.
        largest_layer_bytes: 4 bytes per parameter of the largest layer (its fp16 parameter and
            gradient, gathered).
    """

    cpu_bytes: int
    gpu_bytes: int
    largest_layer_bytes: int

    @property
    def state_bytes(self) -> int:
        """The GPU figure less the gathered largest layer: the sharded model states on the GPU (18
        bytes per parameter / G without offload, 2 with the optimizer offloaded, 0 with the
        parameters too)."""
        return self.gpu_bytes - self.largest_layer_bytes


def zero3_model_states(total_params: int, largest_layer_params: int, num_gpus_per_node: int = 1,
                       num_nodes: int = 1, cpu_offload: bool = False, cpu_offload_params: bool = False,
                       zero_init: bool = True, additional_buffer_factor: float = 1.5) -> DeepSpeedZero3:
    """DeepSpeed's ``estimate_zero3_model_states_mem_needs`` (see the module docstring).

    Args:
        total_params: T, distinct parameters of the model.
        largest_layer_params: L, parameters of the module with the most parameters of its own.
        num_gpus_per_node, num_nodes: the hardware (G = their product).
        cpu_offload: optimizer state on the CPU; cpu_offload_params: parameters too (only with
            ``cpu_offload``, as in DeepSpeed's table).
        zero_init: the model is built partitioned (``deepspeed.zero.Init``).
        additional_buffer_factor: DeepSpeed's safety factor on the CPU figure.

    Raises:
        ValueError: a count < 1 or ``cpu_offload_params`` without ``cpu_offload``.
    """
    if num_gpus_per_node < 1 or num_nodes < 1 or total_params < 0 or largest_layer_params < 0:
        raise ValueError("zero3_model_states: GPU and node counts must be >= 1 and parameter counts >= 0")
    if cpu_offload_params and not cpu_offload:
        raise ValueError("zero3_model_states: cpu_offload_params needs cpu_offload (as in DeepSpeed's table)")
    total_gpus = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes
    largest = 4 * largest_layer_params
    f = additional_buffer_factor
    if not cpu_offload:
        gpu = largest + int(18 * total_params / total_gpus)
        cpu = largest_layer_params * 4 * num_gpus_per_node * f if zero_init else total_params * 4 * num_gpus_per_node * f
    else:
        state_bytes = 18 if cpu_offload_params else 16
        gpu = largest if cpu_offload_params else largest + int(2 * total_params / total_gpus)
        per_param = state_bytes * per_node if zero_init else max(4 * num_gpus_per_node, state_bytes * per_node)
        cpu = total_params * per_param * f
    return DeepSpeedZero3(int(cpu), int(gpu), largest)


def model_params(model: nn.Module) -> tuple[int, int]:
    """DeepSpeed's ``model_to_params``: (distinct parameters, parameters of the module with the
    most parameters of its own). Shared parameters count once (by identity here, where DeepSpeed
    uses ``data_ptr``, which is 0 for every tensor on the meta device)."""
    total = sum(p.numel() for p in dict.fromkeys(model.parameters()))
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, largest
