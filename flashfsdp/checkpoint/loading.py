"""``load``: everything checked on every rank first, then DCP reads the shards in place.

[Note: load is all-or-nothing up to the shard files]
``load`` reads and checks everything small first, on every rank: the marker, DCP's ``.metadata``
(with a restricted unpickler), that every shard file it names exists and is long enough,
``extra.pt`` (``weights_only``), the checksums (the small files on every rank, the shard files
shared out over the ranks), and every model and optimizer entry's name and shape against the
checkpoint. The ranks agree on the outcome (one collective). Only then does DCP read the shard
files straight into the model's sharded storage and the optimizer's state. So any error but a
failure while reading the shard files leaves the model and optimizer as they were (an optimizer
without state, whose state DSD creates to describe it, is emptied again).
"""

from __future__ import annotations

import io
import os
import warnings
import zlib

import torch
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from flashfsdp.runtime import flight
from flashfsdp.runtime.agreement import agree, agree_and_gather, global_rank, global_world_size
from flashfsdp.bindings import set_optimizer_state_dict

from .arguments import argument, check_same
from .atomic import newest_copy, recovery_message
from .checksums import check, verify_share
from .common import check_model_optimizer, dcp_state, failures, short, single_process_quiet
from .files import check_path
from .marker import EXTRA, METADATA, read_marker
from .matching import check_against, check_shards
from .safe_metadata import DisallowedGlobal, SafeFileSystemReader, WeightsOnlyLoadPlanner, load_metadata


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         verify: bool = True) -> dict:
    """Load a checkpoint written by :func:`~flashfsdp.checkpoint.save` into ``model`` (and
    ``optimizer``), at any world size.

    Collective: every rank names the same checkpoint and passes an optimizer, or None, as every
    other (compared before anything is read: a difference is an error on every rank naming the
    argument and each rank's value). The checkpoint is checked first on every rank (marker, DCP metadata, every shard
    file, ``extra.pt``, the checksums, every parameter's name and shape), then DCP reads each rank's
    pieces straight into the sharded parameters and optimizer state (resharding as needed), and
    ``model.load_state_dict`` / :func:`~flashfsdp.set_optimizer_state_dict`
    finish the load (optimizer hyperparameters such as ``lr`` and the param groups come from the
    checkpoint). Nothing in the checkpoint is run: see the trust model in ``flashfsdp.checkpoint``.
    Works at W = 1 without torch.distributed initialised.

    If a save of ``path`` was interrupted while moving the new checkpoint into place, the newest
    complete copy (a hidden sibling ``.<name>.tmp`` or ``.<name>.old``) is loaded, with a warning
    naming both directories.

    Args:
        path: a checkpoint directory written by ``save``.
        model: the same model architecture, fully_shard'ed at any world size (or plain).
        optimizer: the same optimizer type (and param groups) over ``model``'s parameters, or None to
            load the model only.
        verify: check every file against the CRC-32 checksums written at save (the default; each
            byte is read once more, shared over the ranks). A checkpoint saved without checksums
            (by an earlier flashfsdp) loads with a warning.

    Returns:
        ``{"step": int, "extra": dict}`` as given to ``save``.

    Raises:
        (every error is raised on every rank; at W > 1 the message ends with the failing rank)
        FileNotFoundError: ``path`` does not exist, or a file of the checkpoint is missing (named).
        ValueError: ``path`` is not a complete checkpoint (no marker: the save did not finish); its
            marker, ``.metadata`` or ``extra.pt`` is corrupt (the file is named); ``.metadata``
            names a disallowed global (a crafted file: nothing was run); a file fails its checksum
            (named, with the entries it holds); a shard file is truncated; it has no optimizer
            state but ``optimizer`` was given; a parameter, buffer, optimizer state or
            hyperparameter is missing or has another shape (named); the ranks passed different
            paths, or an optimizer on some ranks only (each rank's value named).
        TypeError: a bad argument type.
        OSError: a file of the checkpoint cannot be read (e.g. PermissionError).
        RuntimeError: DCP failed to read a shard file on some rank (names the ranks and errors;
            also a non-tensor entry that ``torch.load(weights_only=True)`` refuses); the model and
            optimizer are then partly loaded (load a good checkpoint before training on). On every
            other error they are unchanged ([Note: load is all-or-nothing ...]).
    """
    with flight.operation("checkpoint.load"):  # the name its control messages carry
        checked, state = _checked(path, model, optimizer, verify)
        _read(checked["source"], state)
        _agreed(lambda: model.load_state_dict(state["model"]))
        if optimizer is not None:
            _agreed(lambda: set_optimizer_state_dict(model, optimizer, state["optim"]))
    return {"step": checked["marker"]["step"], "extra": checked["extra"]}


