"""ZeRO++ across nodes in the simulator: qgZ's hierarchical quantised gradient reduction, hpZ's
intra-node backward all-gathers and qwZ's int8 all-gathers, against bf16 FSDP.

Source: Wang et al. 2023, "ZeRO++: Extremely Efficient Collective Communication for Giant Model
Training" (arXiv:2306.10209): qwZ §3.1, hpZ §3.2, qgZ §3.3.

The network: nodes of L GPUs (``local_size``, default 8) on an intra-node link (NVLink, 450 GB/s
per GPU, :data:`~flashfsdp.sim.link.LINKS`), N = W / L nodes on the inter-node link (one NIC per
GPU: 100 Gb/s Ethernet or 400 Gb/s InfiniBand, assumed speeds of ``LINKS``).

**Baseline** (bf16 FSDP): a flat ring over all W ranks, every collective at the inter-node link's
α and β, as :func:`~flashfsdp.sim.simulate.simulate` prices a flat W on one link (and
:mod:`flashfsdp.sim.quantized` does for its table): a ring over W ranks spanning nodes crosses a
node boundary at some step, and a ring moves at the pace of its slowest hop, so the faster
intra-node hops do not shorten it. (The reduce-scatter is in ``reduce_dtype``, fp32 for
:func:`~flashfsdp.sim.model.llama_model`'s default, as in the qwZ table.)

**qgZ** (``QuantizedReduce(bits, local_size=L, block_size=256)``): a unit's reduce-scatter of P
values (its padded flat gradient, every rank holding all P) becomes

1. quantise (compute stream): read P values in ``param_bytes``, write P·q bytes, where
   q = bits/8 + 4/block_size bytes per value (:func:`qgz_bytes_per_value`; int4 packed two per
   byte, one fp32 scale per block, ``flashfsdp.kernels.quantize.packed_nbytes``);
2. all-to-all among the L ranks of a node on the intra link: each rank sends (L-1)/L of its P·q
   bytes (:func:`all_to_all_s`);
3. dequantise-sum-requantise: read L chunks of P/L values (P·q bytes), write (P/L)·q;
4. all-to-all among the N nodes on the inter link (the ranks of one local index): each rank sends
   (N-1)/N of its (P/L)·q bytes;
5. dequantise-sum into the shard: read (P/L)·q bytes, write P/W values in ``reduce_bytes``.

Steps 2-5 run in order on the reduce stream (the replay's reduce-scatter op, :func:`qgz_reduce`);
step 1 is charged to the unit's backward at ``mem_bandwidth`` (the baseline's packing cast is not
charged, so this errs against qgZ). Passes 3 and 5 are charged at ``mem_bandwidth`` bytes/s
(assumed 2e12, as :data:`flashfsdp.sim.quantized.DEQUANT_BANDWIDTH`). The per-parameter flags'
small unquantised reduce-scatter is left out.

**hpZ** (``reshard_after_forward=L``): the backward all-gather runs within the node, a ring over L
ranks on the intra link, in ``param_dtype`` (the runtime does not quantise it,
``runtime/quantized_gather.py``); the forward all-gather stays a flat ring over W. The secondary
shard's memory (P/L values per unit) is not in the replay's peak memory.

**qwZ**: the forward all-gather in int8 (1 + 4/256 bytes per value) and its dequantisation charged
to the unit's forward (not its backward: hpZ's backward gather is not quantised).

``python -m flashfsdp.sim.zeropp [--record | --out DIR]`` prints (and writes ``zeropp_sim.md``)
the predicted step and exposed communication for Llama-3 8B and 70B on both links at W = 64, 512.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from flashfsdp.kernels.quantize import check_block_size

from .link import Link, _check_link_numbers, check_world_size, get_link
from .model import Model, Unit, llama3_70b, llama3_8b
from .quantized import DEQUANT_BANDWIDTH, int8_bytes_per_value
from .simulate import simulate

__all__ = ["CONFIGS", "QgzCost", "ZeroPPLink", "all_to_all_s", "compare_zeropp", "format_table",
           "nodes", "qgz_bytes_per_value", "qgz_reduce", "zeropp_model"]

QGZ_BITS = (4, 8)
RECORD_DIR = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "cpu"


def all_to_all_s(nbytes: float, ranks: int, alpha_s: float, bandwidth: float) -> float:
    """Seconds of one all-to-all among ``ranks`` ranks, each holding ``nbytes`` bytes split in
    ``ranks`` equal parts, one per destination (its own part stays): pairwise exchange, ranks - 1
    steps each sending nbytes / ranks bytes (Thakur, Rabenseifner & Gropp 2005, "Optimization of
    Collective Communication Operations in MPICH", IJHPCA 19(1), §3, MPI_Alltoall)::

        t = (n - 1) / n · nbytes / β + (n - 1) · α

    Args:
        nbytes: bytes of each rank's send buffer (>= 0).
        ranks: n >= 1 (one rank: nothing moves, 0 s).
        alpha_s: per-step latency α in seconds (>= 0).
        bandwidth: per-rank bandwidth β in bytes/s (> 0).

    Raises:
        ValueError: naming the argument out of range.
    """
    check_world_size(ranks)
    if not nbytes >= 0:
        raise ValueError(f"all_to_all_s: nbytes must be >= 0 bytes, got {nbytes!r}")
    _check_link_numbers(alpha_s, bandwidth, "all_to_all_s: ")
    if ranks == 1 or nbytes == 0:
        return 0.0
    return (ranks - 1) / ranks * nbytes / bandwidth + (ranks - 1) * alpha_s


def qgz_bytes_per_value(bits: int, block_size: int = 256) -> float:
    """Bytes per value of a qgZ-quantised gradient: bits / 8 + 4 / ``block_size`` (one fp32 scale
    per block; int4 packed two per byte): 0.515625 for int4, 1.015625 for int8 at 256.

    Raises:
        ValueError: ``bits`` not 4 or 8, or a block size the kernels do not take.
    """
    if isinstance(bits, bool) or bits not in QGZ_BITS:
        raise ValueError(f"qgZ: bits must be 4 or 8 (int4 or int8 gradients), got {bits!r}")
    return bits / 8 + 4 / check_block_size("qgz_bytes_per_value", block_size)


def nodes(world_size: int, local_size: int) -> int:
    """N = W / L, the nodes of ``world_size`` ranks with ``local_size`` GPUs each.

    Raises:
        ValueError: W or L not an integer >= 1, or L not dividing W.
    """
    if isinstance(local_size, bool) or not isinstance(local_size, int) or local_size < 1:
        raise ValueError(f"local_size (GPUs per node) must be an integer >= 1, got {local_size!r}")
    check_world_size(world_size)
    if world_size % local_size:
        raise ValueError(f"local_size {local_size} does not divide world_size {world_size}: qgZ/hpZ need "
                         "W = N x L ranks (N nodes of L GPUs)")
    return world_size // local_size


@dataclass(frozen=True)
class QgzCost:
    """One qgZ reduction of a unit, per rank (bytes; seconds).

    Attributes:
        intra_bytes: bytes this rank sends in the intra-node all-to-all, (L-1)/L · P·q.
        inter_bytes: bytes this rank sends in the inter-node all-to-all, (N-1)/N · (P/L)·q.
        intra_s, inter_s: the two all-to-alls (:func:`all_to_all_s`).
        dequant_s: the dequantise-sum-requantise and the final dequantise-sum at ``mem_bandwidth``.
    """

    intra_bytes: float
    inter_bytes: float
    intra_s: float
    inter_s: float
    dequant_s: float

    @property
    def total_s(self) -> float:
        """The reduction's seconds on the reduce stream: both hops and the passes between them."""
        return self.intra_s + self.inter_s + self.dequant_s


def qgz_reduce(numel: float, world_size: int, local_size: int, intra: "Link | str", inter: "Link | str", *,
               bits: int = 4, block_size: int = 256, wire_bytes: float | None = None, reduce_bytes: int = 4,
               mem_bandwidth: float | None = DEQUANT_BANDWIDTH) -> QgzCost:
    """The cost of qgZ's reduction of a unit of ``numel`` (P) values (module docstring, steps 2-5).

    Args:
        numel: P, the unit's padded gradient values each rank holds before the reduction.
        world_size, local_size: W and L (L must divide W).
        intra, inter: the intra- and inter-node links (Links or names of ``LINKS``).
        bits, block_size: the quantiser (4 or 8 bits; one fp32 scale per block).
        wire_bytes: bytes per value on the wire instead of :func:`qgz_bytes_per_value` (e.g. 2 for
            unquantised bf16, the identity quantiser); ``bits`` is then not used.
        reduce_bytes: bytes per value of the reduced shard (``reduce_dtype``).
        mem_bandwidth: bytes/s of the dequantisation passes; None: free.

    Raises:
        ValueError: L not dividing W, bits not 4/8, a negative ``numel``, a bad bandwidth.
    """
    n_nodes = nodes(world_size, local_size)
    q = qgz_bytes_per_value(bits, block_size) if wire_bytes is None else wire_bytes
    if not (numel >= 0 and q > 0):
        raise ValueError(f"qgz_reduce: numel must be >= 0 and wire_bytes > 0, got {numel!r}, {q!r}")
    if mem_bandwidth is not None and not (isinstance(mem_bandwidth, (int, float)) and mem_bandwidth > 0):
        raise ValueError(f"qgz_reduce: mem_bandwidth must be a positive number of bytes/s or None, "
                         f"got {mem_bandwidth!r}")
    intra, inter = get_link(intra), get_link(inter)
    segment, part = numel * q, numel * q / local_size  # bytes before each hop
    passes = (segment + part) + (part + numel / world_size * reduce_bytes)  # bytes read + written
    return QgzCost(intra_bytes=(local_size - 1) / local_size * segment,
                   inter_bytes=(n_nodes - 1) / n_nodes * part,
                   intra_s=all_to_all_s(segment, local_size, intra.alpha_s, intra.bandwidth),
                   inter_s=all_to_all_s(part, n_nodes, inter.alpha_s, inter.bandwidth),
                   dequant_s=passes / mem_bandwidth if mem_bandwidth else 0.0)


@dataclass(frozen=True)
class ZeroPPLink(Link):
    """The inter-node link (its own α, β: the flat ring's pace) with ZeRO++'s collectives, to pass
    as ``link`` to :func:`~flashfsdp.sim.simulate.simulate`; build it with :meth:`build`.

    Attributes (beyond :class:`Link`'s, which are the inter link's):
        intra: the intra-node link.
        local_size: L, GPUs per node.
        qgz_bits: 4 or 8: reduce-scatters become :func:`qgz_reduce`; None: a flat ring over W.
        hpz: backward all-gathers within the node (a ring over L on ``intra``, unsharded bytes).
        reduce_bytes: bytes per value of the replay's reduce-scatter input (the model's units'
            ``reduce_bytes``), to count its values P.
        block_size, mem_bandwidth: as :func:`qgz_reduce`.
    """

    intra: Link | None = None
    local_size: int = 8
    qgz_bits: int | None = None
    hpz: bool = False
    reduce_bytes: int = 4
    block_size: int = 256
    mem_bandwidth: float | None = DEQUANT_BANDWIDTH

    @classmethod
    def build(cls, inter: "Link | str", intra: "Link | str" = "nvlink", *, local_size: int = 8,
              qgz_bits: int | None = None, hpz: bool = False, **kwargs) -> "ZeroPPLink":
        """The link; raises ValueError for bits not 4/8 (or None) or a bad ``local_size``."""
        inter, intra = get_link(inter), get_link(intra)
        if qgz_bits is not None:
            qgz_bytes_per_value(qgz_bits, kwargs.get("block_size", 256))
        nodes(local_size, local_size)
        parts = [f"qgZ int{qgz_bits}"] if qgz_bits else []
        parts += ["hpZ"] if hpz else []
        name = f"{inter.name} / {intra.name} x{local_size}" + (f" ({', '.join(parts)})" if parts else "")
        return cls(name, inter.alpha_s, inter.bandwidth, intra=intra, local_size=local_size, qgz_bits=qgz_bits,
                   hpz=hpz, **kwargs)

    def unit_all_gather_s(self, wire_bytes: float, unsharded_bytes: float, world_size: int, phase: str) -> float:
        """hpZ's backward all-gather: a ring over L on the intra link of the unsharded bytes; else a
        flat ring over W at the inter link's pace."""
        if self.hpz and phase == "backward":
            nodes(world_size, self.local_size)
            return self.intra.all_gather_s(unsharded_bytes, self.local_size)
        return self.all_gather_s(wire_bytes, world_size)

    def reduce_scatter_s(self, nbytes: float, world_size: int) -> float:
        """qgZ: :func:`qgz_reduce` of the nbytes / ``reduce_bytes`` values; else the flat ring."""
        if self.qgz_bits is None:
            return super().reduce_scatter_s(nbytes, world_size)
        return qgz_reduce(nbytes / self.reduce_bytes, world_size, self.local_size, self.intra, self, bits=self.qgz_bits,
                          block_size=self.block_size, reduce_bytes=self.reduce_bytes,
                          mem_bandwidth=self.mem_bandwidth).total_s

    def latency_s(self, world_size: int, collective: str = "all_gather") -> float:
        """qgZ's reduction: (L-1)·α_intra + (N-1)·α_inter; otherwise :meth:`Link.latency_s`."""
        if collective == "reduce_scatter" and self.qgz_bits is not None:
            n_nodes = nodes(world_size, self.local_size)
            return (self.local_size - 1) * self.intra.alpha_s + (n_nodes - 1) * self.alpha_s
        return super().latency_s(world_size, collective)


# (label, qwZ int8 forward all-gathers, hpZ, qgZ bits or None)
CONFIGS = (("bf16 FSDP", False, False, None), ("+qgZ int8", False, False, 8), ("+qgZ int4", False, False, 4),
           ("qwZ+hpZ+qgZ int4", True, True, 4))


def zeropp_model(model: Model, *, qwz: bool = False, qgz_bits: int | None = None, block_size: int = 256,
                 mem_bandwidth: float | None = DEQUANT_BANDWIDTH) -> Model:
    """``model`` with ZeRO++'s compute-stream passes: qwZ's int8 forward all-gathers (``all_gather_bytes``
    1 + 4/``block_size``) and their dequantisation, numel · (1 + param_bytes) / ``mem_bandwidth``
    seconds added to each unit's forward; qgZ's quantisation of the gradients, numel ·
    (param_bytes + q) / ``mem_bandwidth`` added to its backward. None bandwidth: passes free."""
    q = qgz_bytes_per_value(qgz_bits, block_size) if qgz_bits is not None else 0.0

    def convert(unit: Unit) -> Unit:
        seconds = (lambda nbytes: nbytes / mem_bandwidth if mem_bandwidth else 0.0)
        changes = {}
        if qwz:
            changes.update(all_gather_bytes=int8_bytes_per_value(block_size),
                           forward_s=unit.forward_s + seconds(unit.numel * (1 + unit.param_bytes)))
        if qgz_bits is not None:
            changes["backward_s"] = unit.backward_s + seconds(unit.numel * (unit.param_bytes + q))
        return dataclasses.replace(unit, **changes)

    return dataclasses.replace(model, root=convert(model.root), blocks=tuple(map(convert, model.blocks)))


def compare_zeropp(models: Sequence[Model], links: Sequence["Link | str"], world_sizes: Sequence[int], *,
                   intra: "Link | str" = "nvlink", local_size: int = 8, configs: Sequence[tuple] = CONFIGS,
                   mem_bandwidth: float | None = DEQUANT_BANDWIDTH, **simulate_kwargs) -> list[dict]:
    """One row per model x inter link x W x configuration (:data:`CONFIGS`): ``model``, ``link``,
    ``world_size``, ``config``, ``step_ms``, ``exposed_ms`` (compute waiting on communication),
    ``ag_ms`` / ``rs_ms`` (the step's all-gather and reduction costs, overlapped or not),
    ``speedup`` (the first configuration's step / this one's). Other keyword arguments go to
    :func:`~flashfsdp.sim.simulate.simulate`.

    Raises:
        ValueError: ``local_size`` not dividing a W, or any error of :func:`qgz_reduce` / simulate.
    """
    rows = []
    for model in models:
        reduce_bytes = {u.reduce_bytes or u.param_bytes for u in model.units}
        if len(reduce_bytes) != 1:
            raise ValueError(f"compare_zeropp: {model.name}'s units reduce in several dtypes {sorted(reduce_bytes)}")
        for inter in map(get_link, links):
            for world_size in world_sizes:
                nodes(world_size, local_size)
                base = None
                for label, qwz, hpz, bits in configs:
                    link = ZeroPPLink.build(inter, intra, local_size=local_size, qgz_bits=bits, hpz=hpz,
                                            reduce_bytes=next(iter(reduce_bytes)),
                                            mem_bandwidth=mem_bandwidth)
                    variant = zeropp_model(model, qwz=qwz, qgz_bits=bits, mem_bandwidth=mem_bandwidth)
                    p = simulate(variant, world_size, link, **simulate_kwargs)
                    base = base or p.step_s
                    rows.append({"model": model.name, "link": inter.name, "world_size": world_size, "config": label,
                                 "step_ms": p.step_s * 1e3, "compute_ms": p.compute_s * 1e3,
                                 "exposed_ms": p.exposed_s * 1e3, "ag_ms": p.all_gather_s * 1e3,
                                 "rs_ms": p.reduce_scatter_s * 1e3, "speedup": base / p.step_s})
    return rows


_COLUMNS = (("model", "model", "{}"), ("inter-node link", "link", "{}"), ("W", "world_size", "{}"),
            ("configuration", "config", "{}"), ("step ms", "step_ms", "{:.0f}"), ("compute ms", "compute_ms", "{:.0f}"),
            ("exposed comm ms", "exposed_ms", "{:.0f}"), ("all-gather ms", "ag_ms", "{:.0f}"),
            ("reduce ms", "rs_ms", "{:.0f}"), ("speedup", "speedup", "{:.2f}x"))


def format_table(rows: Sequence[dict]) -> str:
    """The rows of :func:`compare_zeropp` as a Markdown table."""
    head = "| " + " | ".join(title for title, _, _ in _COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in _COLUMNS) + "|"
    body = ["| " + " | ".join(fmt.format(row[key]) for _, key, fmt in _COLUMNS) + " |" for row in rows]
    return "\n".join([head, rule, *body])


HEADER = """# ZeRO++ (qwZ, hpZ, qgZ) in the simulator: predicted step per rank

Written by `python -m flashfsdp.sim.zeropp --record` (model: `flashfsdp/sim/zeropp.py`'s docstring).
Llama-3 8B / 70B, 8192 tokens per rank, 400 TFLOP/s achieved, bf16 parameters, fp32 reduce-scatter
(`reduce_dtype`); nodes of L = 8 GPUs on NVLink (450 GB/s per GPU, α 3 µs); inter-node one NIC per GPU
(Ethernet 100 Gb/s: 12.5 GB/s, α 30 µs; InfiniBand 400 Gb/s: 50 GB/s, α 8 µs): assumed speeds.
bf16 FSDP: flat rings over W paced by the inter-node link. qgZ: all-to-all in the node (NVLink), then
across nodes, int4/int8 + one fp32 scale per 256 values; (de)quantisation passes at 2 TB/s. qwZ+hpZ: int8
forward all-gathers, backward all-gathers in bf16 within the node. Exposed comm: time the compute stream
waited on communication. Speedup: bf16 FSDP's step / the row's. Predictions, not measurements.

"""


def main(argv: Sequence[str] | None = None) -> None:
    """Print (and with ``--record`` / ``--out`` write ``zeropp_sim.md``) the table for Llama-3 8B
    and 70B on 100 Gb/s Ethernet and 400 Gb/s InfiniBand at W = 64 and 512."""
    parser = argparse.ArgumentParser(prog="python -m flashfsdp.sim.zeropp", description=main.__doc__)
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--record", action="store_true", help=f"write {RECORD_DIR}/zeropp_sim.md")
    group.add_argument("--out", type=Path, default=None, help="write zeropp_sim.md into this folder")
    args = parser.parse_args(argv)
    table = format_table(compare_zeropp([llama3_8b(), llama3_70b()], ["eth100", "ib400"], [64, 512]))
    print(table)
    folder = RECORD_DIR if args.record else args.out
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "zeropp_sim.md").write_text(HEADER + table + "\n")
        print(f"wrote {folder / 'zeropp_sim.md'}")


if __name__ == "__main__":
    main()
