"""Link models: the α–β cost of the ring all-gather and reduce-scatter.

A collective over W ranks on a link with per-message latency α (seconds) and per-rank bandwidth β
(bytes per second, one direction) costs, for ``nbytes`` the size of the *unsharded* buffer (the
all-gather's output, the reduce-scatter's input)::

    t(nbytes, W) = (W - 1) / W · nbytes / β + (W - 1) · α

the bandwidth-optimal ring algorithm: W - 1 steps, each sending one shard of nbytes / W bytes to the
next rank (Thakur, Rabenseifner & Gropp 2005, "Optimization of Collective Communication Operations
in MPICH", IJHPCA 19(1), §4; Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for
clusters of workstations", JPDC 69(2)). The reduce-scatter's additions are not modelled (a GPU adds
far faster than a link moves bytes). At W = 1 both collectives cost nothing.

The α term grows linearly with W: at thousands of ranks a ring's latency dominates, which is why
NCCL switches to tree or hierarchical algorithms there; this model keeps the ring on purpose, so
its large-W predictions are an upper bound for latency-bound collectives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence


def ring_collective_s(nbytes: float, world_size: int, alpha_s: float, bandwidth: float) -> float:
    """Seconds of one ring all-gather or reduce-scatter: (W-1)/W · nbytes/β + (W-1)·α.

    Args:
        nbytes: bytes of the unsharded buffer (all-gather output, reduce-scatter input), >= 0.
        world_size: ranks W >= 1.
        alpha_s: per-step latency α in seconds, >= 0.
        bandwidth: per-rank link bandwidth β in bytes per second, > 0.

    Raises:
        ValueError: naming the argument that is out of range.
    """
    check_world_size(world_size)
    if not nbytes >= 0:
        raise ValueError(f"nbytes must be >= 0 bytes, got {nbytes!r}")
    _check_link_numbers(alpha_s, bandwidth)
    if world_size == 1 or nbytes == 0:
        return 0.0
    return (world_size - 1) / world_size * nbytes / bandwidth + (world_size - 1) * alpha_s


def ring_all_reduce_s(nbytes: float, world_size: int, alpha_s: float, bandwidth: float) -> float:
    """Seconds of one ring all-reduce of ``nbytes`` bytes: a ring reduce-scatter followed by a ring
    all-gather of the same buffer, 2·(W-1)/W · nbytes/β + 2·(W-1)·α (Patarasuk & Yuan 2009, §3;
    Thakur, Rabenseifner & Gropp 2005, §4). Arguments and errors as :func:`ring_collective_s`."""
    return 2 * ring_collective_s(nbytes, world_size, alpha_s, bandwidth)


def check_world_size(world_size: int) -> None:
    """Raise ValueError unless ``world_size`` is an integer >= 1."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an integer >= 1, got {world_size!r}")


def _check_link_numbers(alpha_s: float, bandwidth: float, prefix: str = "") -> None:
    if not (isinstance(alpha_s, (int, float)) and alpha_s >= 0 and math.isfinite(alpha_s)):
        raise ValueError(f"{prefix}alpha_s (latency, seconds) must be a finite number >= 0, got {alpha_s!r}")
    if not (isinstance(bandwidth, (int, float)) and bandwidth > 0):
        raise ValueError(f"{prefix}bandwidth (bytes per second) must be > 0, got {bandwidth!r}")


