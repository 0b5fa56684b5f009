"""The error of bad command-line input (one line on stderr, exit code 2), shared by the command
lines and the training job (`flashfsdp.train.errors` re-exports it)."""


class UsageError(Exception):
    """Bad command-line input: the message names the option and the fix (exit code 2)."""
