"""`<out>/run.json`: a run's resolved configuration, one object per section, and its resumptions.

    {"model": {"preset": "tiny", "seq_len": null, ...}, "data": {...}, ...,
     "resumptions": [{"step": 100, "world_size": 4, "time": "...", "changed": {...}}]}

`--resume` reads it back (`flashfsdp.train.config`). A run.json written before the configuration
had sections holds the options flat, by their names ({"preset": "tiny", "seq_len": null, "data":
..., "param_dtype": "fp32", ...}); it is read into the sections the options now live in (the
option `--data` into `data.path`, and so on), and rewritten sectioned at the first resumption.
"""

from __future__ import annotations

import json
import os
from typing import Any

from flashfsdp.train.errors import UsageError
from flashfsdp_cli.config_fields import convert
from flashfsdp_cli.train_sections import BY_KEY, SECTIONS, option_named

RUN_CONFIG = "run.json"
# The key of run.json that lists the run's resumptions (`TrainConfig.record_resumption`); no section.
RESUMPTIONS = "resumptions"


def is_sectioned(saved: dict) -> bool:
    """Whether a run.json's object (resumptions left out) holds sections rather than flat options."""
    return all(key in SECTIONS and isinstance(value, dict) for key, value in saved.items())


def _flat_key(key: str, path: str) -> str:
    """The dotted key of an option saved flat under its name ("seq_len" -> "model.seq_len")."""
    opt = option_named(key)
    if opt is None:
        raise UsageError(f"{path}: unknown key {key!r}; this run.json was not written by flashfsdp-train")
    return opt.key


def _dotted(saved: dict, path: str) -> dict[str, Any]:
    """The values of a run.json's object by dotted key, typed as the options' (a tuple for
    --freeze), from either layout."""
    if is_sectioned(saved):
        pairs = [(f"{section}.{name}", value) for section, table in saved.items() for name, value in table.items()]
    else:
        pairs = [(_flat_key(key, path), value) for key, value in saved.items()]
    values = {}
    for key, value in pairs:
        opt = BY_KEY.get(key)
        if opt is None:
            raise UsageError(f"{path}: unknown key {key!r}; this run.json was not written by flashfsdp-train")
        values[key] = None if value is None else convert(opt, value, path, key)
    return values


def load_run_file(out: str) -> tuple[dict[str, Any], list[dict]]:
    """(the saved config's values by dotted key, the resumptions) of `<out>/run.json`, sectioned
    or flat (see the module).

    Raises:
        FileNotFoundError: there is no run.json in `out`.
        ValueError: it is not valid JSON.
        UsageError: it holds a key that is no option, or a value of the wrong type (names it).
    """
    path = os.path.join(out, RUN_CONFIG)
    with open(path, encoding="utf-8") as fh:
        saved = json.load(fh)
    resumptions = saved.pop(RESUMPTIONS, [])
    return _dotted(saved, path), resumptions


def write_run_file(out: str, sections: dict[str, dict], resumptions: list[dict]) -> None:
    """Write `<out>/run.json` atomically: `sections` ({section: {key: value}}) and the list of the
    run's resumptions under "resumptions"."""
    os.makedirs(out, exist_ok=True)
    tmp = os.path.join(out, RUN_CONFIG + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump({**sections, RESUMPTIONS: list(resumptions)}, fh, indent=1)
    os.replace(tmp, os.path.join(out, RUN_CONFIG))


def _typed(value: Any) -> str:
    """An option value as a user types it: 0.001, true, "a, b" for a list; "unset" for None."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(map(str, value)) or "none"
    return str(value)


def describe_changes(changed: dict[str, list]) -> str:
    """The options a resumption changed, as flags and typed values: "--nproc unset -> 1, --steps
    100 -> 200" (`changed`: {dotted key: [before, after]}, a `resumptions` record's)."""
    return ", ".join(f"{BY_KEY[key].flag if key in BY_KEY else key} {_typed(before)} -> {_typed(after)}"
                     for key, (before, after) in sorted(changed.items()))
