"""``save``: a sharded checkpoint written by every rank, published atomically by rank 0."""

from __future__ import annotations

import contextlib
import io
import os
import zlib
from typing import Iterator

import torch
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException

from flashfsdp.runtime import flight
from flashfsdp.runtime.agreement import agree, agree_and_gather, global_rank, global_world_size

from . import atomic
from .arguments import argument, check_same
from .checksums import ChecksummingWriter, crc32_of_file
from .common import check_model_optimizer, dcp_state, failures, single_process_quiet
from .files import check_path
from .space import no_room
from .marker import EXTRA, MARKER, METADATA, new_marker


def save(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
         step: int, extra: dict | None = None) -> str:
    """Save a sharded checkpoint of ``model`` (and ``optimizer``) into the directory ``path``, atomically.

    Collective: every rank calls it with the same ``path`` (on a file system all ranks share),
    ``step``, ``optimizer`` (or None) and ``extra``, compared before anything is written. Each
    rank writes only its own pieces (DCP) and checksums them as it writes; see [Note: atomic
    save] and [Note: recovery] in ``flashfsdp.checkpoint.atomic`` for how a crash at any point
    leaves a complete checkpoint that ``load`` and ``latest`` find. An error on one rank (a bad
    argument, a failed write, a failed rename on rank 0) is raised on every rank. Works at W = 1
    without torch.distributed initialised.

    What is replaced: a flashfsdp checkpoint already at ``path`` (a directory holding
    :data:`~flashfsdp.checkpoint.MARKER`; the whole directory, files added to it by hand included)
    or an empty directory, only once the new checkpoint is complete. What is refused: anything else
    at ``path`` (a file, a symbolic link, a directory without the marker such as a run directory
    with logs): ``FileExistsError`` before anything is written. Hidden siblings ``.<name>.tmp`` /
    ``.<name>.old`` are this function's own scratch: what an interrupted save left there is first
    settled (its complete checkpoint moved into place), then removed.

    Args:
        path: the checkpoint directory (created; its parent too), e.g. ``<out>/checkpoints/step_<N>``.
        model: the model (fully_shard'ed or plain).
        optimizer: its optimizer, or None to save the model only.
        step: the training step, an int >= 0, returned by :func:`~flashfsdp.checkpoint.load`.
        extra: a dict stored alongside (run configuration, data position, ...) that
            ``torch.load(weights_only=True)`` can read back: containers, str, numbers, tensors.

    Returns:
        The absolute path of the checkpoint.

    Raises:
        (every error is raised on every rank; at W > 1 the message ends with the failing rank)
        TypeError / ValueError: a bad argument (the message names it); nothing is written then.
        ValueError: the ranks passed different arguments ("save: the ranks passed different
            arguments: path is '/a/x' on rank 0, '/b/x' on rank 1; ..."); nothing is written.
        FileExistsError: ``path`` holds something that is not a flashfsdp checkpoint (named);
            nothing is written.
        RuntimeError: writing failed on some rank (naming the failed ranks and their errors, DCP's
            ``CheckpointException`` as the cause); ``path`` is untouched.
        OSError: (ENOSPC, EDQUOT, EFBIG) no room for a rank's files: "No space left on device
            writing FILE", the bytes needed and free; ``path`` untouched, the scratch removed.
        OSError: rank 0 could not create, finish or rename the directory; the newest complete
            checkpoint of ``path`` is still there or in a hidden sibling, where ``load`` finds it.
    """
    with flight.operation("checkpoint.save"):  # the name its control messages carry
        path, extra_bytes, state = _checked(path, model, optimizer, step, extra)
        agree(_on_rank0(lambda: atomic.prepare(path)))
        tmp = atomic.scratch(path)[0]
        with _scratch_removed_on_error(path):
            checksums = _gather_checksums(_write(path, tmp, state))

            def finish() -> None:
                checksums[EXTRA] = zlib.crc32(extra_bytes)
                checksums[METADATA] = crc32_of_file(os.path.join(tmp, METADATA))
                marker = new_marker(step, global_world_size(), optimizer is not None, checksums)
                atomic.publish(path, {EXTRA: extra_bytes, MARKER: marker})

            agree(_on_rank0(finish))
    return path


@contextlib.contextmanager
def _scratch_removed_on_error(path: str) -> Iterator[None]:
    """When the block raises (on every rank alike: its failures are agreed), rank 0 removes the
    scratch directory of checkpoint ``path`` (``atomic.discard_scratch``: kept when complete)."""
    try:
        yield
    except BaseException:
        if global_rank() == 0:
            atomic.discard_scratch(path)
        raise


def _checked(path, model, optimizer, step, extra) -> tuple[str, bytes, dict]:
    """``save``'s arguments checked on every rank and agreed (an error on one is raised on all),
    and the same on every rank (``arguments.check_same``, in the same exchange): (absolute path,
    the serialised ``extra``, the DCP state dict)."""
    error = extra_bytes = state = mine = None
    try:
        path = check_path(path, "save")
        check_model_optimizer(model, optimizer, "save")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TypeError(f"save: step must be an int >= 0, got {step!r}")
        extra_bytes = _serialise_extra(extra)
        mine = {"path": argument(path), "step": argument(step),
                "optimizer": argument(None if optimizer is None else type(optimizer).__name__),
                "extra": argument(zlib.crc32(extra_bytes), extra or {})}
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
        error = exc
    check_same("save", agree_and_gather(error, mine),
               "every rank must call save with the same path (a directory on a file system all ranks "
               "share), step, optimizer (or None on every rank) and extra; nothing was written")
    try:  # once the ranks agree that they save the same: the state dict getters may communicate
        state = dcp_state(model, optimizer)
    except Exception as exc:  # noqa: BLE001 - raised on every rank by agree
        error = exc
    agree(error)
    return path, extra_bytes, state


def _write(path: str, tmp: str, state: dict) -> dict[str, int]:
    """Every rank writes its pieces into the scratch directory ``tmp`` (DCP); returns the CRC-32 of
    each shard file this rank wrote. DCP gathers the ranks' write errors: raised on every rank."""
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    writer = ChecksummingWriter(tmp)
    try:
        with single_process_quiet():
            dcp.save(state, storage_writer=writer, no_dist=global_world_size() == 1)
    except CheckpointException as exc:  # a BaseException: make it an ordinary, readable error
        message = (f"save: writing checkpoint {path} failed on rank(s) {failures(exc)}; the checkpoints "
                   f"already in {os.path.dirname(path)} are intact")
        full = next((e for e in (no_room(err[0]) for err in exc.failures.values()) if e is not None), None)
        if full is None:
            raise RuntimeError(message) from exc
        # every rank is here (DCP raised the same failures on all): what the whole checkpoint needs
        needed = agree_and_gather(None, writer.needed)
        total = f" (all ranks together: {sum(needed)} bytes)" if None not in needed and len(needed) > 1 else ""
        raise OSError(full.errno, message + total) from exc
    return writer.checksums


def _on_rank0(action) -> Exception | None:
    """Run ``action`` on rank 0 only; the exception it raised (for :func:`agree`), else None."""
    if global_rank() != 0:
        return None
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - every rank raises it (agree)
        return exc
    return None


def _gather_checksums(mine: dict[str, int]) -> dict[str, int]:
    """Collective (on the control group): every rank's shard-file checksums merged (all of them on
    every rank)."""
    return {name: crc for ranks in agree_and_gather(None, mine) for name, crc in ranks.items()}


def _serialise_extra(extra) -> bytes:
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
