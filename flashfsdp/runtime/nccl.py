"""NcclCommunicator: NCCL through CuPy, enqueued on the caller's current CUDA stream.

The runtime issues copy-in + all-gather under its dedicated all-gather stream and packing +
reduce-scatter under its reduce-scatter stream (``flashfsdp.runtime.streams``); this communicator
enqueues each NCCL call on whatever torch stream is current, by raw handle, and returns a Work
that holds a CUDA event recorded after the call. ``Work.wait()`` makes the *waiting* stream wait on
that event (no CPU synchronisation) and keeps the tensors referenced until then, so that no
``record_stream`` is needed. Memory comes from PyTorch's caching allocator (the tensors are
torch tensors).

The NCCL unique id travels through the torch.distributed store that ``init_process_group`` (and so
torchrun) already set up: no second rendezvous. Its store key is the group's ranks plus a
per-process counter of communicators created so far, so every rank of a group must create its
NcclCommunicators in the same order (as it does when every rank makes the same ``fully_shard``
calls in the same order); a rank that creates one more or one fewer waits on a key the others
never set. The id goes through the store as plain bytes and is read back in the range of this
platform's C ``char`` (see [Note: the unique id's bytes] in ``nccl_env.py``).

Failures (see ``nccl_watchdog.py``): every collective gets a deadline (``timeout``); a watchdog
thread polls NCCL's asynchronous error and the deadlines and, on a failure, aborts the
communicator (``ncclCommAbort``) and the next call raises :class:`CollectiveError` naming the
collective and the unit.

Teardown: a communicator lives as long as its process group. flashfsdp leaves torch's functions as
they are (it does not wrap ``torch.distributed.destroy_process_group``), and torch has no callback
for a group's destruction, so a communicator checks that its group is still registered with
torch.distributed (``_world.pg_map``, which ``destroy_process_group`` clears; see
``flashfsdp/_torch_private.py``): before each collective, when another NcclCommunicator is created
(after a re-initialised process group, say), and at interpreter exit. One whose group is gone is
destroyed then (``ncclCommDestroy`` once its collectives have completed, ``ncclCommAbort`` if one
failed or is still in flight after the timeout; at exit it does not wait: ``ncclCommAbort`` if one
is in flight) and its next collective raises. One whose group is still registered at exit is left
to the process's end, as torch leaves its own: the other ranks may be gone already. A
``weakref.finalize`` on the group would fire when its Python object is collected, not when it is
destroyed (the communicator, the units and user code keep it alive past ``destroy_process_group``,
and each rank collects it at another time).

To release them at a point of your choosing (their GPU memory, before a new process group, say),
call :func:`destroy_communicators` on every rank, before or after destroying the group::

    from flashfsdp.runtime.nccl import destroy_communicators

    destroy_communicators(group)  # or destroy_communicators() for every one
    torch.distributed.destroy_process_group(group)
"""

from __future__ import annotations

import atexit
import datetime
import itertools
import os
import weakref

import torch
import torch.distributed as dist

from flashfsdp._torch_private import c10d_world, get_default_store

from . import flight
from .communicator import (Communicator, ReduceOpName, Work, all_to_all_kind, check_all_to_all_sizes,
                           check_collective_sizes, check_reduce_op)
from .nccl_env import create_communicator, import_nccl, unique_id_to_bytes
from .nccl_watchdog import CollectiveError, CollectiveTimeout, Watchdog

__all__ = ["NcclCommunicator", "CollectiveError", "CollectiveTimeout", "DEFAULT_TIMEOUT_S", "destroy_communicators",
           "release_destroyed"]

# ncclDataType_t and ncclRedOp_t values from nccl.h (stable across NCCL 2.x).
_NCCL_DTYPES = {
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
    torch.int32: 2,
    torch.int64: 4,
    torch.uint8: 1,
    torch.int8: 0,
}
_NCCL_OPS = {"sum": 0, "max": 2, "avg": 4}
DEFAULT_TIMEOUT_S = 600.0  # torch's default NCCL process-group timeout (10 minutes)
_id_counter = itertools.count()
_live: "weakref.WeakSet[NcclCommunicator]" = weakref.WeakSet()  # every communicator not destroyed yet
_exit_release_registered = False
# The flight recorder's kind of each collective (``flight.py``).
_FLIGHT_KINDS = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
                 "all_reduce": "all_reduce", "broadcast": "broadcast"}


