"""NcclCommunicator's CPU-checkable parts: the unique id's bytes, the CUDA version check, the
watchdog's deadlines and abort, and naming the unit (teardown with the group:
tests/runtime/test_communicators.py)."""

from __future__ import annotations

import random
import threading
import time

import pytest

from flashfsdp.runtime import nccl, trace
from flashfsdp.runtime.communicator import CompletedWork
from flashfsdp.runtime.nccl_env import (create_communicator, UNIQUE_ID_BYTES, char_is_signed, check_cuda_match, cuda_major,
                                        unique_id_from_bytes, unique_id_to_bytes)
from flashfsdp.runtime.nccl_watchdog import CollectiveError, CollectiveTimeout, Watchdog


# ------------------------------------------------------------------ unique id
def _uid(signed: bool, seed: int = 0) -> tuple[int, ...]:
    rng = random.Random(seed)
    low, high = (-128, 127) if signed else (0, 255)
    return tuple([low, high, 0, -1 if signed else 255] + [rng.randint(low, high) for _ in range(UNIQUE_ID_BYTES - 4)])


@pytest.mark.parametrize("signed", [True, False], ids=["signed-char", "unsigned-char"])
def test_unique_id_round_trips_through_bytes(signed):
    uid = _uid(signed)
    raw = unique_id_to_bytes(uid)
    assert isinstance(raw, bytes) and len(raw) == UNIQUE_ID_BYTES
    assert unique_id_from_bytes(raw, char_signed=signed) == uid


def test_unique_id_from_x86_reaches_aarch64_as_the_same_bytes():
    """Rank 0 on x86 (signed char) and a rank on GH200 (aarch64, unsigned char) agree byte for byte."""
    uid = _uid(signed=True, seed=3)
    on_aarch64 = unique_id_from_bytes(unique_id_to_bytes(uid), char_signed=False)
    assert all(0 <= b <= 255 for b in on_aarch64)
    assert on_aarch64 == tuple(b & 0xFF for b in uid)
    assert unique_id_from_bytes(unique_id_to_bytes(on_aarch64), char_signed=True) == uid


def test_unique_id_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="expected 128 values"):
        unique_id_to_bytes((1, 2, 3))
    with pytest.raises(ValueError, match="expected 128 bytes from the store"):
        unique_id_from_bytes(b"\x00" * 127, char_signed=True)
    with pytest.raises(ValueError, match="C char"):
        unique_id_to_bytes((300,) + (0,) * 127)


@pytest.mark.parametrize("machine,system,signed", [
    ("x86_64", "Linux", True), ("aarch64", "Linux", False), ("ppc64le", "Linux", False),
    ("arm64", "Darwin", True), ("AMD64", "Windows", True),
])
def test_char_signedness_per_platform(machine, system, signed):
    assert char_is_signed(machine, system) is signed


# ------------------------------------------------------------------ CUDA versions
@pytest.mark.parametrize("version,major", [("13.0", 13), ("12.4", 12), (12040, 12), (13000, 13),
                                           ("cupy-cuda12x", 12), ("cupy-cuda13x", 13), (None, None), ("rocm", None)])
def test_cuda_major(version, major):
    assert cuda_major(version) == major


def test_cupy_for_another_cuda_names_the_extra_to_install():
    with pytest.raises(RuntimeError, match=r"CuPy is built for CUDA 12.*torch for CUDA 13.0.*flashfsdp\[cuda13\]"):
        check_cuda_match(12, "13.0")
    with pytest.raises(RuntimeError, match=r"flashfsdp\[cuda12\]"):
        check_cuda_match(13, "12.8")
    with pytest.raises(RuntimeError, match="pip install cupy-cuda11x"):
        check_cuda_match(12, "11.8")


def test_matching_or_unknown_cuda_versions_pass():
    check_cuda_match(13, "13.0")
    check_cuda_match(None, "13.0")  # no CuPy wheel name to read
    check_cuda_match(12, None)  # a CPU build of torch


def test_a_non_positive_timeout_is_refused_before_anything_else():
    with pytest.raises(ValueError, match="timeout must be > 0"):
        nccl.NcclCommunicator(timeout=0)


# ------------------------------------------------------------------ watchdog
class _Abort:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1


def _no_async_error():
    return None


