"""`python -m flashfsdp.train`: the same as the `flashfsdp-train` command."""

import sys

from flashfsdp_cli.train import main

sys.exit(main())
