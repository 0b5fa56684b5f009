"""Checkpoints of a fully_shard'ed model (and optimizer) with torch.distributed.checkpoint (DCP).

``save(path, model, optimizer, step=N, extra={...})`` writes a DCP checkpoint of the sharded model
state dict and optimizer state (each rank writes only its pieces), ``load(path, model, optimizer)``
reads it back at any world size, ``latest(out_dir)`` finds the newest complete one. Layout of a
checkpoint directory::

    path/
      .metadata, __<rank>_0.distcp   DCP: keys "model.<name>", "optim.state.<name>.<key>", ...
      extra.pt                       torch.save({"extra": extra}) by rank 0
      flashfsdp.json                 the completion marker, written last: step, world size, time

[Note: atomic save]
Every rank writes into the hidden sibling ``.<name>.tmp``; when all have finished (DCP gathers
every rank's write result before writing ``.metadata``), rank 0 writes ``extra.pt`` and then the
marker, every rank checks in (an all-gather of errors doubles as the barrier), and rank 0 renames
the directory into place (an older checkpoint of the same name is moved aside first and deleted
after). A crash before the rename leaves only the hidden temporary directory, which ``latest``
ignores and the next save of that name removes; the previous checkpoints stay intact. Only a
flashfsdp checkpoint (a directory holding the marker) or an empty directory is ever replaced:
``save`` refuses any other file or directory at ``path`` before writing anything.

[Note: load is all-or-nothing up to the shard files]
``load`` reads and checks everything small first, on every rank: the marker, DCP's ``.metadata``
(unpickled), that every shard file it names exists and is long enough, ``extra.pt`` (unpickled),
and every model and optimizer entry's name and shape against the checkpoint. Only then does DCP
read the shard files straight into the model's sharded storage and the optimizer's state. So any
error but a failure while reading the shard files leaves the model and optimizer as they were
(an optimizer without state, whose state DSD creates to describe it, is emptied again).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import time
import warnings
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from flashfsdp.bindings.agreement import agree, global_rank, global_world_size
from flashfsdp.bindings.optim_state_dict import get_optimizer_state_dict, set_optimizer_state_dict

MARKER = "flashfsdp.json"
EXTRA = "extra.pt"
FORMAT = "flashfsdp-checkpoint"
VERSION = 1

__all__ = ["save", "load", "latest", "MARKER"]


def _check_path(path: Any, where: str) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{where}: path must be a str or os.PathLike, got {type(path).__name__}")
    path = os.path.abspath(os.fspath(path))
    if os.path.basename(path) in ("", ".", ".."):
        raise ValueError(f"{where}: path {path!r} must name a directory (e.g. <out>/checkpoints/step_<N>)")
    return path


def _check_model_optimizer(model: Any, optimizer: Any, where: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{where}: model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{where}: optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")


def _state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """What DCP saves and loads: the sharded model state dict and the sharded optimizer state."""
    state: dict[str, Any] = {"model": model.state_dict()}
    if optimizer is not None:
        state["optim"] = get_optimizer_state_dict(model, optimizer)
    return state


@contextlib.contextmanager
def _single_process_quiet():
    """Silence DCP's warning that it runs in a single process: W = 1 without a process group is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def _serialise_extra(extra: Any) -> bytes:
    """torch.save bytes of ``{"extra": extra}``; raises unless torch.load(weights_only=True) reads them."""
    if extra is not None and not isinstance(extra, dict):
        raise TypeError(f"save: extra must be a dict or None, got {type(extra).__name__}")
    buf = io.BytesIO()
    try:
        torch.save({"extra": extra or {}}, buf)
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means the value is not storable
        raise ValueError(
            f"save: extra must hold only what torch.load(weights_only=True) reads back (dicts, lists, str, "
            f"numbers, bools, None, tensors); it failed with: {exc}"
        ) from None
    return buf.getvalue()


