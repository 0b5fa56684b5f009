"""`flashfsdp-train --config run.toml`: a TOML file of option values, one table per section.

    [model]
    preset = "small"
    seq_len = 256
    [training]
    steps = 2000
    [sharding]
    param_dtype = "bf16"
    reshard_after_forward = false

The tables are the sections of `flashfsdp-train --help` (`flashfsdp_cli.train_sections`), the
keys their options' field names (written with '_' or '-'); a flag given on the command line
overrides the file. Each value must have the option's type: an integer for an integer option, a
number for a float option, a string for a string option (one of the option's choices, where it
has them), true/false for a switch, an array of strings for a repeatable option (--freeze), and
true, false or an integer for --reshard-after-forward. The earlier flat layout, the options'
names at the top level (``seq-len = 256``), still loads (`flashfsdp.train.config_file` logs one
deprecation notice naming each key's section). The file is read with `tomllib` (Python 3.11+, the
`tomli` package before). The run's resolved config is what `TrainConfig.save` writes to
`<out>/run.json`; the TOML file is only one of its inputs.

Standard library only (see `flashfsdp_cli`): `flashfsdp-train` checks the file here, before torch
is imported, so a wrong key or value is one line and exit code 2 at once.
"""

from __future__ import annotations

from typing import Any

from flashfsdp_cli.config_fields import Option, convert
from flashfsdp_cli.errors import UsageError
from flashfsdp_cli.train_sections import BY_KEY, SECTIONS, option_named


def _toml():
    try:
        import tomllib  # noqa: PLC0415 - Python 3.11+
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # noqa: PLC0415
        except ModuleNotFoundError:
            raise UsageError("--config: reading TOML needs Python 3.11 or the tomli package "
                             "(pip install tomli)") from None
    return tomllib


def read_toml(path: str) -> dict[str, Any]:
    """The top-level table of the TOML file `path`.

    Raises:
        UsageError: the file is missing or unreadable, or is not valid TOML (the message gives
            the parser's line and column).
    """
    tomllib = _toml()
    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except OSError as err:
        raise UsageError(f"--config {path}: cannot read it ({err.strerror or err}); "
                         "give an existing TOML file") from None
    except tomllib.TOMLDecodeError as err:
        raise UsageError(f"--config {path}: not valid TOML: {err}") from None


def _section_items(where: str, section: str, table: dict) -> list[tuple[str, Option, Any]]:
    """(key as written, option, value) of each key of the `[section]` table."""
    items = []
    for name, value in table.items():
        opt = BY_KEY.get(f"{section}.{name.replace('-', '_')}")
        if opt is None:
            keys = ", ".join(k.partition(".")[2] for k in BY_KEY if k.startswith(section + "."))
            raise UsageError(f"{where}: unknown key '{section}.{name}'; the keys of [{section}] are {keys}")
        items.append((f"{section}.{name}", opt, value))
    return items


def _flat_item(where: str, key: str, value: Any) -> tuple[str, Option, Any]:
    """(key, option, value) of a top-level key: an option's name in the earlier flat layout."""
    opt = option_named(key)
    if opt is not None:
        return key, opt, value
    if key in SECTIONS:
        raise UsageError(f"{where}: key {key!r} must be a table: write its options under [{key}]")
    if isinstance(value, dict):
        raise UsageError(f"{where}: unknown section [{key}]; the sections are {', '.join(SECTIONS)}")
    raise UsageError(f"{where}: unknown key {key!r}; write each option in the table of its --help group, "
                     "by its name with '_': [model] seq_len = 256")


def read_values(path: str) -> tuple[dict[str, Any], list[str]]:
    """The option values the TOML file `path` sets, by dotted key, checked and typed, and its
    top-level (flat, deprecated) keys as "key -> section.key".

    Args:
        path: the TOML file (--config).

    Returns:
        ({dotted key: value}, e.g. {"model.seq_len": 256, "optimizer.lr": 0.001}; the flat keys
        found, e.g. ["seq-len -> model.seq_len"]).

    Raises:
        UsageError: an unreadable or invalid file; an unknown section or key (`config` among
            them); an option given twice (flat and in its section); a value of the wrong type or
            outside the option's choices. The message names the file and the key.
    """
    where = f"--config {path}"
    items, flat = [], []
    for key, value in read_toml(path).items():
        if key in SECTIONS and isinstance(value, dict):
            items += _section_items(where, key, value)
        else:
            items.append(_flat_item(where, key, value))
            flat.append(items[-1])
    values: dict[str, Any] = {}
    for key, opt, value in items:
        if opt.key in values:
            raise UsageError(f"{where}: {opt.key} is set twice (key {key!r}); keep the one in [{opt.section}]")
        values[opt.key] = convert(opt, value, where, key)
    return values, [f"{key} -> {opt.key}" for key, opt, _ in flat]


def fill_unset(values: dict[str, Any], path: str | None) -> tuple[dict[str, Any], list[str]]:
    """`values` (a parsed command line, by dotted key, None where not given) with the --config
    file `path`'s values where the command line gives none (`read_values`, whose errors it
    raises); returns (`values`, updated in place, the file's flat keys)."""
    if path is None:
        return values, []
    found, flat = read_values(path)
    for key, value in found.items():
        if values[key] is None:
            values[key] = value
    return values, flat
