"""State dicts of fully_shard'ed models: sharded, full, optimizer, Hugging Face folders.

Which calls to use (every one collective unless said otherwise)
----------------------------------------------------------------
============================================  =====================================================
sharded checkpoint, model + optimizer          ``flashfsdp.checkpoint.save`` / ``load`` (atomic), or
(reshardable to any world size)                ``dcp.save`` / ``dcp.load`` of ``model.state_dict()``
                                               and ``optimizer.state_dict()`` (or the stock
                                               ``torch.distributed.checkpoint.state_dict``
                                               ``get_state_dict`` / ``set_state_dict``), as with FSDP2
full model state dict (plain tensors)          ``flashfsdp.get_full_state_dict`` / ``set_full_state_dict``,
                                               or DSD's getters and setters with
                                               ``StateDictOptions(full_state_dict=True)``
full state dict *into* a flashfsdp model       also ``model.load_state_dict(full_sd)`` on every rank
a Hugging Face folder (``from_pretrained``)    ``flashfsdp.save_pretrained``
============================================  =====================================================

The modules import one way, each only those before it:

- ``sharded.py`` — ``model.state_dict()`` / ``load_state_dict()``: the hooks ``fully_shard``
  installs (the sharded DTensors, found whatever hooks renamed the keys; full or DTensor values
  loaded);
- ``full.py`` — :func:`get_full_state_dict` / :func:`set_full_state_dict`, unit by unit through
  the units' communicators;
- ``optimizer.py`` — :func:`get_optimizer_state_dict` / :func:`set_optimizer_state_dict` (DSD's,
  checked) and the optimizer step hooks that advance the shard epoch;
- ``hf_save.py`` — :func:`save_pretrained` (safetensors unit by unit from rank 0) and the names of
  the files it writes.

This package is public to the rest of the library (``flashfsdp.checkpoint``, ``flashfsdp.fsdp1``,
the training job): they import the names of ``__all__`` from here, never its modules.
"""

from .full import get_full_state_dict, set_full_state_dict
from .hf_save import INDEX_FILE, SINGLE_FILE, remove_stale_weights, save_pretrained
from .optimizer import get_optimizer_state_dict, set_optimizer_state_dict

__all__ = [
    "get_full_state_dict",
    "set_full_state_dict",
    "get_optimizer_state_dict",
    "set_optimizer_state_dict",
    "save_pretrained",
    "SINGLE_FILE",
    "INDEX_FILE",
    "remove_stale_weights",
]
