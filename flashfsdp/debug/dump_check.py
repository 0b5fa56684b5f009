"""What a flight recorder dump must hold before ``python -m flashfsdp.debug`` reads it.

A dump is one rank's report (``flashfsdp.runtime.flight_dump.report``): written by flashfsdp, but
read back from disk, where it may be truncated, edited, or not a dump at all. :func:`check_report`
checks every key the diagnosis reads, with its type and range, so that a damaged dump is refused
with one line saying what is wrong (never a ``KeyError`` or ``TypeError`` from deep inside, nor a
world size that makes the diagnosis enumerate 10^12 ranks).
"""

from __future__ import annotations

MAX_DUMP_BYTES = 64 << 20  # a ring of 2048 entries is about 0.5 MB
MAX_WORLD_SIZE = 1 << 20  # ranks a job may have, for a dump's world_size and rank
_ENTRY_INTS = ("seq", "step", "nbytes")
_ENTRY_STRS = ("kind", "phase", "state")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(value, what: str, low: int = 0, high: int | None = None) -> None:
    if not _is_int(value):
        raise ValueError(f"{what} is {_shown(value)}, not an integer")
    if value < low or (high is not None and value >= high):
        bound = f"{low} .. {high - 1}" if high is not None else f">= {low}"
        raise ValueError(f"{what} is {value}, outside {bound}")


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _check_entry(entry, what: str) -> None:
    if not isinstance(entry, dict):
        raise ValueError(f"{what} is {type(entry).__name__}, not an object")
    for key in _ENTRY_INTS:
        if key not in entry:
            raise ValueError(f"{what} has no '{key}'")
        _check_int(entry[key], f"{what}'s '{key}'")
    for key in _ENTRY_STRS:
        if not isinstance(entry.get(key), str):
            raise ValueError(f"{what}'s '{key}' is {_shown(entry.get(key))}, not a string")
    if entry.get("unit") is not None and not isinstance(entry["unit"], str):
        raise ValueError(f"{what}'s 'unit' is {_shown(entry['unit'])}, not a string or null")
    group = entry.get("group")
    if group is not None and not (isinstance(group, list) and all(_is_int(r) for r in group)):
        raise ValueError(f"{what}'s 'group' is {_shown(group)}, not a list of ranks")


def _check_position(position) -> None:
    if not isinstance(position, dict):
        raise ValueError(f"'position' is {type(position).__name__}, not an object")
    _check_int(position.get("step"), "the position's 'step'", low=-(1 << 62))
    _check_int(position.get("last_seq"), "the position's 'last_seq'")
    if not isinstance(position.get("phase"), str):
        raise ValueError(f"the position's 'phase' is {_shown(position.get('phase'))}, not a string")
    if position.get("unit") is not None and not isinstance(position["unit"], str):
        raise ValueError(f"the position's 'unit' is {_shown(position['unit'])}, not a string or null")
    if position.get("waiting") is not None:
        _check_entry(position["waiting"], "the position's waiting entry")


def check_report(report, rank_of_file: int | None = None) -> None:
    """Raise ValueError (one line: what is wrong) unless ``report`` is a flight recorder report
    that the diagnosis can read; ``rank_of_file``: the rank its file name gives.

    Checked: an object with ``rank`` (an integer below :data:`MAX_WORLD_SIZE`, the file name's),
    ``world_size`` (absent, null or an integer 1 .. :data:`MAX_WORLD_SIZE` above ``rank``),
    ``position`` (``step``, ``last_seq``, ``phase``, ``unit``, ``waiting``), ``entries`` (a list
    of entries: ``seq``, ``step``, ``nbytes`` integers, ``kind``, ``phase``, ``state`` strings,
    ``unit`` a string or null, ``group`` a list of ranks), ``reason`` and ``error`` strings or null.
    """
    if not isinstance(report, dict):
        raise ValueError(f"it holds {type(report).__name__}, not an object")
    missing = [key for key in ("rank", "position", "entries") if key not in report]
    if missing:
        raise ValueError(f"it has no {', '.join(repr(k) for k in missing)}")
    _check_int(report["rank"], "'rank'", high=MAX_WORLD_SIZE)
    if rank_of_file is not None and report["rank"] != rank_of_file:
        raise ValueError(f"'rank' is {report['rank']}, but the file is rank {rank_of_file}'s")
    world = report.get("world_size")
    if world is not None:
        _check_int(world, "'world_size'", low=1, high=MAX_WORLD_SIZE + 1)
        if report["rank"] >= world:
            raise ValueError(f"'rank' is {report['rank']}, not below 'world_size' {world}")
    for key in ("reason", "error"):
        if report.get(key) is not None and not isinstance(report[key], str):
            raise ValueError(f"'{key}' is {_shown(report[key])}, not a string or null")
    _check_position(report["position"])
    entries = report["entries"]
    if not isinstance(entries, list):
        raise ValueError(f"'entries' is {type(entries).__name__}, not a list")
    for i, entry in enumerate(entries):
        _check_entry(entry, f"entry {i}")
