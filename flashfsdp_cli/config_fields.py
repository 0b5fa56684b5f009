"""Configuration sections whose fields describe themselves: one source for the command-line
options and the TOML keys. Standard library only (see `flashfsdp_cli`).

A section is a frozen dataclass; each of its fields is made with `option(...)`, whose metadata
hold the help text, the flag (default: `--` and the field's name with '-'), the choices, the
metavar, how a command-line string becomes a value (`parse`), how the help states a default the
job resolves (`default_text`), what a resumed run does with it (`resume`) and the range check of
its values (`check`). The field's annotation gives the kind of value (see `KINDS`); its default
is the value the job uses when the option is given nowhere. From these, `add_options` writes the
argparse options, one group per section, and `convert` checks a TOML (or JSON) value for a key,
so the command line, the `--config` file and `run.json` cannot drift apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import textwrap
import typing
from typing import Any, Callable, Iterable

from flashfsdp_cli.errors import UsageError

# The kinds of value a field may hold, from its annotation: "switch" (bool), "int", "float",
# "str", "strings" (tuple[str, ...], a repeatable option / a TOML array of strings) and
# "bool_or_int" (bool | int | None, as fully_shard's reshard_after_forward).
KINDS = ("switch", "int", "float", "str", "strings", "bool_or_int")
_EXPECTED = {"switch": "true or false", "int": "an integer", "float": "a number", "str": "a string",
             "strings": "a string or an array of strings", "bool_or_int": "true, false or an integer"}
# What a resumed run does with an option (`option(resume=...)`): "keep" takes the saved run's value
# (an explicit different value is ignored with a warning), "default" takes it when not given.
RESUME_RULES = ("keep", "default")
# Range checks of `option(check=...)`: (the test, what the message says a value must be).
CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "positive": (lambda v: v > 0, "positive"),
    "non_negative": (lambda v: v >= 0, "non-negative"),
    "positive_number": (lambda v: 0 < v < math.inf, "a positive number"),
    "bool_or_positive": (lambda v: isinstance(v, bool) or v > 0, "true, false or a positive integer"),
}


def option(default: Any = None, *, help: str, flag: str | None = None, choices: Iterable | None = None,
           metavar: str | None = None, parse: Callable[[str], Any] | None = None,
           default_text: str | None = None, resume: str | None = None, check: str | None = None,
           check_text: str | None = None) -> Any:
    """A section field that is also a command-line option and a TOML key.

    Args:
        default: the value when the option is given nowhere (None: unset, or resolved by the job,
            as `default_text` says).
        help: what the option does, for --help (the default is appended).
        flag: the command-line flag; default `--` + the field's name with '-' for '_'.
        choices: the values allowed (after `parse`).
        metavar: the value's name in --help.
        parse: turns a command-line or TOML string into the value (e.g. dtype aliases).
        default_text: how --help states a default the job resolves ("the preset's").
        resume: "keep" or "default" (see `RESUME_RULES`), or None: --resume leaves it alone.
        check: a key of `CHECKS`, the range its values must be in.
        check_text: what the range check's message says instead of `CHECKS`'s words.
    """
    if resume not in (None, *RESUME_RULES) or (check is not None and check not in CHECKS):
        raise ValueError(f"option: resume={resume!r} or check={check!r} is not one of "
                         f"{RESUME_RULES} / {sorted(CHECKS)}")
    meta = dict(help=help, flag=flag, choices=None if choices is None else tuple(choices), metavar=metavar,
                parse=parse, default_text=default_text, resume=resume, check=check, check_text=check_text)
    return dataclasses.field(default=default, metadata={"option": meta})


@dataclasses.dataclass(frozen=True)
class Option:
    """One field of a section as an option: where it lives, its flag, kind and documentation.

    Attributes:
        section: the section's name (its TOML table, e.g. "model").
        name: the field's name (its key in the table, e.g. "seq_len").
        flag: the command-line flag ("--seq-len").
        kind: one of `KINDS`.
        default: the field's default.
        help, choices, metavar, parse, default_text, resume, check, check_text: as `option`.
    """

    section: str
    name: str
    flag: str
    kind: str
    default: Any
    help: str
    choices: tuple | None = None
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    default_text: str | None = None
    resume: str | None = None
    check: str | None = None
    check_text: str | None = None

    @property
    def key(self) -> str:
        """"section.name": the option's dotted key (its argparse destination, and its name in
        messages about a --config file or run.json)."""
        return f"{self.section}.{self.name}"

    def help_text(self) -> str:
        """The --help line: the help, the default, and the TOML key where it is not the flag's."""
        text = self.help
        if self.default_text is not None:
            text += f" (default: {self.default_text})"
        elif self.default is not None and not isinstance(self.default, bool) and self.default != ():
            if isinstance(self.default, str):
                shown = self.default if self.default == self.default.strip() else repr(self.default)
            else:
                shown = f"{self.default:g}"
            text += f" (default {shown})"
        if self.kind == "strings":
            text += "; repeatable"
        if self.name != self.flag[2:].replace("-", "_"):
            text += f"; [{self.section}] {self.name} in a --config file"
        return text.replace("%", "%%")