class _NcclWork(Work):
    def __init__(self, event: torch.cuda.Event, keepalive: tuple[torch.Tensor, ...], watchdog: Watchdog, entry):
        self._event = event
        self._keepalive = keepalive
        self._watchdog = watchdog
        self._entry = entry

    def set_unit(self, unit: str) -> None:
        self._entry.unit = unit
        if self._entry.flight_entry is not None:
            self._entry.flight_entry.unit = unit

    def wait(self) -> None:
        self._watchdog.raise_if_failed()
        flight.waiting(self._entry.flight_entry)  # (a stream waits: completed once the watchdog sees it done)
        torch.cuda.current_stream().wait_event(self._event)
        self._keepalive = ()

    def is_completed(self) -> bool:
        return self._event.query()


def _timeout_seconds(timeout: float | datetime.timedelta | None) -> float:
    """Seconds from ``timeout``; None: ``FLASHFSDP_NCCL_TIMEOUT`` (seconds) or DEFAULT_TIMEOUT_S."""
    if timeout is None:
        timeout = float(os.environ.get("FLASHFSDP_NCCL_TIMEOUT", DEFAULT_TIMEOUT_S))
    seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else float(timeout)
    if not seconds > 0:
        raise ValueError(f"NcclCommunicator: timeout must be > 0 seconds, got {timeout!r}")
    return seconds


