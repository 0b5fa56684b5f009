"""The arguments of a collective checkpoint call, the same on every rank.

``save`` and ``load`` are collective: every rank must name the same checkpoint. A rank given
another path (a relative path under another working directory, a per-rank f-string, ...) would
write its shard file elsewhere while rank 0 publishes a checkpoint that lacks it, or load another
checkpoint than its peers. So each call gathers every rank's arguments in the exchange that agrees
on its checks (``agree_and_gather``: no extra round trip), and every rank compares them before the
first byte is written or read: a difference is the same ``ValueError`` on every rank, naming the
argument and each rank's value.
"""

from __future__ import annotations

import reprlib
from typing import Any

_SHOWN = reprlib.Repr()
_SHOWN.maxstring = 120
_SHOWN.maxother = 120
_SHOWN.maxdict = 6


def argument(compared: Any, shown: Any = None) -> tuple[Any, str]:
    """One argument as the ranks compare it: ``(what is compared, how it is shown)``; ``shown``
    defaults to ``compared`` (each value shown by a short ``repr``)."""
    return compared, _SHOWN.repr(compared if shown is None else shown)


def _ranks(ranks: list[int]) -> str:
    """"rank 3" or "ranks 0-2, 5": the ranks, runs of consecutive ones as ranges."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)) for run in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def differences(everyone: list[dict[str, tuple[Any, str]]]) -> list[str]:
    """For each argument whose compared value is not the same on every rank: "NAME is A on rank
    0, B on rank 1", each distinct value once, with the ranks that gave it.

    Args:
        everyone: by rank, ``{argument name: argument(...)}``, the same names on every rank.
    """
    found = []
    for name in everyone[0]:
        groups: dict[Any, tuple[str, list[int]]] = {}
        for rank, arguments in enumerate(everyone):
            compared, shown = arguments[name]
            groups.setdefault(compared, (shown, []))[1].append(rank)
        if len(groups) > 1:
            found.append(f"{name} is " + ", ".join(f"{shown} on {_ranks(ranks)}" for shown, ranks in groups.values()))
    return found


def check_same(where: str, everyone: list[dict[str, tuple[Any, str]]], fix: str) -> None:
    """Raise ValueError on every rank (each holds the same ``everyone``) unless every argument is
    the same on every rank.

    Args:
        where: the function, e.g. "save".
        everyone: by rank, ``{argument name: argument(...)}`` (see :func:`differences`).
        fix: what the caller should do, ending the message.

    Raises:
        ValueError: "<where>: the ranks passed different arguments: path is '/a/x' on rank 0,
            '/b/x' on rank 1; <fix>".
    """
    found = differences(everyone)
    if found:
        raise ValueError(f"{where}: the ranks passed different arguments: {'; '.join(found)}; {fix}")
