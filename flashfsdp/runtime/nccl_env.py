"""What ``NcclCommunicator`` needs from its environment, as functions a CPU machine can test: CuPy
with NCCL, CuPy and torch built for the same CUDA major version, and the NCCL unique id as bytes.

[Note: the unique id's bytes]
``ncclUniqueId`` is ``char internal[128]``. CuPy 14 and later take and return it as 128 ``bytes``
(``NcclCommunicator(int ndev, bytes commId, int rank)``). Earlier CuPy returns it from
``get_unique_id()`` as a tuple of Python ints of C ``char``, and its
``NcclCommunicator(n, uid, rank)`` converts each int back to ``char``: -128..127 where ``char`` is
signed (x86-64 Linux, macOS, Windows), 0..255 where it is unsigned (Linux on aarch64 such as GH200,
32-bit ARM, POWER, s390x), and an int outside that range raises ``OverflowError``. The id travels
through the torch.distributed store as 128 plain bytes (each value masked to 0..255,
:func:`unique_id_to_bytes`, which takes either form), and each rank hands its CuPy the form it
takes (:func:`create_communicator`: the bytes, else the ints in its platform's range,
:func:`unique_id_from_bytes`), so ranks on different architectures and CuPy releases agree.
"""

from __future__ import annotations

import importlib.metadata
import platform
import re
from typing import Callable, Sequence

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES in nccl.h
# Linux ABIs whose C `char` is unsigned (the psABIs of these architectures).
_UNSIGNED_CHAR_MACHINES = ("aarch64", "arm64", "armv7l", "armv6l", "ppc64le", "ppc64", "s390x")
_EXTRAS = {12: "cuda12", 13: "cuda13"}  # setup.py's extras_require


def unique_id_to_bytes(uid: Sequence[int]) -> bytes:
    """CuPy's unique id (128 ints of C ``char``, signed or not) as 128 bytes for the store.

    Raises:
        ValueError: ``uid`` does not have 128 entries, or an entry is outside -128..255.
    """
    if len(uid) != UNIQUE_ID_BYTES:
        raise ValueError(f"NCCL unique id: expected {UNIQUE_ID_BYTES} values from get_unique_id(), got {len(uid)}")
    if any(not -128 <= b <= 255 for b in uid):
        raise ValueError("NCCL unique id: every value must be a C char (-128..255)")
    return bytes(b & 0xFF for b in uid)


def unique_id_from_bytes(raw: bytes, char_signed: bool) -> tuple[int, ...]:
    """The 128 bytes from the store as the ints CuPy's ``NcclCommunicator`` takes on a platform
    whose C ``char`` is signed (-128..127) or not (0..255); see [Note: the unique id's bytes].

    Raises:
        ValueError: ``raw`` is not 128 bytes long (a store key shared with something else).
    """
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"NCCL unique id: expected {UNIQUE_ID_BYTES} bytes from the store, got {len(raw)}")
    return tuple(b - 256 if char_signed and b >= 128 else b for b in raw)


def create_communicator(constructor: Callable, world_size: int, raw: bytes, rank: int):
    """``constructor(world_size, uid, rank)`` (CuPy's ``NcclCommunicator``) with the unique id
    ``raw`` (128 bytes from the store) in the form this CuPy takes: ``bytes`` (CuPy >= 14), else
    the tuple of C ``char`` ints for this platform, else for the other signedness (see
    [Note: the unique id's bytes]). A form the constructor refuses is refused by its argument
    conversion (``TypeError`` / ``OverflowError``), before NCCL is initialised, so the next form
    can be tried.

    Raises:
        ValueError: ``raw`` is not 128 bytes long.
        TypeError, OverflowError: the constructor refuses every form (the last refusal).
    """
    if len(raw) != UNIQUE_ID_BYTES:
        raise ValueError(f"NCCL unique id: expected {UNIQUE_ID_BYTES} bytes from the store, got {len(raw)}")
    signed = char_is_signed()
    forms = (bytes(raw), unique_id_from_bytes(raw, signed), unique_id_from_bytes(raw, not signed))
    for form in forms[:-1]:
        try:
            return constructor(world_size, form, rank)
        except (TypeError, OverflowError):
            continue
    return constructor(world_size, forms[-1], rank)