@dataclass(frozen=True)
class Link:
    """An α–β link between ranks (see the module docstring for the ring cost model).

    Attributes:
        name: a label for tables and plots.
        alpha_s: per-step latency α in seconds.
        bandwidth: per-rank bandwidth β in bytes per second (one direction).
        reduce_scatter_alpha_s: α for reduce-scatters if it differs (None: ``alpha_s``); a link fitted
            to measurements (:func:`fit_link`) can carry one per collective.
        reduce_scatter_bandwidth: β for reduce-scatters if it differs (None: ``bandwidth``).

    Raises:
        ValueError: a negative or non-finite latency, or a bandwidth <= 0 (the message names it).
    """

    name: str
    alpha_s: float
    bandwidth: float
    reduce_scatter_alpha_s: float | None = None
    reduce_scatter_bandwidth: float | None = None

    def __post_init__(self) -> None:
        _check_link_numbers(self.alpha_s, self.bandwidth, f"Link {self.name!r}: ")
        if self.reduce_scatter_alpha_s is not None or self.reduce_scatter_bandwidth is not None:
            _check_link_numbers(self.rs_alpha_s, self.rs_bandwidth, f"Link {self.name!r}: reduce_scatter_")

    @property
    def rs_alpha_s(self) -> float:
        """Latency α used for reduce-scatters (seconds)."""
        return self.alpha_s if self.reduce_scatter_alpha_s is None else self.reduce_scatter_alpha_s

    @property
    def rs_bandwidth(self) -> float:
        """Bandwidth β used for reduce-scatters (bytes per second)."""
        return self.bandwidth if self.reduce_scatter_bandwidth is None else self.reduce_scatter_bandwidth

    def all_gather_s(self, nbytes: float, world_size: int) -> float:
        """Seconds of a ring all-gather whose output (the unsharded buffer) has ``nbytes`` bytes."""
        return ring_collective_s(nbytes, world_size, self.alpha_s, self.bandwidth)

    def unit_all_gather_s(self, wire_bytes: float, unsharded_bytes: float, world_size: int, phase: str) -> float:
        """Seconds of a unit's (or bucket's) all-gather in ``phase`` ("forward" or "backward"):
        here :meth:`all_gather_s` of the ``wire_bytes`` it delivers, whatever the phase; a link
        whose backward all-gathers run elsewhere (ZeRO++ hpZ: :class:`flashfsdp.sim.zeropp.ZeroPPLink`)
        overrides it. ``unsharded_bytes``: the gathered parameters in ``param_dtype``."""
        return self.all_gather_s(wire_bytes, world_size)

    def reduce_scatter_s(self, nbytes: float, world_size: int) -> float:
        """Seconds of a ring reduce-scatter whose input (the unsharded buffer) has ``nbytes`` bytes."""
        return ring_collective_s(nbytes, world_size, self.rs_alpha_s, self.rs_bandwidth)

    def all_reduce_s(self, nbytes: float, world_size: int) -> float:
        """Seconds of a ring all-reduce of ``nbytes`` bytes (:func:`ring_all_reduce_s`), at the
        all-gather's α and β (an all-reduce moves data like an all-gather after a reduce-scatter)."""
        return ring_all_reduce_s(nbytes, world_size, self.alpha_s, self.bandwidth)

    def latency_s(self, world_size: int, collective: str = "all_gather") -> float:
        """The latency part of one collective, seconds: (W-1)·α for "all_gather" and
        "reduce_scatter", 2·(W-1)·α for "all_reduce"."""
        alpha = self.rs_alpha_s if collective == "reduce_scatter" else self.alpha_s
        steps = 2 * (world_size - 1) if collective == "all_reduce" else world_size - 1
        return steps * alpha if world_size > 1 else 0.0

    def describe(self) -> str:
        """``"<name>: α = … µs, β = … GB/s"`` (and the reduce-scatter's if they differ)."""
        text = f"{self.name}: α = {self.alpha_s * 1e6:.3g} µs, β = {self.bandwidth / 1e9:.3g} GB/s"
        if self.reduce_scatter_alpha_s is not None or self.reduce_scatter_bandwidth is not None:
            text += (f" (reduce-scatter: α = {self.rs_alpha_s * 1e6:.3g} µs, "
                     f"β = {self.rs_bandwidth / 1e9:.3g} GB/s)")
        return text


