"""What the tests and the benchmarks share to run flashfsdp, from a checkout: not installed with the
library (setup.py packages ``flashfsdp`` and ``flashfsdp_cli`` only), imported from the repository
root (pytest's rootdir, ``python -m benchmarks.<name>``).

- :mod:`flashfsdp_dev.ranks`: run a function on W local ranks.
"""