def _write_file(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` durably (temporary file, fsync, rename)."""
    tmp = f"{path}.part"
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: str) -> None:
    """Make a rename inside ``path`` durable (best effort: not every file system allows it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _refuse_to_replace(path: str) -> None:
    """Raise FileExistsError unless ``path`` is free, a flashfsdp checkpoint or an empty directory."""
    if not os.path.lexists(path):
        return
    if os.path.islink(path):
        what = "a symbolic link"
    elif not os.path.isdir(path):
        what = "a file"
    elif os.path.isfile(os.path.join(path, MARKER)) or not os.listdir(path):
        return
    else:
        what = f"a directory that is not a flashfsdp checkpoint (it has no {MARKER})"
    raise FileExistsError(f"save: {path} exists and is {what}; save replaces only a flashfsdp checkpoint, so "
                          f"nothing was written: choose another path (e.g. <out>/checkpoints/step_<N>) or move it away")


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         step: int, extra: dict | None = None) -> str:
    """Save a sharded checkpoint of ``model`` (and ``optimizer``) into the directory ``path``, atomically.

    Collective: every rank calls it with the same ``path`` on a file system all ranks share. Each
    rank writes only its own pieces (DCP); see [Note: atomic save] for how a crash leaves the
    earlier checkpoints intact. Works at W = 1 without torch.distributed initialised.

    What is replaced: a flashfsdp checkpoint already at ``path`` (a directory holding
    :data:`MARKER`; the whole directory, files added to it by hand included) or an empty
    directory, only once the new checkpoint is complete. What is refused: anything else at
    ``path`` (a file, a symbolic link, a directory without the marker such as a run directory with
    logs): ``FileExistsError`` before anything is written. Hidden siblings ``.<name>.tmp`` /
    ``.<name>.old`` are this function's own scratch and are removed.

    Args:
        path: the checkpoint directory (created; its parent too), e.g. ``<out>/checkpoints/step_<N>``.
        model: the model (fully_shard'ed or plain).
        optimizer: its optimizer, or None to save the model only.
        step: the training step, an int >= 0, returned by :func:`load`.
        extra: a dict stored alongside (run configuration, data position, ...) that
            ``torch.load(weights_only=True)`` can read back: containers, str, numbers, tensors.

    Returns:
        The absolute path of the checkpoint.

    Raises:
        TypeError / ValueError: a bad argument (the message names it); nothing is written then.
        FileExistsError: ``path`` holds something that is not a flashfsdp checkpoint (named);
            nothing is written (raised on every rank).
        RuntimeError: writing failed on some rank (raised on every rank, naming the failed ranks and
            their errors, DCP's ``CheckpointException`` as the cause); ``path`` is untouched.
        OSError: rank 0 could not create, finish or rename the directory (raised on every rank);
            ``path`` holds the old checkpoint or, if the failure came between the two renames, the
            old one is in ``.<name>.old``.
    """
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    path = _check_path(path, "save")
    _check_model_optimizer(model, optimizer, "save")
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise TypeError(f"save: step must be an int >= 0, got {step!r}")
    extra_bytes = _serialise_extra(extra)
    parent, name = os.path.split(path)
    tmp, old = os.path.join(parent, f".{name}.tmp"), os.path.join(parent, f".{name}.old")
    agree(_on_rank0(lambda: _prepare_tmp(path, parent, tmp)))
    state = _state(model, optimizer)
    try:
        with _single_process_quiet():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp), no_dist=global_world_size() == 1)
    except CheckpointException as exc:  # a BaseException: make it an ordinary, readable error
        raise RuntimeError(f"save: writing checkpoint {path} failed on rank(s) {_failures(exc)}; the "
                           f"checkpoints already in {parent} are intact") from exc
    marker = {"format": FORMAT, "version": VERSION, "step": step, "world_size": global_world_size(),
              "has_optimizer": optimizer is not None, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    agree(_on_rank0(lambda: _finish_tmp(path, parent, tmp, old, marker, extra_bytes)))
    return path


def _on_rank0(action) -> OSError | None:
    """Run ``action`` on rank 0 only; the OSError it raised (for :func:`agree`), else None."""
    if global_rank() != 0:
        return None
    try:
        action()
    except OSError as exc:
        return exc
    return None


def _prepare_tmp(path: str, parent: str, tmp: str) -> None:
    """Rank 0, before writing: refuse to replace a non-checkpoint, make a fresh ``tmp``."""
    _refuse_to_replace(path)
    os.makedirs(parent, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)


def _finish_tmp(path: str, parent: str, tmp: str, old: str, marker: dict, extra_bytes: bytes) -> None:
    """Rank 0, after every rank wrote: ``extra.pt`` and the marker into ``tmp``, then the two
    renames of [Note: atomic save] (the old checkpoint aside, the new one in place)."""
    _write_file(os.path.join(tmp, EXTRA), extra_bytes)
    _write_file(os.path.join(tmp, MARKER), json.dumps(marker, indent=1).encode())
    _refuse_to_replace(path)  # again: something may have appeared there meanwhile
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(parent)
    shutil.rmtree(old, ignore_errors=True)


def _failures(exc: CheckpointException) -> str:
    """"rank: ExceptionType: message" of every rank that failed inside DCP."""
    return "; ".join(f"{rank}: {type(err[0]).__name__}: {err[0]}" for rank, err in sorted(exc.failures.items()))


def _read_marker(path: str) -> dict:
    marker_path = os.path.join(path, MARKER)
    if not os.path.isfile(marker_path):
        raise ValueError(f"load: {path} is not a complete flashfsdp checkpoint: {MARKER} is missing (the save "
                         f"did not finish, or this is not a checkpoint directory); use latest() to find a complete one")
    try:
        with open(marker_path) as f:
            marker = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"load: {marker_path} is unreadable ({exc})") from None
    if not isinstance(marker, dict) or marker.get("format") != FORMAT or not isinstance(marker.get("step"), int):
        raise ValueError(f"load: {marker_path} is not a flashfsdp checkpoint marker")
    return marker


def _check_files(path: str):
    """DCP's metadata of the checkpoint at ``path``, after checking that every file it names exists."""
    from torch.distributed.checkpoint import FileSystemReader  # noqa: PLC0415

    from torch.distributed.checkpoint.metadata import Metadata  # noqa: PLC0415

    metadata_file = os.path.join(path, ".metadata")
    if not os.path.isfile(metadata_file):
        raise FileNotFoundError(f"load: checkpoint {path} is missing its DCP metadata file .metadata")
    try:
        metadata = FileSystemReader(path).read_metadata()
    except Exception as exc:  # noqa: BLE001 - unpickling garbage raises anything
        raise ValueError(f"load: checkpoint {path} has a corrupt DCP metadata file {metadata_file} "
                         f"({_short(exc)}); load another checkpoint (latest() finds the newest complete one)") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(f"load: checkpoint {path} has a corrupt DCP metadata file {metadata_file} (it holds a "
                         f"{type(metadata).__name__}, not DCP Metadata)")
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for rel, size in sorted(needed.items()):
        file = os.path.join(path, rel)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"load: checkpoint {path} is missing the shard file {rel}")
        if os.path.getsize(file) < size:
            raise ValueError(f"load: shard file {file} is truncated ({os.path.getsize(file)} of {size} bytes)")
    if not os.path.isfile(os.path.join(path, EXTRA)):
        raise FileNotFoundError(f"load: checkpoint {path} is missing {EXTRA}")
    return metadata


def _short(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 200 characters) of an exception."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:200] if lines else ''}".rstrip(": ")


def _read_extra(path: str) -> dict:
    """The ``extra`` dict stored in the checkpoint's ``extra.pt``; ValueError naming the file if corrupt."""
    file = os.path.join(path, EXTRA)
    try:
        data = torch.load(file, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - unpickling garbage raises anything
        raise ValueError(f"load: checkpoint {path} has a corrupt {EXTRA} ({file}: {_short(exc)}); nothing was "
                         f"loaded: load another checkpoint (latest() finds the newest complete one)") from None
    if not isinstance(data, dict) or not isinstance(data.get("extra"), dict):
        raise ValueError(f"load: checkpoint {path} has a corrupt {EXTRA} ({file} does not hold "
                         f"{{'extra': dict}} as save writes it); nothing was loaded")
    return data["extra"]


def _describe(key: str, kinds: dict[str, str]) -> str:
    """What the flattened DCP key ``key`` is, in words (``kinds``: model key -> "parameter"/"buffer")."""
    if key.startswith("model."):
        name = key[len("model."):]
        return f"{kinds.get(name, 'model entry')} '{name}'"
    if key.startswith("optim.state."):
        name, _, entry = key[len("optim.state."):].rpartition(".")
        return f"optimizer state '{entry}' of parameter '{name}'"
    if key.startswith("optim.param_groups."):
        group, _, hyper = key[len("optim.param_groups."):].partition(".")
        return f"optimizer hyperparameter '{hyper}' of param group {group}"
    return f"entry '{key}'"


def _why_missing(key: str, saved) -> str:
    if key.startswith("model."):
        return "it was saved from another model"
    if key.startswith("optim.param_groups."):
        groups = {k.split(".")[2] for k in saved if k.startswith("optim.param_groups.")}
        return (f"it was saved with another optimizer type or another number of param groups (the checkpoint "
                f"has {len(groups)})")
    return "it was saved with another optimizer type or from another model"


def _check_against(path: str, metadata, state: dict[str, Any], model: nn.Module) -> None:
    """Every tensor the model/optimizer expects is in the checkpoint with the same shape, and back."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict  # noqa: PLC0415
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: PLC0415

    kinds = {name: "buffer" for name, _ in model.named_buffers(remove_duplicate=False)}
    kinds.update((name, "parameter") for name, _ in model.named_parameters(remove_duplicate=False))
    saved = metadata.state_dict_metadata
    flat, _ = flatten_state_dict(state)
    for key, value in flat.items():
        what = _describe(key, kinds)
        if key not in saved:
            raise ValueError(f"load: checkpoint {path} has no entry for {what}; {_why_missing(key, saved)}")
        md = saved[key]
        if isinstance(value, torch.Tensor) and isinstance(md, TensorStorageMetadata) and md.size != value.shape:
            raise ValueError(f"load: {what} has shape {tuple(md.size)} in checkpoint {path} but "
                             f"{tuple(value.shape)} in the model; load it into the model it was saved from")
    extra_keys = sorted(k[len("model."):] for k in saved if k.startswith("model.") and k not in flat)
    if extra_keys:
        raise ValueError(f"load: checkpoint {path} has model key(s) {extra_keys[:5]}"
                         f"{' ...' if len(extra_keys) > 5 else ''} (parameters or buffers) that the model does "
                         f"not have; load it into the model it was saved from")


def load(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load a checkpoint written by :func:`save` into ``model`` (and ``optimizer``), at any world size.

    Collective. The checkpoint is checked first on every rank (marker, DCP metadata, every shard
    file, ``extra.pt``, every parameter's name and shape), then DCP reads each rank's pieces straight
    into the sharded parameters and optimizer state (resharding as needed), and
    ``model.load_state_dict`` / :func:`~flashfsdp.bindings.optim_state_dict.set_optimizer_state_dict`
    finish the load (optimizer hyperparameters such as ``lr`` and the param groups come from the
    checkpoint). Works at W = 1 without torch.distributed initialised.

    Args:
        path: a checkpoint directory written by :func:`save`.
        model: the same model architecture, fully_shard'ed at any world size (or plain).
        optimizer: the same optimizer type (and param groups) over ``model``'s parameters, or None to
            load the model only.

    Returns:
        ``{"step": int, "extra": dict}`` as given to :func:`save`.

    Raises:
        (every error is raised on every rank)
        FileNotFoundError: ``path`` does not exist, or a file of the checkpoint is missing (named).
        ValueError: ``path`` is not a complete checkpoint (no marker: the save did not finish); its
            marker, ``.metadata`` or ``extra.pt`` is corrupt (the file is named); a shard file is
            truncated; it has no optimizer state but ``optimizer`` was given; a parameter, buffer,
            optimizer state or hyperparameter is missing or has another shape (named).
        TypeError: a bad argument type.
        RuntimeError: DCP failed to read a shard file on some rank (names the ranks and errors);
            the model and optimizer are then partly loaded (load a good checkpoint before training
            on). On every other error they are unchanged ([Note: load is all-or-nothing ...]).
    """
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    path = _check_path(path, "load")
    _check_model_optimizer(model, optimizer, "load")
    marker, metadata, extra = _read_small_files(path, optimizer)
    fresh = optimizer is not None and not optimizer.state
    state = _state(model, optimizer)  # DSD gives a fresh optimizer its (zero) state here
    error = None
    try:
        _check_against(path, metadata, state, model)
    except ValueError as exc:
        error = exc
    try:
        agree(error)
    except ValueError:
        if fresh:
            optimizer.state.clear()  # as it was: without state
        raise
    try:
        with _single_process_quiet():
            dcp.load(state, storage_reader=dcp.FileSystemReader(path), no_dist=global_world_size() == 1)
    except CheckpointException as exc:
        raise RuntimeError(f"load: reading checkpoint {path} failed on rank(s) {_failures(exc)}; the model "
                           f"and optimizer are partly loaded") from exc
    model.load_state_dict(state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"])
    return {"step": marker["step"], "extra": extra}


def _read_small_files(path: str, optimizer) -> tuple[dict, object, dict]:
    """(marker, DCP metadata, extra) of the checkpoint at ``path``, every small file read and
    checked before anything is touched; an error on any rank is raised on every rank."""
    error = marker = metadata = extra = None
    try:
        if not os.path.exists(path):
            raise FileNotFoundError(f"load: checkpoint {path} does not exist")
        if not os.path.isdir(path):
            raise ValueError(f"load: {path} is a file, not a checkpoint directory")
        marker = _read_marker(path)
        if optimizer is not None and not marker.get("has_optimizer", False):
            raise ValueError(f"load: checkpoint {path} has no optimizer state; pass optimizer=None")
        metadata = _check_files(path)
        extra = _read_extra(path)
    except (FileNotFoundError, ValueError) as exc:
        error = exc
    agree(error)
    return marker, metadata, extra


def latest(out_dir: str | os.PathLike) -> str | None:
    """The newest complete checkpoint directly under ``out_dir``, or None.

    Complete means the marker :data:`MARKER` is there (hidden temporary directories of saves in
    progress or crashed are skipped). Newest is the highest saved ``step``, then the latest
    modification time. Local, no communication.

    Args:
        out_dir: the directory holding checkpoint directories (e.g. ``<out>/checkpoints``); a missing
            directory has none.

    Raises:
        TypeError: ``out_dir`` is not a str or os.PathLike.
        NotADirectoryError: ``out_dir`` exists but is a file.
    """
    if not isinstance(out_dir, (str, os.PathLike)):
        raise TypeError(f"latest: out_dir must be a str or os.PathLike, got {type(out_dir).__name__}")
    out_dir = os.path.abspath(os.fspath(out_dir))
    if not os.path.exists(out_dir):
        return None
    if not os.path.isdir(out_dir):
        raise NotADirectoryError(f"latest: out_dir {out_dir} is a file, not a directory")
    best, best_key = None, None
    for entry in os.scandir(out_dir):
        if entry.name.startswith(".") or not entry.is_dir():
            continue
        try:
            marker = _read_marker(entry.path)
        except ValueError:
            continue
        key = (marker["step"], os.path.getmtime(os.path.join(entry.path, MARKER)))
        if best_key is None or key > best_key:
            best, best_key = entry.path, key
    return best
