"""The command lines of flashfsdp, importable without torch: `flashfsdp-train`'s entry point and
its option parsers.

`import flashfsdp` loads torch (several seconds on a cold start); this package imports nothing
but the standard library, so `flashfsdp-train --help` and usage errors answer at once, and torch
is loaded only for a command line that runs (`flashfsdp_cli.train.main`). The training job itself
is `flashfsdp.train`, which builds its `TrainConfig` from these parsers.
"""
