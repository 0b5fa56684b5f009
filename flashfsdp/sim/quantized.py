"""Predicted step time with and without int8 all-gathers (``all_gather_dtype=torch.int8``).

ZeRO++'s qwZ (Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant
Model Training", arXiv:2306.10209, §3.1) sends the weights block-wise quantised to int8: the
all-gather carries 1 + 4/256 bytes per value (int8 + one fp32 scale per 256 values,
:mod:`flashfsdp.kernels.quantize`) instead of ``param_bytes`` (2 for bf16). In the simulator that
is the unit's ``all_gather_bytes`` (:class:`~flashfsdp.sim.model.Unit`); the memory of the
unsharded parameters is unchanged. The dequantisation pass (1 byte read, ``param_bytes`` written
per value, run before the unit's compute can start) is charged to every forward and backward of
the unit at ``dequant_bandwidth`` bytes/s (assumed: 2e12, about 2/3 of an H100's HBM bandwidth);
the quantisation of the shard (1/W of that) is left out. The gradients' reduce-scatter is unchanged.

``python -m flashfsdp.sim.quantized`` prints the table for Llama-3 8B and 70B on 100 Gb/s Ethernet
and 400 Gb/s InfiniBand (the links of :data:`~flashfsdp.sim.link.LINKS`, assumed speeds).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from flashfsdp.kernels.quantize import BLOCK_SIZE, check_block_size

from .link import Link, get_link
from .model import Model, Unit, llama3_70b, llama3_8b
from .simulate import simulate

__all__ = ["DEQUANT_BANDWIDTH", "compare_all_gather", "format_table", "int8_bytes_per_value", "quantized_all_gather"]

DEQUANT_BANDWIDTH = 2e12  # bytes/s of the dequantisation pass (assumed, H100-class HBM)


def int8_bytes_per_value(block_size: int = BLOCK_SIZE) -> float:
    """Bytes per value of an int8 all-gather: 1 + 4 / ``block_size`` (one fp32 scale per block).

    Raises:
        ValueError / TypeError: a block size the kernels do not take (a power of two in [32, 4096]).
    """
    return 1 + 4 / check_block_size("int8_bytes_per_value", block_size)


def quantized_all_gather(model: Model, block_size: int = BLOCK_SIZE,
                         dequant_bandwidth: float | None = DEQUANT_BANDWIDTH) -> Model:
    """``model`` with int8 all-gathers: every unit's ``all_gather_bytes`` set to
    :func:`int8_bytes_per_value`, and (unless ``dequant_bandwidth`` is None) its forward and
    backward lengthened by its dequantisation, ``numel · (1 + param_bytes) / dequant_bandwidth``.

    Raises:
        ValueError: a bad block size, or a ``dequant_bandwidth`` that is not a positive number.
    """
    per_value = int8_bytes_per_value(block_size)
    if dequant_bandwidth is not None and not (isinstance(dequant_bandwidth, (int, float)) and dequant_bandwidth > 0):
        raise ValueError(f"quantized_all_gather: dequant_bandwidth must be a positive number of bytes/s or None, "
                         f"got {dequant_bandwidth!r}")

    def convert(unit: Unit) -> Unit:
        extra = unit.numel * (1 + unit.param_bytes) / dequant_bandwidth if dequant_bandwidth else 0.0
        return dataclasses.replace(unit, all_gather_bytes=per_value, forward_s=unit.forward_s + extra,
                                   backward_s=unit.backward_s + extra)

    return dataclasses.replace(model, root=convert(model.root), blocks=tuple(map(convert, model.blocks)),
                               name=f"{model.name} int8")


def compare_all_gather(models: Sequence[Model], links: Sequence["Link | str"], world_sizes: Sequence[int],
                       block_size: int = BLOCK_SIZE, dequant_bandwidth: float | None = DEQUANT_BANDWIDTH,
                       **simulate_kwargs) -> list[dict]:
    """One row per model × link × W: the predicted step without and with int8 all-gathers.

    Row keys: ``model``, ``link``, ``world_size``, ``ag_GB`` / ``ag_int8_GB`` (bytes all-gathered
    per step, forward + backward), ``step_ms`` / ``step_int8_ms``, ``exposed_ms`` /
    ``exposed_int8_ms``, ``speedup`` (step / step with int8), ``efficiency`` /
    ``efficiency_int8``. Other keyword arguments go to :func:`~flashfsdp.sim.simulate.simulate`.
    """
    rows = []
    for model in models:
        quantized = quantized_all_gather(model, block_size, dequant_bandwidth)
        for link in map(get_link, links):
            for world_size in world_sizes:
                plain = simulate(model, world_size, link, **simulate_kwargs)
                int8 = simulate(quantized, world_size, link, **simulate_kwargs)
                rows.append({
                    "model": model.name, "link": link.name, "world_size": world_size,
                    "ag_GB": plain.collective_bytes["all_gather"] / 1e9,
                    "ag_int8_GB": int8.collective_bytes["all_gather"] / 1e9,
                    "step_ms": plain.step_s * 1e3, "step_int8_ms": int8.step_s * 1e3,
                    "exposed_ms": plain.exposed_s * 1e3, "exposed_int8_ms": int8.exposed_s * 1e3,
                    "speedup": plain.step_s / int8.step_s,
                    "efficiency": plain.efficiency, "efficiency_int8": int8.efficiency,
                })
    return rows


_COLUMNS = (("model", "model", "{}"), ("link", "link", "{}"), ("W", "world_size", "{}"),
            ("AG GB bf16", "ag_GB", "{:.1f}"), ("AG GB int8", "ag_int8_GB", "{:.1f}"),
            ("step ms bf16", "step_ms", "{:.0f}"), ("step ms int8", "step_int8_ms", "{:.0f}"),
            ("exposed ms bf16", "exposed_ms", "{:.0f}"), ("exposed ms int8", "exposed_int8_ms", "{:.0f}"),
            ("speedup", "speedup", "{:.2f}x"))


def format_table(rows: Sequence[dict]) -> str:
    """The rows of :func:`compare_all_gather` as a Markdown table."""
    head = "| " + " | ".join(title for title, _, _ in _COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in _COLUMNS) + "|"
    body = ["| " + " | ".join(fmt.format(row[key]) for _, key, fmt in _COLUMNS) + " |" for row in rows]
    return "\n".join([head, rule, *body])


def main() -> None:
    """Print the table for Llama-3 8B and 70B (bf16 compute at 400 TFLOP/s, fp32 reduce-scatter,
    8192 tokens per rank) on 100 Gb/s Ethernet and 400 Gb/s InfiniBand, W = 8, 64, 512."""
    print(format_table(compare_all_gather([llama3_8b(), llama3_70b()], ["eth100", "ib400"], [8, 64, 512])))


if __name__ == "__main__":
    main()