def _checked(path, model, optimizer, verify) -> tuple[dict, dict]:
    """The checkpoint checked on every rank and the arguments compared across ranks, in one
    exchange (an error on one rank is raised on all; then a difference: ``arguments.check_same``),
    before any state dict is taken (its getters may communicate); then the model checked against
    it and agreed, the model and optimizer unchanged on any error: (what ``_check_checkpoint``
    found, the DCP state dict to read into)."""
    error = checked = state = mine = None
    try:
        checked = _check_checkpoint(path, model, optimizer, verify)
        mine = {"path": argument(check_path(path, "load")),
                "optimizer": argument(None if optimizer is None else type(optimizer).__name__)}
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree_and_gather
        error = exc
    check_same("load", agree_and_gather(error, mine),
               "every rank must load the same checkpoint (a directory on a file system all ranks "
               "share), with an optimizer on every rank or on none; nothing was loaded")
    fresh = isinstance(optimizer, torch.optim.Optimizer) and not optimizer.state
    try:
        state = dcp_state(model, optimizer)  # DSD gives a fresh optimizer its (zero) state here
        check_against(checked["source"], checked["metadata"], state, model)
        check_shards(checked["source"], state, model)
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
        error = exc
    try:
        agree(error)
    except Exception:
        if fresh:
            optimizer.state.clear()  # as it was: without state
        raise
    return checked, state


