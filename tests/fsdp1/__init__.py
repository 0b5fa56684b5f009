"""flashfsdp.fsdp1's own tests. PyTorch's FSDP1 tests, ported, are in ``tests/fsdp1_suite/``, whose
helpers and runner these use."""
