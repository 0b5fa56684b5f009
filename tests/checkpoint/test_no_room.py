"""flashfsdp.checkpoint.save that finds no room, at W = 2, on real files: the error is the
``OSError`` of the write that failed, on both ranks, naming the file and the bytes the save
needed (not torch's "enforce fail at inline_container.cc ... unexpected pos"); the checkpoint it
was replacing still loads, the scratch is gone, and a save with room succeeds.

Two real ways to run out of room without filling the machine's disk:

- a file size limit: rank 1 lowers its own ``RLIMIT_FSIZE`` (``ulimit -f``) below its shard
  file's size, so the kernel refuses its writes with EFBIG ("File too large"); runs everywhere.
- a full file system: a 64 MiB tmpfs mounted in a user and mount namespace of its own
  (``unshare -rm``, no privilege needed where the kernel allows unprivileged user namespaces),
  filled with ballast until it has half a checkpoint free: the writes fail with ENOSPC ("No space
  left on device"). Skipped where ``unshare -rm`` is not allowed.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import flashfsdp
from flashfsdp import checkpoint
from tests.checkpoint.common import assert_values, local_values
from tests.harness import run_distributed

TIMEOUT_S = 240  # generous for process start-up on a busy machine; a hang never ends
LIMIT = 16 << 10  # rank 1's file size limit: below its shard file (about 100 KiB), above the rest


def _model(seed: int = 0) -> nn.Module:
    """Two 128 x 128 layers, each a unit: 128 KiB of fp32 parameters (and twice that of AdamW
    state), so a rank's shard file is about 200 KiB."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(128, 128), nn.Linear(128, 128))
    for unit in (*model, model):
        flashfsdp.fully_shard(unit)
    return model


def _trained(seed: int = 0):
    model = _model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 128)).sum().backward()
    opt.step()
    return model, opt


def _outcome(action) -> dict | None:
    try:
        action()
    except Exception as exc:  # noqa: BLE001 - the test compares what every rank raised
        return {"type": type(exc).__name__, "errno": getattr(exc, "errno", None), "message": str(exc)}
    return None


def _replace_and_check(path: str, before_second_save) -> dict:
    """Save step 1 at ``path``; ``before_second_save()`` takes the room away; save step 2 over it
    (its outcome); load what is at ``path``; give the room back; save step 2 again."""
    model, opt = _trained()
    checkpoint.save(path, model, opt, step=1)
    saved = local_values(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    undo = before_second_save()
    failed = _outcome(lambda: checkpoint.save(path, model, opt, step=2))
    torch.distributed.barrier()  # rank 0 has removed the scratch
    left = sorted(os.listdir(os.path.dirname(path)))
    fresh = _model(seed=5)
    step = checkpoint.load(path, fresh, torch.optim.AdamW(fresh.parameters(), lr=0.1))["step"]
    assert_values(fresh, saved)
    undo()
    again = checkpoint.save(path, model, opt, step=2)
    return {"failed": failed, "left": left, "loaded_step": step, "again": checkpoint.latest(os.path.dirname(again))}


def _file_size_limit(rank: int, world_size: int, out: str) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)

    def limit():
        if rank == 1:  # a write past the limit fails with EFBIG instead of killing the process
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (LIMIT, hard))
        return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    return _replace_and_check(os.path.join(out, "ckpt"), limit)


def test_a_file_size_limit_is_named_with_the_file_and_the_bytes_needed(tmp_path):
    results = run_distributed(_file_size_limit, 2, str(tmp_path), timeout=TIMEOUT_S)
    shard = tmp_path / ".ckpt.tmp" / "__1_0.distcp"
    for result in results:
        failed = result["failed"]
        assert failed is not None and failed["type"] == "OSError" and failed["errno"] == errno.EFBIG, failed
        message = failed["message"]
        assert f"save: writing checkpoint {tmp_path / 'ckpt'} failed on rank(s) 1: OSError: [Errno 27] File too " \
               f"large writing {shard}: this rank's part of the checkpoint needs " in message, message
        assert f"may write files of at most {LIMIT} bytes (16.0 KiB) (its file size limit" in message, message
        assert "unexpected pos" not in message
        assert result["left"] == ["ckpt"]  # the scratch removed, the checkpoint kept
        assert result["loaded_step"] == 1 and result["again"].endswith("ckpt")


def _full_file_system(rank: int, world_size: int, mount: str) -> dict:
    ballast = os.path.join(mount, "ballast")

    def fill():
        if rank == 0:  # leave half of one checkpoint free
            size = sum(e.stat().st_size for e in os.scandir(os.path.join(mount, "ckpt")))
            stat = os.statvfs(mount)
            with open(ballast, "wb") as fh:
                fh.write(b"\0" * (stat.f_bavail * stat.f_frsize - size // 2))
        torch.distributed.barrier()

        def undo():
            if rank == 0:
                os.remove(ballast)
            torch.distributed.barrier()
        return undo

    return _replace_and_check(os.path.join(mount, "ckpt"), fill)


def in_namespace(mount: str) -> None:
    """Run in ``unshare -rm``: mount a 64 MiB tmpfs at ``mount``, run the scenario on 2 ranks (the
    ranks inherit the mount namespace), and print each rank's result."""
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", mount], check=True)
    print(json.dumps(run_distributed(_full_file_system, 2, mount, timeout=TIMEOUT_S)))


def _unshare_allowed() -> bool:
    unshare = shutil.which("unshare")
    return unshare is not None and subprocess.run([unshare, "-rm", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _unshare_allowed(), reason="unprivileged user and mount namespaces (unshare -rm) are "
                                                   "not allowed here: no tmpfs to fill")
def test_a_full_file_system_says_no_space_left_with_the_file_and_the_bytes_needed(tmp_path):
    mount = tmp_path / "small"
    mount.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), env.get("PYTHONPATH")) if p)
    code = f"from tests.checkpoint.test_no_room import in_namespace; in_namespace({str(mount)!r})"
    done = subprocess.run(["unshare", "-rm", sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=TIMEOUT_S + 60)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for result in results:
        failed = result["failed"]
        assert failed is not None and failed["type"] == "OSError" and failed["errno"] == errno.ENOSPC, failed
        message = failed["message"]
        assert f"save: writing checkpoint {mount / 'ckpt'} failed on rank(s) " in message, message
        assert f"No space left on device writing {mount / '.ckpt.tmp'}/__" in message, message
        assert "this rank's part of the checkpoint needs " in message and " were free on its file system" in message
        assert "all ranks together: " in message and "unexpected pos" not in message
        assert result["left"] == ["ballast", "ckpt"]
        assert result["loaded_step"] == 1 and result["again"].endswith("ckpt")