def char_is_signed(machine: str | None = None, system: str | None = None) -> bool:
    """Whether C ``char`` is signed on ``machine`` / ``system`` (default: this one's
    ``platform.machine()`` / ``platform.system()``): unsigned on Linux for aarch64, ARM, POWER and
    s390x, signed elsewhere (x86, and Apple's and Microsoft's ARM ABIs)."""
    machine = (machine if machine is not None else platform.machine()).lower()
    system = system if system is not None else platform.system()
    return not (system == "Linux" and machine in _UNSIGNED_CHAR_MACHINES)


def cuda_major(version: str | int | None) -> int | None:
    """The CUDA major version of ``"13.0"`` (``torch.version.cuda``), ``12040`` (a CUDA runtime's
    ``cudaRuntimeGetVersion``: 1000·major + 10·minor) or ``"cupy-cuda12x"`` (a CuPy wheel's name);
    None for None or a string without one."""
    if version is None:
        return None
    if isinstance(version, int):
        return version // 1000
    match = re.search(r"cuda(\d+)", version) or re.match(r"(\d+)", version)
    return int(match.group(1)) if match else None


def cupy_cuda_major() -> int | None:
    """The CUDA major version the installed CuPy wheel was built for, from its distribution name
    (``cupy-cuda12x`` -> 12); None without a CuPy wheel whose name says it (a source build)."""
    for name in importlib.metadata.packages_distributions().get("cupy", []):
        major = cuda_major(name.lower())
        if major is not None:
            return major
    return None


def check_cuda_match(cupy_major: int | None, torch_cuda: str | None) -> None:
    """Refuse a CuPy built for another CUDA major version than torch (two CUDA runtimes, and two
    NCCLs, in one process: NCCL through CuPy then fails or hangs at its first collective).

    Args:
        cupy_major: CuPy's CUDA major version (:func:`cupy_cuda_major`); None: unknown, not checked.
        torch_cuda: ``torch.version.cuda`` (e.g. ``"13.0"``); None: a CPU build, not checked.

    Raises:
        RuntimeError: the majors differ; the message names the extra (or the CuPy wheel) to install.
    """
    torch_major = cuda_major(torch_cuda)
    if cupy_major is None or torch_major is None or cupy_major == torch_major:
        return
    extra = _EXTRAS.get(torch_major)
    fix = (f"pip install 'flashfsdp[{extra}]'" if extra is not None else f"pip install cupy-cuda{torch_major}x")
    raise RuntimeError(
        f"NcclCommunicator: CuPy is built for CUDA {cupy_major} (cupy-cuda{cupy_major}x) but torch for CUDA "
        f"{torch_cuda}; uninstall cupy-cuda{cupy_major}x and {fix}, or use communicator='process_group' "
        f"(torch's own NCCL)"
    )


def import_nccl():
    """``cupy.cuda.nccl``, after checking CuPy's CUDA major version against torch's.

    Raises:
        RuntimeError: CuPy missing or failing to load, built for another CUDA than torch, or built
            without NCCL; each message says what to install.
    """
    import torch  # noqa: PLC0415

    check_cuda_match(cupy_cuda_major(), torch.version.cuda)
    try:
        from cupy.cuda import nccl  # noqa: PLC0415
    except Exception as exc:  # ImportError, or CuPy failing to find a CUDA driver
        raise RuntimeError(
            "NcclCommunicator needs CuPy built with NCCL: install flashfsdp with the extra that "
            "matches your CUDA (pip install 'flashfsdp[cuda12]' or 'flashfsdp[cuda13]'); "
            f"importing cupy.cuda.nccl failed with: {exc}"
        ) from exc
    if not getattr(nccl, "available", True):
        raise RuntimeError("NcclCommunicator: CuPy was built without NCCL; install nvidia-nccl-cu12/cu13")
    return nccl
