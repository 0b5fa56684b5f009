"""The error every check of `flashfsdp-train` raises for bad input (one line, exit code 2).

Defined with the command lines (`flashfsdp_cli.errors`), which raise it before torch is imported."""

from flashfsdp_cli.errors import UsageError

__all__ = ["UsageError"]
