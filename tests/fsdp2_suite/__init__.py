"""PyTorch's FSDP2 unit tests, ported to CPU gloo and run against torch's ``fully_shard`` and flashfsdp."""
