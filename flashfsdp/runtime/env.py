"""flashfsdp's environment variables read as typed values, each refused by name when malformed."""

from __future__ import annotations

import os


def count_from_env(name: str, default: int, hint: str) -> int:
    """The whole number >= 0 in the environment variable ``name`` (``default`` when unset or blank).

    Raises:
        ValueError: the variable holds anything else; the message names it, its value and ``hint``
            (what to set it to).
    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"{name}={raw!r}: {hint}")
    return value