def test_an_overdue_collective_aborts_once_and_names_collective_and_unit():
    abort, finished, stuck = _Abort(), threading.Event(), threading.Event()
    dog = Watchdog("comm(rank 0 of 2)", 0.05, abort, _no_async_error, poll_s=10)
    dog.register("all_gather_into_tensor", finished.is_set).unit = "layers.0"
    dog.register("reduce_scatter_tensor", stuck.is_set).unit = "layers.1"
    finished.set()
    assert dog.poll() is None and len(dog.in_flight()) == 1  # the completed one is dropped
    time.sleep(0.06)
    error = dog.poll()
    assert isinstance(error, CollectiveTimeout) and abort.calls == 1
    assert "reduce_scatter_tensor of unit 'layers.1'" in str(error) and "0.05 s" in str(error)
    assert dog.poll() is error and abort.calls == 1  # aborted once
    with pytest.raises(CollectiveTimeout, match="layers.1"):
        dog.raise_if_failed()


def test_nccl_async_error_aborts_and_is_raised():
    abort = _Abort()

    def async_error():
        raise RuntimeError("NCCL_ERROR_REMOTE_ERROR")

    dog = Watchdog("comm", 60, abort, async_error)
    dog.register("all_reduce", threading.Event().is_set)
    error = dog.poll()
    assert type(error) is CollectiveError and abort.calls == 1
    assert "NCCL_ERROR_REMOTE_ERROR" in str(error) and "all_reduce (unit not named)" in str(error)


def test_the_watchdog_thread_finds_a_hang_without_any_call():
    abort = _Abort()
    dog = Watchdog("comm", 0.05, abort, _no_async_error, poll_s=0.01)
    dog.register("broadcast", threading.Event().is_set)
    dog.start()
    deadline = time.monotonic() + 5
    while dog.error is None and time.monotonic() < deadline:
        time.sleep(0.01)
    dog.stop()
    assert isinstance(dog.error, CollectiveTimeout) and abort.calls == 1


def test_a_host_wait_ends_in_an_error_not_a_hang():
    dog = Watchdog("comm", 0.05, _Abort(), _no_async_error)
    never = threading.Event()
    dog.register("all_reduce", never.is_set)
    with pytest.raises(CollectiveTimeout, match="all_reduce"):
        dog.wait_until(never.is_set)
    done = Watchdog("comm", 10, _Abort(), _no_async_error)
    done.wait_until(lambda: True)


def test_watchdog_refuses_non_positive_times():
    with pytest.raises(ValueError, match="timeout_s and poll_s must be > 0"):
        Watchdog("comm", 0, _Abort(), _no_async_error)


class _NamedWork(CompletedWork):
    unit = None

    def set_unit(self, unit: str) -> None:
        self.unit = unit


def test_issuing_names_the_unit_on_the_work():
    with trace.issuing("all_gather", "layers.3") as issued:
        work = issued.track(_NamedWork())
    assert work.unit == "layers.3"
    CompletedWork().set_unit("layers.3")  # the default accepts and ignores it


def _cupy14(ndev, comm_id, rank):
    """CuPy >= 14's argument conversion: ``NcclCommunicator(int ndev, bytes commId, int rank)``."""
    if not isinstance(comm_id, bytes):
        raise TypeError(f"Argument 'commId' has incorrect type (expected bytes, got {type(comm_id).__name__})")
    return ("cupy14", comm_id)


def _cupy13(signed):
    """Earlier CuPy: ``commId`` is a tuple of ints converted to C ``char`` one by one."""
    low, high = (-128, 127) if signed else (0, 255)

    def construct(ndev, comm_id, rank):
        if not isinstance(comm_id, tuple):
            raise TypeError(f"Argument 'commId' has incorrect type (expected tuple, got {type(comm_id).__name__})")
        if any(not low <= b <= high for b in comm_id):
            raise OverflowError("value too large to convert to char")
        return ("cupy13", bytes(b & 0xFF for b in comm_id))

    return construct


@pytest.mark.parametrize("constructor", [_cupy14, _cupy13(True), _cupy13(False)],
                         ids=["cupy14-bytes", "cupy13-signed-char", "cupy13-unsigned-char"])
def test_the_communicator_gets_the_unique_id_in_the_form_its_cupy_takes(constructor):
    raw = unique_id_to_bytes(_uid(signed=True, seed=5))
    kind, received = create_communicator(constructor, 2, raw, 1)
    assert received == raw  # every form carries the same 128 bytes to NCCL
    assert kind == ("cupy14" if constructor is _cupy14 else "cupy13")


def test_a_cupy14_unique_id_goes_through_the_store_as_itself():
    uid = bytes(range(128))  # CuPy >= 14's get_unique_id() returns bytes
    assert unique_id_to_bytes(uid) == uid


def test_a_constructor_refusing_every_form_raises_its_last_refusal():
    def refuses(ndev, comm_id, rank):
        raise TypeError("no form")

    with pytest.raises(TypeError, match="no form"):
        create_communicator(refuses, 2, bytes(128), 0)
    with pytest.raises(ValueError, match="expected 128 bytes"):
        create_communicator(_cupy14, 2, bytes(12), 0)
