"""``python -m benchmarks.gpu_check``: every GPU claim of flashfsdp measured in one command.

See :mod:`benchmarks.gpu_check.__main__` for the steps and :mod:`benchmarks.gpu_check.formula` for
the ZeRO-3 memory formula the peaks are compared with.
"""