def _kind(annotation: Any) -> str:
    """The `KINDS` entry of a field annotation (Optional[...] allowed)."""
    args = set(typing.get_args(annotation)) - {type(None)} or {annotation}
    if args == {bool}:
        return "switch"
    if args == {bool, int}:
        return "bool_or_int"
    if len(args) == 1 and next(iter(args)) in (int, float, str):
        return next(iter(args)).__name__
    if typing.get_origin(annotation) is tuple and typing.get_args(annotation)[0] is str:
        return "strings"
    raise TypeError(f"a config field cannot be {annotation!r}; use one of {KINDS}")


def options_of(section: str, cls: type) -> list[Option]:
    """The options of the section class `cls`, named `section`, in field order."""
    hints = typing.get_type_hints(cls)
    found = []
    for field in dataclasses.fields(cls):
        meta = dict(field.metadata["option"])
        meta["flag"] = meta["flag"] or "--" + field.name.replace("_", "-")
        found.append(Option(section, field.name, kind=_kind(hints[field.name]), default=field.default, **meta))
    return found


def add_options(parser: argparse.ArgumentParser, sections: dict[str, type]) -> None:
    """Add every section's options to `parser`, one argument group per section (titled by its
    name, described by its docstring's first line); each option's destination is its dotted key
    and its default None, so that an option given nowhere reads None."""
    for name, cls in sections.items():
        summary = (cls.__doc__ or "").strip().splitlines()[0].rstrip(".")
        group = parser.add_argument_group(name, textwrap.fill(f"{summary} ([{name}] in a --config file)", 78))
        for opt in options_of(name, cls):
            kwargs: dict[str, Any] = dict(dest=opt.key, default=None, help=opt.help_text())
            if opt.kind == "switch":
                kwargs["action"] = "store_true"
            else:
                metavar = opt.metavar or (None if opt.choices else opt.flag[2:].upper().replace("-", "_"))
                kwargs.update(metavar=metavar, choices=opt.choices,
                              type=opt.parse or {"int": int, "float": float}.get(opt.kind))
                if opt.kind == "strings":
                    kwargs["action"] = "append"
            group.add_argument(opt.flag, **kwargs)


def _type_ok(kind: str, value: Any) -> bool:
    """Whether a TOML / JSON `value` is of `kind` (before `parse` and the choices)."""
    if kind == "switch":
        return isinstance(value, bool)
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "strings":
        return isinstance(value, str) or (isinstance(value, list) and all(isinstance(v, str) for v in value))
    if kind == "bool_or_int":
        return isinstance(value, (bool, int, str))
    return isinstance(value, str)


def convert(opt: Option, value: Any, where: str, key: str) -> Any:
    """`value`, read from a file for `opt`, checked and typed (a float for a float option, a
    tuple for a repeatable one, `parse` and the choices applied).

    Args:
        opt: the option.
        value: the value as TOML or JSON gives it.
        where: the file, for the message ("--config run.toml").
        key: the key as written in the file, for the message.

    Raises:
        UsageError: a value of another type, one `parse` refuses, or one outside the choices;
            the message names `where` and `key`.
    """
    if not _type_ok(opt.kind, value):
        raise UsageError(f"{where}: key {key!r} must be {_EXPECTED[opt.kind]}, got {value!r} "
                         f"({type(value).__name__})")
    if opt.kind == "float":
        return float(value)
    if opt.kind == "strings":
        return (value,) if isinstance(value, str) else tuple(value)
    if isinstance(value, str) and opt.parse is not None:
        try:
            value = opt.parse(value)
        except (ValueError, argparse.ArgumentTypeError) as err:
            raise UsageError(f"{where}: key {key!r}: {err}") from None
    if opt.choices is not None and value not in opt.choices:
        raise UsageError(f"{where}: key {key!r} must be one of {', '.join(map(str, opt.choices))}, got {value!r}")
    return value


def check_ranges(options: Iterable[Option], values: dict[str, Any]) -> None:
    """Each option's choices and `check` on its value in `values` (by dotted key); unset (None)
    passes.

    Raises:
        UsageError: "--flag must be <range>, got <value>" for the first value out of range.
    """
    for opt in options:
        value = values.get(opt.key)
        if value is None:
            continue
        if opt.choices is not None and value not in opt.choices:
            raise UsageError(f"{opt.flag} must be one of {', '.join(map(str, opt.choices))}, got {value!r}")
        if opt.check is not None and not CHECKS[opt.check][0](value):
            raise UsageError(f"{opt.flag} must be {opt.check_text or CHECKS[opt.check][1]}, got {value}")


def build_sections(sections: dict[str, type], values: dict[str, Any]) -> dict[str, Any]:
    """One instance of each section class, its fields from `values` (by dotted key; a key not in
    `values` takes the field's default).

    Raises:
        UsageError: a key of `values` that is no section's field (names it).
    """
    fields = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in sections.items()}
    for key in values:
        section, _, name = key.partition(".")
        if name not in fields.get(section, ()):
            raise UsageError(f"unknown configuration key {key!r}")
    return {name: cls(**{f: values[f"{name}.{f}"] for f in fields[name] if f"{name}.{f}" in values})
            for name, cls in sections.items()}
