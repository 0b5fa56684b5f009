"""The `flashfsdp-train` command: its command line checked before torch is imported.

`--help`, `export --help`, an unknown option, a malformed value and the option values that need
nothing but themselves (`flashfsdp_cli.train_sections.check_values`) are answered here at once;
any other command line is handed to `flashfsdp.train.cli.main`, which imports torch.
"""

from __future__ import annotations

import sys

from flashfsdp_cli.config_file import fill_unset
from flashfsdp_cli.errors import UsageError
from flashfsdp_cli.streams import sturdy_output
from flashfsdp_cli.train_options import PROG, build_export_parser, check_values, parse_options


def precheck(argv: list[str]) -> None:
    """Parse `argv` as `flashfsdp-train` (or `flashfsdp-train export`) would, without torch,
    and read its --config file (`flashfsdp_cli.config_file`): the values it sets stand where the
    command line gives none, and are checked with them.

    Raises:
        SystemExit: --help (code 0), or an argparse error (code 2, one line on stderr).
        UsageError: an option value out of range (see `check_values`); an unreadable --config
            file, or one with an unknown key or a value of the wrong type (naming file and key).
    """
    if argv[:1] == ["export"]:
        build_export_parser().parse_args(argv[1:])
        return
    path, values = parse_options(argv)
    check_values(fill_unset(values, path)[0])


def main(argv: list[str] | None = None) -> int:
    """Run `flashfsdp-train ARGS`; returns the exit code (see `flashfsdp.train.cli.main`; 2 and
    one line on stderr for bad input, here before torch is imported). Its output survives its
    reader (`flashfsdp_cli.streams.sturdy_output`): a closed pipe ends no run and no final save."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with sturdy_output():
        try:
            precheck(argv)
        except UsageError as err:
            print(f"{PROG}: error: {err}", file=sys.stderr)
            return 2
        from flashfsdp.train.cli import main as run  # noqa: PLC0415 - torch is imported from here on

        return run(argv)


if __name__ == "__main__":
    sys.exit(main())
