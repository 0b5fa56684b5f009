"""FSDP1's wrapper API (``torch.distributed.fsdp.FullyShardedDataParallel``) over flashfsdp units.

``from flashfsdp import FullyShardedDataParallel as FSDP`` in place of torch's: each wrapper is
one ``fully_shard`` unit (``wrapper.py``); the enums and configs are torch's own (``api.py``), the
auto-wrap policies torch's (``wrap.py``). See docs/fsdp1_compatibility.md.
"""

from torch.distributed.fsdp.wrap import (  # noqa: F401  (re-exported: FSDP1 users import them from here too)
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from .api import *  # noqa: F401,F403  (FSDP1's enums and configs: api.__all__)
from .api import __all__ as _API_NAMES
from .wrapper import FullyShardedDataParallel

__all__ = [
    "FullyShardedDataParallel",
    *_API_NAMES,
    "ModuleWrapPolicy",
    "CustomPolicy",
    "always_wrap_policy",
    "lambda_auto_wrap_policy",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
]
