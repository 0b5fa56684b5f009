"""Models trained by `flashfsdp.train`: a Llama-style decoder and its size presets."""

from flashfsdp.models.llama import (
    PRESETS,
    Attention,
    Block,
    FeedForward,
    Llama,
    LlamaConfig,
    RMSNorm,
    config_from_preset,
)

__all__ = [
    "PRESETS",
    "Attention",
    "Block",
    "FeedForward",
    "Llama",
    "LlamaConfig",
    "RMSNorm",
    "config_from_preset",
]
