"""Schedule settings to compare, and sweeps of the simulator over models, links and world sizes.

A :class:`Setting` is one configuration of the runtime's schedule (its :class:`PrefetchPolicy`,
``reshard_after_forward``, explicit prefetch lists :func:`prefetch_ahead` units deep and the
bucket size of ``runtime/step.py``'s [Note: buckets]);
:data:`SETTINGS` are the ones the benchmarks compare. :func:`compare_settings` predicts one model
under every setting; :func:`sweep` does so for every model, link and world size, as table rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from flashfsdp.runtime.schedule import PrefetchPolicy
from flashfsdp.runtime.step import DEFAULT_BUCKET_BYTES, check_bucket_bytes

from .link import Link, get_link
from .model import Model
from .simulate import Prediction, simulate

__all__ = ["SETTINGS", "Setting", "compare_settings", "prefetch_ahead", "sweep"]


def prefetch_ahead(model: Model, depth: int) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Explicit prefetch lists reaching ``depth`` units ahead (forward) and behind (backward).

    Forward: each unit prefetches the ``depth`` units after it in forward order (root first).
    Backward: each block prefetches the ``depth`` blocks before it, as the implicit policy would
    one deep (the root, first in forward order, gets no list). Pass the result as
    ``simulate(..., forward_prefetch=f, backward_prefetch=b)``, or to the runtime through
    ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``.
    """
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise ValueError(f"depth must be an integer >= 1, got {depth!r}")
    order = [u.name for u in model.units]
    forward = {n: order[i + 1:i + 1 + depth] for i, n in enumerate(order)}
    backward = {n: order[max(1, i - depth):i][::-1] for i, n in enumerate(order) if i > 0}
    return forward, backward


@dataclass(frozen=True)
class Setting:
    """A schedule configuration to compare.

    Attributes:
        label: the name in tables and plots.
        forward, backward, max_inflight: the :class:`PrefetchPolicy` fields.
        reshard_after_forward: free non-root units after forward.
        depth: explicit prefetch lists this many units deep (:func:`prefetch_ahead`); 1: the
            implicit policy alone.
        bucket_bytes: the bucket size in bytes (``simulate``'s ``bucket_bytes``; 0: no buckets);
            None: not set by the setting (``simulate``'s default, or a ``bucket_bytes`` given to
            :func:`compare_settings` / :func:`sweep`).

    Raises:
        ValueError / TypeError: a ``bucket_bytes`` that is negative / not an int.
    """

    label: str
    forward: bool = True
    backward: bool = True
    max_inflight: int = 2
    reshard_after_forward: bool = True
    depth: int = 1
    bucket_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.bucket_bytes is not None:
            check_bucket_bytes(self.bucket_bytes)

    def policy(self) -> PrefetchPolicy:
        """The runtime's :class:`PrefetchPolicy` of this setting (explicit lists aside)."""
        return PrefetchPolicy(self.forward, self.backward, self.max_inflight)

    def simulate_kwargs(self, model: Model) -> dict:
        """The :func:`simulate` keyword arguments of this setting for ``model``."""
        kwargs = {"policy": self.policy(),
                  "reshard_after_forward": self.reshard_after_forward, "label": self.label}
        fwd, bwd = prefetch_ahead(model, self.depth) if self.depth > 1 else ({}, {})
        if fwd:
            kwargs["forward_prefetch"] = fwd
        if bwd:
            kwargs["backward_prefetch"] = bwd
        if self.bucket_bytes is not None:
            kwargs["bucket_bytes"] = self.bucket_bytes
        return kwargs


SETTINGS: tuple[Setting, ...] = (
    Setting("no prefetch", forward=False, backward=False),
    Setting("backward only", forward=False),
    Setting("fwd+bwd (default)"),
    Setting("fwd+bwd, 2 deep, max_inflight 1", depth=2, max_inflight=1),
    Setting("fwd+bwd, 2 deep, max_inflight 2", depth=2, max_inflight=2),
    Setting("fwd+bwd, reshard_after_forward=False", reshard_after_forward=False),
    Setting("fwd+bwd, 4 MiB buckets (the runtime's default)", bucket_bytes=DEFAULT_BUCKET_BYTES),
)


def compare_settings(model: Model, world_size: int, link: "Link | str",
                     settings: Sequence[Setting] = SETTINGS, **kwargs) -> list[Prediction]:
    """:func:`simulate` under every setting (other keyword arguments passed through; a
    ``bucket_bytes`` among them applies to the settings that set none)."""
    predictions = []
    for setting in settings:
        own = setting.simulate_kwargs(model)
        rest = {k: v for k, v in kwargs.items() if not (k == "bucket_bytes" and k in own)}
        predictions.append(simulate(model, world_size, link, **own, **rest))
    return predictions


def sweep(models: Sequence[Model], links: Sequence["Link | str"], world_sizes: Sequence[int],
          settings: Sequence[Setting] = SETTINGS, **kwargs) -> list[dict]:
    """:func:`compare_settings` for every model × link × world size, as table rows.

    Each row is :meth:`Prediction.row` plus the model's name, the link's α (``alpha_us``) and β
    (``beta_GBps``), and the first block's all-gather, reduce-scatter, forward and backward times
    in ms (``ag_per_block_ms``, ``rs_per_block_ms``, ``block_fwd_ms``, ``block_bwd_ms``). Other
    keyword arguments go to :func:`simulate`.
    """
    rows = []
    for model in models:
        block = model.blocks[0]
        for link in map(get_link, links):
            for world_size in world_sizes:
                ag_s = link.all_gather_s(block.unsharded_bytes(world_size), world_size)
                rs_s = link.reduce_scatter_s(block.reduce_bytes_total(world_size), world_size)
                for pred in compare_settings(model, world_size, link, settings, **kwargs):
                    rows.append({"model": model.name, **pred.row(),
                                 "alpha_us": link.alpha_s * 1e6, "beta_GBps": link.bandwidth / 1e9,
                                 "ag_per_block_ms": ag_s * 1e3, "rs_per_block_ms": rs_s * 1e3,
                                 "block_fwd_ms": block.forward_s * 1e3, "block_bwd_ms": block.backward_s * 1e3})
    return rows