class NcclCommunicator(Communicator):
    """Collectives through ``cupy.cuda.nccl.NcclCommunicator`` over a torch.distributed group.

    Every rank of ``group`` must construct its NcclCommunicators in the same order (the unique
    id's store key counts them per process; see the module docstring).

    Args:
        group: the process group whose ranks form the NCCL communicator (default: world). Only its
            store is used, to pass the NCCL unique id.
        device: the CUDA device of this rank (default: ``torch.cuda.current_device()``).
        timeout: how long a collective may take before the communicator is aborted and the next
            call raises :class:`CollectiveTimeout` (seconds or a timedelta; default: the
            ``FLASHFSDP_NCCL_TIMEOUT`` environment variable in seconds, else 600 s as torch's NCCL).

    Raises:
        RuntimeError: without CUDA (``torch.cuda.is_available()`` false), without CuPy/NCCL, with a
            CuPy built for another CUDA major version than torch, or if torch.distributed is not
            initialised; each message says what to do instead.
        ValueError: a timeout that is not positive.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | int | None = None,
                 timeout: float | datetime.timedelta | None = None):
        timeout_s = _timeout_seconds(timeout)
        if not torch.cuda.is_available():
            raise RuntimeError(
                "NcclCommunicator needs a CUDA device, but torch.cuda.is_available() is False on this "
                "machine; on CPU use communicator='process_group' (gloo), which 'auto' picks for CPU modules"
            )
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "NcclCommunicator: torch.distributed is not initialised; call "
                "torch.distributed.init_process_group() first (its store carries the NCCL unique id)"
            )
        nccl = import_nccl()
        self.group = group if group is not None else dist.group.WORLD
        self.rank = dist.get_rank(self.group)
        self.ranks = tuple(dist.get_process_group_ranks(self.group))  # for the flight recorder
        self.world_size = dist.get_world_size(self.group)
        if device is None:
            device = torch.cuda.current_device()
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        release_destroyed()  # those of a group destroyed since: their GPU memory before this one's
        self._comm = self._create(nccl)
        self._start(timeout_s)

    def _start(self, timeout_s: float) -> None:
        """Watch the communicator just created (``self._comm``) and register it for teardown with
        its group (see the module docstring)."""
        me = weakref.ref(self)  # the watchdog thread must not keep the communicator alive
        self._watchdog = Watchdog(f"NcclCommunicator(rank {self.rank} of {self.world_size}, {self.device})",
                                  timeout_s, lambda: _call(me, "abort"), lambda: _call(me, "_check_async_error"))
        self._watchdog.start()
        _live.add(self)
        _register_exit_release()

    def _create(self, nccl):
        """The CuPy communicator, after passing the unique id from rank 0 through the store."""
        store = get_default_store()
        ranks = dist.get_process_group_ranks(self.group)
        key = f"flashfsdp/nccl_uid/{'_'.join(map(str, ranks[:8]))}_{len(ranks)}/{next(_id_counter)}"
        if self.rank == 0:
            store.set(key, unique_id_to_bytes(nccl.get_unique_id()))
        raw = store.get(key)
        import cupy  # noqa: PLC0415

        with cupy.cuda.Device(self.device.index):
            return create_communicator(nccl.NcclCommunicator, self.world_size, raw, self.rank)

    # ------------------------------------------------------------------ failures and teardown
    def _check_async_error(self) -> None:
        comm = self._comm
        if comm is not None:
            comm.check_async_error()

    def abort(self) -> None:
        """``ncclCommAbort``: collectives in flight return at once (their results are undefined);
        every later call raises. Safe to call from the watchdog thread and more than once."""
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.abort()

    def destroy(self, wait: bool = True) -> None:
        """Release the NCCL communicator: ``ncclCommDestroy`` once every collective issued has
        completed, ``ncclCommAbort`` if one failed or is still in flight after the timeout
        (``wait=False``: if one is in flight now, without waiting for it). Safe to call more than
        once; later collectives raise. :func:`destroy_communicators` and :func:`release_destroyed`
        call it, and a collective that finds the group destroyed."""
        _live.discard(self)
        if self._comm is None:
            self._watchdog.stop()
            return
        try:
            if wait:
                self._watchdog.wait_until(lambda: not self._watchdog.in_flight())
            elif self._watchdog.poll() is None and self._watchdog.in_flight():
                self.abort()
        except CollectiveError:
            pass  # the watchdog aborted the communicator already
        self._watchdog.stop()
        comm, self._comm = self._comm, None
        if comm is not None:
            comm.destroy()

    def group_destroyed(self) -> bool:
        """Whether this communicator's process group was destroyed (is no longer registered with
        torch.distributed): its NCCL communicator goes with it."""
        return self.group not in c10d_world.pg_map

    def _live_comm(self):
        if self._comm is not None and self.group_destroyed():
            self.destroy()
        self._watchdog.raise_if_failed()
        if self._comm is None:
            raise RuntimeError(f"{self._watchdog.name} was destroyed (its process group was destroyed, or "
                               f"destroy_communicators released it); fully_shard again after "
                               f"init_process_group to get a new one")
        return self._comm

    # ------------------------------------------------------------------ collectives
    def _enqueue(self, name: str, call, *tensors: torch.Tensor, kind: str | None = None) -> Work:
        for t in tensors:
            if t.device != self.device:
                raise ValueError(f"NcclCommunicator: {name}: tensor on {t.device}, communicator on {self.device}")
        comm = self._live_comm()
        stream = torch.cuda.current_stream(self.device)
        entry = flight.record(kind or _FLIGHT_KINDS[name], self.ranks, tensors[-1].numel() * tensors[-1].element_size())
        call(comm, stream.cuda_stream)
        event = torch.cuda.Event()
        event.record(stream)
        return _NcclWork(event, tensors, self._watchdog, self._watchdog.register(name, event.query, entry))

    @staticmethod
    def _dtype(t: torch.Tensor) -> int:
        try:
            return _NCCL_DTYPES[t.dtype]
        except KeyError:
            raise TypeError(f"NcclCommunicator: dtype {t.dtype} has no NCCL counterpart") from None

    def all_gather_into_tensor(self, out: torch.Tensor, inp: torch.Tensor) -> Work:
        check_collective_sizes("all_gather_into_tensor", out, inp, self.world_size)
        return self._enqueue(
            "all_gather_into_tensor",
            lambda c, s: c.allGather(inp.data_ptr(), out.data_ptr(), inp.numel(), self._dtype(inp), s),
            out, inp,
        )

    def reduce_scatter_tensor(self, out: torch.Tensor, inp: torch.Tensor, op: ReduceOpName = "sum") -> Work:
        check_reduce_op(op)
        check_collective_sizes("reduce_scatter_tensor", inp, out, self.world_size)
        return self._enqueue(
            "reduce_scatter_tensor",
            lambda c, s: c.reduceScatter(inp.data_ptr(), out.data_ptr(), out.numel(), self._dtype(out), _NCCL_OPS[op], s),
            out, inp,
        )

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOpName = "sum") -> Work:
        check_reduce_op(op)
        return self._enqueue(
            "all_reduce",
            lambda c, s: c.allReduce(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), self._dtype(tensor), _NCCL_OPS[op], s),
            tensor,
        )

    def broadcast(self, tensor: torch.Tensor, src: int) -> Work:
        return self._enqueue(
            "broadcast",
            lambda c, s: c.broadcast(tensor.data_ptr(), tensor.data_ptr(), tensor.numel(), self._dtype(tensor), src, s),
            tensor,
        )

    def all_to_all_single(self, out: torch.Tensor, inp: torch.Tensor, label: str | None = None) -> Work:
        """Equal-split all-to-all as NCCL's grouped point-to-point (``ncclGroupStart``, one
        ``ncclSend`` of ``inp``'s chunk j to rank j and one ``ncclRecv`` of rank j's chunk into
        ``out``'s chunk j for every j, ``ncclGroupEnd``: NCCL's own all-to-all recipe) on the
        current stream; needs NCCL >= 2.7 (CuPy's ``send`` / ``recv``). Recorded as
        ``"all_to_all (<label>)"`` (see the base class)."""
        check_all_to_all_sizes(out, inp, self.world_size)
        nccl = import_nccl()
        n = inp.numel() // self.world_size
        step = n * inp.element_size()
        dtype = self._dtype(inp)

        def call(c, s):
            nccl.groupStart()
            try:
                for peer in range(self.world_size):
                    c.send(inp.data_ptr() + peer * step, n, dtype, peer, s)
                    c.recv(out.data_ptr() + peer * step, n, dtype, peer, s)
            finally:
                nccl.groupEnd()

        return self._enqueue("all_to_all_single", call, out, inp, kind=all_to_all_kind(label))

    def barrier(self) -> None:
        """All-reduce one element and wait for it on the host, polling the watchdog (a rank that
        never arrives raises :class:`CollectiveTimeout` after the timeout instead of hanging)."""
        flag = torch.zeros(1, device=self.device)
        work = self.all_reduce(flag)
        self._watchdog.wait_until(work.is_completed)


def _call(ref: "weakref.ref[NcclCommunicator]", method: str) -> None:
    comm = ref()
    if comm is not None:
        getattr(comm, method)()


def destroy_communicators(group=None) -> int:
    """Destroy the live NcclCommunicators over ``group`` (None or the default group: every one),
    whether or not the group itself was destroyed yet; returns how many. Call it on every rank,
    for a deterministic release (see the module docstring): otherwise a communicator goes when it
    finds its group destroyed."""
    everything = group is None or group is dist.group.WORLD  # destroying the default group destroys every group
    doomed = [c for c in list(_live) if everything or c.group is group]
    for comm in doomed:
        comm.destroy()
    return len(doomed)


def release_destroyed(wait: bool = True) -> int:
    """Destroy the live NcclCommunicators whose process group was destroyed (see
    :meth:`NcclCommunicator.destroy` for ``wait``); returns how many."""
    doomed = [c for c in list(_live) if c.group_destroyed()]
    for comm in doomed:
        comm.destroy(wait=wait)
    return len(doomed)


def _release_at_exit() -> None:
    """At interpreter exit: the communicators whose group was destroyed, without waiting on
    collectives in flight (another rank may be gone); the others stay, as torch's own do."""
    release_destroyed(wait=False)


def _register_exit_release() -> None:
    """Run :func:`_release_at_exit` at interpreter exit. Registered once, by the first
    communicator: after CuPy registered its own exit handlers, so it runs before them (atexit runs
    the last registered first), while CUDA and NCCL are still up."""
    global _exit_release_registered
    if not _exit_release_registered:
        atexit.register(_release_at_exit)
        _exit_release_registered = True
