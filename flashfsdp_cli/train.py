"""The `flashfsdp-train` command: its command line checked before torch is imported.

`--help`, `export --help`, an unknown option, a malformed value and the option values that need
nothing but themselves (`flashfsdp_cli.train_sections.check_values`) are answered here at once;
any other command line is handed to `flashfsdp.train.cli.main`, which imports torch.
"""

from __future__ import annotations

import sys

from flashfsdp_cli.errors import UsageError
from flashfsdp_cli.train_options import PROG, build_export_parser, check_values, parse_options


def precheck(argv: list[str]) -> None:
    """Parse `argv` as `flashfsdp-train` (or `flashfsdp-train export`) would, without torch.

    A --config file's values are not read here (`flashfsdp.train.config_file` checks them).

    Raises:
        SystemExit: --help (code 0), or an argparse error (code 2, one line on stderr).
        UsageError: an option value out of range (see `check_values`).
    """
    if argv[:1] == ["export"]:
        build_export_parser().parse_args(argv[1:])
        return
    check_values(parse_options(argv)[1])


def main(argv: list[str] | None = None) -> int:
    """Run `flashfsdp-train ARGS`; returns the exit code (see `flashfsdp.train.cli.main`; 2 and
    one line on stderr for bad input, here before torch is imported)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        precheck(argv)
    except UsageError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    from flashfsdp.train.cli import main as run  # noqa: PLC0415 - torch is imported from here on

    return run(argv)


if __name__ == "__main__":
    sys.exit(main())
