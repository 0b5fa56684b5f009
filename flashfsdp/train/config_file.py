"""`flashfsdp-train --config run.toml`: the file's option values, read and checked by
`flashfsdp_cli.config_file` (standard library only: `flashfsdp-train` checks the file before torch
is imported), and the deprecation notice of the earlier flat layout through the `flashfsdp` logger.
"""

from __future__ import annotations

from typing import Any

from flashfsdp.log import get_logger
from flashfsdp_cli.config_file import fill_unset

_log = get_logger(__name__)


def file_values(values: dict[str, Any], path: str | None, warn: bool = True) -> dict[str, Any]:
    """`values` (a parsed command line by dotted key, None where not given) with the --config file
    `path`'s values where it gives none (`flashfsdp_cli.config_file.fill_unset`, whose errors it
    raises: UsageError naming the file and the key); None: no file.

    Args:
        values: the command line's values, updated in place.
        path: the TOML file (--config), or None.
        warn: log the deprecation notice of top-level (flat) keys.
    """
    values, flat = fill_unset(values, path)
    if flat and warn:
        _log.warning("--config %s: top-level keys are deprecated; move each into its section's table: %s", path,
                     ", ".join(flat))
    return values
