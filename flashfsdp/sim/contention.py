"""Host contention: compute and collectives that slow each other down when they run at once.

On a GPU, compute and NCCL run on separate engines and barely interfere. On a CPU host running gloo,
the collective is work for the CPU too: gloo's worker thread sends and receives over loopback TCP
(kernel copies, socket wake-ups) and, for a reduce-scatter, adds. With W ranks on few cores (W = 2
ranks on 2 cores: one core per rank) there is no spare core for it, so "overlapped" communication
and compute share the core: a prefetched all-gather takes longer than the same all-gather measured
alone, and the compute it overlaps takes longer than it does without communication.

The model is a pair of progress rates, applied while the host computes *and* a collective of the
same rank is in flight (both its latency and its bandwidth phase; a GPU copy-in phase is not):

- ``compute_rate`` — seconds of compute done per second (1.0: unaffected).
- ``comm_rate`` — seconds of the collective's stand-alone cost done per second.

Both are measured on their own, outside the training step (:func:`fit_contention`): a compute kernel
of ``c`` seconds and a collective of ``m`` seconds timed alone, then the collective issued and the
same kernel run at once, with ``c`` short enough that the collective outlasts it. The kernel ran
overlapped throughout, so ``compute_rate = c / c_ov``; the collective did ``m - wait`` of its work
during the ``c_ov`` seconds of overlap, so ``comm_rate = (m - wait) / c_ov``, where ``wait`` is the
time ``wait()`` then blocked.

Limits: the rates of one kernel (a matmul of the model's shape) stand for all of the step's compute;
they are taken as constant over message sizes and assume one collective at a time (gloo's one
queue); the OS scheduler's choices (which thread runs when both are ready) are folded into two
averages.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Sequence


def _check_rate(owner: str, name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value <= 1) or not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be a rate in (0, 1], got {value!r}")


@dataclass(frozen=True)
class Contention:
    """Progress rates of compute and of a collective while both run on one host (see the module docstring).

    Attributes:
        compute_rate: compute progress per second while a collective is in flight, in (0, 1].
        comm_rate: collective progress (seconds of its stand-alone cost) per second while the host
            computes, in (0, 1].
        reduce_scatter_compute_rate, reduce_scatter_comm_rate: the same for reduce-scatters if they
            differ (None: the all-gather's rates).
        name: a label for tables.

    Raises:
        ValueError: a rate outside (0, 1] (the message names it).
    """

    compute_rate: float
    comm_rate: float
    reduce_scatter_compute_rate: float | None = None
    reduce_scatter_comm_rate: float | None = None
    name: str = "contention"

    def __post_init__(self) -> None:
        owner = f"Contention {self.name!r}"
        _check_rate(owner, "compute_rate", self.compute_rate)
        _check_rate(owner, "comm_rate", self.comm_rate)
        for attr in ("reduce_scatter_compute_rate", "reduce_scatter_comm_rate"):
            if getattr(self, attr) is not None:
                _check_rate(owner, attr, getattr(self, attr))

    def rates(self, kind: str) -> tuple[float, float]:
        """``(compute_rate, comm_rate)`` while a collective of ``kind`` ("all_gather" or
        "reduce_scatter") overlaps compute."""
        if kind == "reduce_scatter":
            return (self.compute_rate if self.reduce_scatter_compute_rate is None else self.reduce_scatter_compute_rate,
                    self.comm_rate if self.reduce_scatter_comm_rate is None else self.reduce_scatter_comm_rate)
        return self.compute_rate, self.comm_rate

    def describe(self) -> str:
        """``"compute ×0.62, all-gather ×0.51 while overlapped"`` (and the reduce-scatter's if they differ)."""
        text = f"all-gather: compute x{self.compute_rate:.2f}, collective x{self.comm_rate:.2f}"
        if self.reduce_scatter_compute_rate is not None or self.reduce_scatter_comm_rate is not None:
            c, m = self.rates("reduce_scatter")
            text += f"; reduce-scatter: compute x{c:.2f}, collective x{m:.2f}"
        return text + " (progress rates while overlapped)"


def contention_rates(samples: Sequence[tuple[float, float, float, float]]) -> tuple[float, float]:
    """Median ``(compute_rate, comm_rate)`` of overlap measurements (see the module docstring).

    Args:
        samples: ``(c, c_ov, m, wait)`` seconds per measurement: the kernel alone, the kernel while
            the collective runs (timed from the return of the collective's issue call), the
            collective alone (issue call excluded), and the time ``wait()`` blocked after the
            overlapped kernel.

    Returns:
        the medians, each clipped to (0, 1] (a rate above 1 is noise: overlap cannot speed anything up).

    Raises:
        ValueError: no samples, a non-positive time, or a sample whose collective finished before the
            overlapped kernel did (``wait`` <= 0: the comm rate is then not measurable).
    """
    if not samples:
        raise ValueError("contention_rates: need at least one (c, c_ov, m, wait) sample")
    compute, comm = [], []
    for c, c_ov, m, wait in samples:
        if not (c > 0 and c_ov > 0 and m > 0):
            raise ValueError(f"contention_rates: times must be > 0 seconds, got c={c!r}, c_ov={c_ov!r}, m={m!r}")
        if not wait > 0:
            raise ValueError("contention_rates: the collective finished before the overlapped kernel did "
                             f"(wait={wait!r}); use a shorter kernel so that the collective outlasts it")
        compute.append(c / c_ov)
        comm.append((m - wait) / c_ov)
    clip = lambda r: min(1.0, max(1e-3, r))  # noqa: E731
    return clip(statistics.median(compute)), clip(statistics.median(comm))


def fit_contention(all_gather: Sequence[tuple[float, float, float, float]],
                   reduce_scatter: Sequence[tuple[float, float, float, float]] | None = None,
                   name: str = "contention") -> Contention:
    """A :class:`Contention` from overlap measurements of all-gathers (and reduce-scatters, kept apart).

    Args:
        all_gather: ``(c, c_ov, m, wait)`` samples (see :func:`contention_rates`).
        reduce_scatter: the same for reduce-scatters; None: the all-gather's rates for both.
        name: the label.
    """
    compute, comm = contention_rates(all_gather)
    if reduce_scatter is None:
        return Contention(compute, comm, name=name)
    rs_compute, rs_comm = contention_rates(reduce_scatter)
    return Contention(compute, comm, reduce_scatter_compute_rate=rs_compute, reduce_scatter_comm_rate=rs_comm,
                      name=name)
