"""`python -m flashfsdp.train`: the same as the `flashfsdp-train` command."""

import sys

from flashfsdp.train.cli import main

sys.exit(main())