# Assumed link speeds (per GPU, one direction). NVLink 4 on H100 SXM: 900 GB/s bidirectional;
# 400 Gb/s InfiniBand NDR and 100 Gb/s Ethernet: one NIC per GPU. Latencies are typical
# per-hop values of a ring step (NCCL's LL/Simple protocols over each fabric, order of magnitude).
LINKS: dict[str, Link] = {
    "nvlink": Link("NVLink (450 GB/s)", alpha_s=3e-6, bandwidth=450e9),
    "ib400": Link("InfiniBand 400 Gb/s", alpha_s=8e-6, bandwidth=50e9),
    "eth100": Link("Ethernet 100 Gb/s", alpha_s=30e-6, bandwidth=12.5e9),
}


def get_link(link: "str | Link") -> Link:
    """A :class:`Link` by name (a key of :data:`LINKS`), or ``link`` itself if it is one.

    Raises:
        ValueError: an unknown name (the message lists the choices).
    """
    if isinstance(link, Link):
        return link
    if link not in LINKS:
        raise ValueError(f"link: unknown link {link!r}; choose one of {', '.join(LINKS)} or pass a Link")
    return LINKS[link]


def fit_alpha_beta(samples: Sequence[tuple[float, int, float]]) -> tuple[float, float]:
    """Least-squares α (seconds) and β (bytes/s) of the ring model from measured collectives.

    Args:
        samples: ``(nbytes, world_size, seconds)`` per measurement; ``nbytes`` the unsharded size.
            The model t = (W-1)·α + ((W-1)/W · nbytes)·(1/β) is linear in (α, 1/β).

    Returns:
        ``(alpha_s, bandwidth)``; α is clipped at 0 (a negative intercept is measurement noise).

    Raises:
        ValueError: fewer than two distinct sizes, a world size < 2, or non-positive times.
    """
    rows = []
    for nbytes, world_size, seconds in samples:
        check_world_size(world_size)
        if world_size < 2:
            raise ValueError("fit_alpha_beta: samples need world_size >= 2 (W = 1 moves no bytes)")
        if not seconds > 0 or not nbytes >= 0:
            raise ValueError(f"fit_alpha_beta: bad sample (nbytes={nbytes!r}, seconds={seconds!r})")
        rows.append(((world_size - 1), (world_size - 1) / world_size * nbytes, seconds))
    if len({r[1] for r in rows}) < 2:
        raise ValueError("fit_alpha_beta: need samples of at least two different sizes")
    # Normal equations of the 2-parameter least squares t ≈ a·x0 + b·x1 (no intercept column).
    s00 = sum(x0 * x0 for x0, _, _ in rows)
    s01 = sum(x0 * x1 for x0, x1, _ in rows)
    s11 = sum(x1 * x1 for _, x1, _ in rows)
    t0 = sum(x0 * t for x0, _, t in rows)
    t1 = sum(x1 * t for _, x1, t in rows)
    det = s00 * s11 - s01 * s01
    if det == 0:
        raise ValueError("fit_alpha_beta: degenerate samples (sizes and world sizes are collinear)")
    alpha = (t0 * s11 - t1 * s01) / det
    inv_beta = (s00 * t1 - s01 * t0) / det
    if alpha < 0:  # refit the slope alone through the origin
        alpha, inv_beta = 0.0, t1 / s11
    if inv_beta <= 0:
        raise ValueError("fit_alpha_beta: the times do not grow with size; cannot fit a bandwidth")
    return alpha, 1.0 / inv_beta


def fit_link(name: str, all_gather: Sequence[tuple[float, int, float]],
             reduce_scatter: Sequence[tuple[float, int, float]] | None = None) -> Link:
    """A :class:`Link` fitted to measured all-gathers (and reduce-scatters, fitted separately).

    Args:
        name: the link's label.
        all_gather: ``(nbytes, world_size, seconds)`` samples of all-gathers (see :func:`fit_alpha_beta`).
        reduce_scatter: the same for reduce-scatters; None uses the all-gather fit for both.
    """
    alpha, beta = fit_alpha_beta(all_gather)
    if reduce_scatter is None:
        return Link(name, alpha, beta)
    rs_alpha, rs_beta = fit_alpha_beta(reduce_scatter)
    return Link(name, alpha, beta, reduce_scatter_alpha_s=rs_alpha, reduce_scatter_bandwidth=rs_beta)
