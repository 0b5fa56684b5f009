"""Where the ranks diverged, in words, from their flight-recorder reports (pure: no torch needed).

A report is one rank's JSON-serialisable account (``divergence.local_report``, or a dump file of
``flight_dump.py``): ``{"rank", "world_size", "reason", "error", "position", "entries"}`` with
``position`` as ``flight.position()`` and ``entries`` as ``flight.Entry.as_dict()``, oldest first.
:func:`describe` turns the reports of several ranks into the diagnosis every rank raises and
``python -m flashfsdp.debug`` prints::

    rank 0 waits in the reduce-scatter of 'layers.3' (backward, step 5, seq 418); rank 1 waits in
    the all-gather of 'layers.0' (forward, step 6, seq 412)
    the ranks diverged at seq 405: rank 0 issued the reduce-scatter of 'layers.3' (backward, step 5)
    where rank 1 issued the all-gather of 'layers.0' (forward, step 6)
"""

from __future__ import annotations

_KINDS = {"all_gather": "the all-gather", "reduce_scatter": "the reduce-scatter", "all_reduce": "the all-reduce",
          "broadcast": "the broadcast"}


def collective(entry: dict) -> str:
    """``"the all-gather of 'layers.0'"``; a control exchange: ``"the control exchange of <operation>"``."""
    if entry["kind"] == "control":
        return f"the control exchange of {entry.get('unit') or entry.get('phase')}"
    name = _KINDS.get(entry["kind"], entry["kind"])
    return f"{name} of '{entry['unit']}'" if entry.get("unit") else name


def _context(entry: dict, with_seq: bool = True) -> str:
    parts = [] if entry["kind"] == "control" else [entry["phase"]]
    parts.append(f"step {entry['step']}")
    if with_seq:
        parts.append(f"seq {entry['seq']}")
    return ", ".join(parts)


def position_of(report: dict) -> str:
    """Where one rank is: waiting in a collective, or past its last one (then its phase and unit)."""
    rank, position = report["rank"], report["position"]
    waiting = position.get("waiting")
    if waiting is not None:  # (waiting, or failed while it waited)
        return f"rank {rank} waits in {collective(waiting)} ({_context(waiting)})"
    unit = f" of '{position['unit']}'" if position.get("unit") else ""
    text = f"rank {rank} is in {position['phase']}{unit} at step {position['step']}"
    last = report["entries"][-1] if report.get("entries") else None
    if last is None:
        return text + " (no collective recorded yet)"
    return text + f" (its last collective: {collective(last)}, {_context(last)}, {last['state']})"


def _signature(entry: dict) -> tuple:
    return entry["kind"], entry.get("unit"), tuple(entry.get("group") or ())


def first_divergence(reports: list[dict]) -> str | None:
    """The first seq at which two ranks' recorded collectives differ (kind, unit or group), or one
    rank recorded one that another never issued; None if the rings agree where they overlap."""
    by_rank = [(r["rank"], {e["seq"]: e for e in r.get("entries") or []}, r["position"]["last_seq"]) for r in reports]
    if len(by_rank) < 2:
        return None
    start = max(min(seqs) if seqs else 1 for _, seqs, _ in by_rank)
    end = max(last for _, _, last in by_rank)
    # the seqs some rank recorded (a seq no rank holds tells nothing: the range itself may be huge)
    for seq in sorted({seq for _, seqs, _ in by_rank for seq in seqs if start <= seq <= end}):
        present = [(rank, seqs.get(seq)) for rank, seqs, _ in by_rank]
        issued = [(rank, e) for rank, e in present if e is not None]
        missing = [rank for rank, e in present if e is None]
        if missing and issued:
            rank, e = issued[0]
            others = ", ".join(f"rank {m}" for m in missing)
            return (f"the ranks diverged at seq {seq}: rank {rank} issued {collective(e)} ({_context(e, False)}) "
                    f"and {others} issued nothing after seq {seq - 1}")
        if len({_signature(e) for _, e in issued}) > 1:
            (r0, e0), (r1, e1) = issued[0], next((r, e) for r, e in issued[1:] if _signature(e) != _signature(issued[0][1]))
            return (f"the ranks diverged at seq {seq}: rank {r0} issued {collective(e0)} ({_context(e0, False)}) "
                    f"where rank {r1} issued {collective(e1)} ({_context(e1, False)})")
    return None


def _runs(ranks) -> list[tuple[int, int]]:
    """Runs of consecutive ranks of the ascending iterable ``ranks``, as (first, last)."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return [(first, last) for first, last in runs]


def describe(reports: list[dict], missing=(), grace_s: float | None = None) -> str:
    """The diagnosis of ``reports`` (one per rank that reported, any order) and of the ``missing``
    ranks (which sent none within ``grace_s`` seconds; any ascending iterable: runs of consecutive
    ranks are named as ranges, one line each)."""
    reports = sorted(reports, key=lambda r: r["rank"])
    lines = ["; ".join(position_of(r) for r in reports)]
    within = f" within {grace_s:g} s" if grace_s is not None else ""
    for first, last in _runs(sorted(missing) if isinstance(missing, (list, tuple, set)) else missing):
        who = f"rank {first}" if first == last else f"ranks {first}-{last}"
        lines.append(f"{who} sent no report{within} (it died, or is busy outside any flashfsdp collective)")
    divergence = first_divergence(reports)
    if divergence is not None:
        lines.append(divergence)
    failed = [r for r in reports if r.get("error")]
    for r in failed:
        lines.append(f"rank {r['rank']}: {r['reason']}: {r['error']}")
    return "\n".join(lines)