def _read(source: str, state: dict) -> None:
    """DCP reads each rank's pieces of checkpoint ``source`` into ``state`` in place (metadata and
    non-tensor entries through the allow-listed unpicklers); DCP gathers the ranks' read errors."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    try:
        with single_process_quiet():
            dcp.load(state, storage_reader=SafeFileSystemReader(source), planner=WeightsOnlyLoadPlanner(),
                     no_dist=global_world_size() == 1)
    except CheckpointException as exc:
        raise RuntimeError(f"load: reading checkpoint {source} failed on rank(s) {failures(exc)}; the model "
                           f"and optimizer are partly loaded") from exc


def _agreed(action) -> None:
    """Run ``action`` on every rank; an error on any rank is raised on every rank (collective)."""
    error = None
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
        error = exc
    agree(error)


def _check_checkpoint(path, model, optimizer, verify) -> dict:
    """This rank's checks of the checkpoint at ``path``: ``{"source", "marker", "metadata", "extra"}``
    (``source``: the directory to read, see :func:`_source`)."""
    path = check_path(path, "load")
    check_model_optimizer(model, optimizer, "load")
    if not isinstance(verify, bool):
        raise TypeError(f"load: verify must be a bool, got {type(verify).__name__}")
    source, marker = _source(path)
    if optimizer is not None and not marker.get("has_optimizer", False):
        raise ValueError(f"load: checkpoint {source} has no optimizer state; pass optimizer=None")
    checksums = marker.get("checksums") if verify else None
    if verify and checksums is None:
        warnings.warn(f"load: checkpoint {source} has no checksums (it was saved by an earlier flashfsdp): its "
                      f"files are loaded unverified", stacklevel=3)
    metadata = _read_metadata(source, checksums)
    contents = _check_shard_files(source, metadata)
    extra = _read_extra(source, checksums)
    if checksums is not None:
        verify_share(source, checksums, contents, global_rank(), global_world_size())
    return {"source": source, "marker": marker, "metadata": metadata, "extra": extra}


def _source(path: str) -> tuple[str, dict]:
    """(directory, marker) of the newest complete copy of checkpoint ``path`` (itself, or what an
    interrupted save left in a hidden sibling: then with a warning naming both)."""
    found = newest_copy(path)
    if found is None:
        if not os.path.lexists(path):
            raise FileNotFoundError(f"load: checkpoint {path} does not exist")
        if not os.path.isdir(path):
            raise ValueError(f"load: {path} is a file, not a checkpoint directory")
        return path, read_marker(path)  # raises, naming what is wrong
    source, marker = found
    if source != path:
        warnings.warn(recovery_message("load", path, source, marker["step"]), stacklevel=4)
    return source, marker


def _read_bytes(path: str, name: str, checksums: dict | None, holds: str) -> bytes:
    """The bytes of file ``name`` of checkpoint ``path``, checked against its checksum (if given)."""
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        what = f"its DCP metadata file {name}" if name == METADATA else name
        raise FileNotFoundError(f"load: checkpoint {path} is missing {what}")
    with open(file, "rb") as f:
        data = f.read()
    if checksums is not None:
        if name not in checksums:
            raise ValueError(f"load: checkpoint {path} has no checksum for {name}: the marker does not belong to "
                             f"these files; load another checkpoint (or pass verify=False)")
        check("load", file, zlib.crc32(data), checksums[name], holds)
    return data


def _read_metadata(path: str, checksums: dict | None):
    """DCP's metadata of the checkpoint at ``path``, unpickled with the restricted unpickler."""
    file = os.path.join(path, METADATA)
    data = _read_bytes(path, METADATA, checksums, "DCP's metadata (the index of every entry)")
    try:
        return load_metadata(data)
    except DisallowedGlobal as exc:
        raise ValueError(f"load: checkpoint {path} has a DCP metadata file {file} that holds a disallowed global "
                         f"'{exc.name}' (only DCP's metadata classes, torch dtypes and sizes and plain containers "
                         f"may appear there): it was not unpickled and nothing from it was run; do not load a "
                         f"checkpoint from a source you do not trust") from None
    except Exception as exc:  # noqa: BLE001 - unpickling garbage raises anything
        raise ValueError(f"load: checkpoint {path} has a corrupt DCP metadata file {file} ({short(exc)}); load "
                         f"another checkpoint (latest() finds the newest complete one)") from None


def _check_shard_files(path: str, metadata) -> dict[str, list[str]]:
    """Every shard file the metadata names exists and is long enough; returns file -> its keys."""
    needed: dict[str, int] = {}
    contents: dict[str, list[str]] = {}
    for index, info in (metadata.storage_data or {}).items():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
        contents.setdefault(info.relative_path, []).append(index.fqn)
    for rel, size in sorted(needed.items()):
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"load: checkpoint {path} is missing the shard file {rel}")
        if os.path.getsize(file) < size:
            raise ValueError(f"load: shard file {file} is truncated ({os.path.getsize(file)} of {size} bytes)")
    return {rel: sorted(set(keys)) for rel, keys in contents.items()}


def _read_extra(path: str, checksums: dict | None) -> dict:
    """The ``extra`` dict stored in the checkpoint's ``extra.pt``; ValueError naming the file if corrupt."""
    file = os.path.join(path, EXTRA)
    data = _read_bytes(path, EXTRA, checksums, "the extra dict given to save")
    try:
        loaded = torch.load(io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unpickling garbage raises anything
        raise ValueError(f"load: checkpoint {path} has a corrupt {EXTRA} ({file}: {short(exc)}); nothing was "
                         f"loaded: load another checkpoint (latest() finds the newest complete one)") from None
    if not isinstance(loaded, dict) or not isinstance(loaded.get("extra"), dict):
        raise ValueError(f"load: checkpoint {path} has a corrupt {EXTRA} ({file} does not hold "
                         f"{{'extra': dict}} as save writes it); nothing was loaded")
    return loaded["extra"]
