"""PyTorch's FSDP1 unit tests ported: each case against torch's FullyShardedDataParallel and flashfsdp's."""
