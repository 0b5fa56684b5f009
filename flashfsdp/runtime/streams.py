"""The compute, all-gather and reduce-scatter streams of one device, and their events.

On CUDA, copy-in + all-gather run on a dedicated high-priority all-gather stream and gradient
packing + reduce-scatter + accumulation on a dedicated reduce-scatter stream; the compute stream
(the current stream) only waits on events. On CPU there are no streams: every method is a no-op and
collectives overlap through asynchronous gloo work handles instead.

[Note: memory safety without record_stream]
"Buffers freed by event, never by CPU synchronisation" is implemented as follows. The unsharded
buffer's storage is allocated while the all-gather stream is current, and freed by a plain CPU
``resize_(0)`` (``FlatParam.free_unsharded``) as soon as the compute stream has *enqueued* its last
use: the CPU neither waits for the GPU nor records an event for the free itself. Safety rests on
the CUDA caching allocator's per-stream reuse rule:

1. a freed block goes back to the pool of the stream it was allocated on (the all-gather stream)
   and is handed out again only to an allocation made on that same stream;
2. right before the free, the all-gather stream waits on the compute stream
   (:meth:`DeviceStreams.order_after_current`, in ``ShardedUnit.reshard``), and every unshard
   makes it wait again (``use``) before it allocates;

so the next allocation that can receive the block is ordered, on the GPU, after every compute
kernel enqueued before the free: kernels still reading the old buffer finish before the new
all-gather writes into it. Rule 1 alone does not cover a cache release: with
``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (common with FSDP), ``empty_cache()`` or an
out-of-memory retry unmaps a free block's pages after synchronising only the stream that owns it
(``ExpandableSegment::unmapHandles`` calls ``cudaStreamSynchronize`` on the owner), so the wait in
rule 2 is made at the free: once the all-gather stream is synchronised, so is every compute kernel
that read the buffer. This is FSDP2's order (``_fsdp_param_group.py``: the all-gather stream waits
on the compute stream's event before the previous all-gather's buffers are released). No
``record_stream`` is needed (it would delay reuse until the CPU observes the event, which is
worse), and the CPU never blocks.

Gradients: as in FSDP2's ``foreach_reduce``, packing runs on the compute stream, so the unsharded
gradients (compute-stream blocks, read only there) are freed right after it. The packed
reduce-scatter input is a compute-stream block read by the reduce-scatter stream: it stays
referenced (``hold_until_passed``) until the compute stream waited on the event recorded after the
reduce-scatter, which also covers a cache release (the owner, compute, is ordered after the read).
On CPU there is one thread and no stream: freeing is immediate and safe because every collective
reading or writing the buffer was waited on first.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from . import trace


class DeviceStreams:
    """Streams and events of one device.

    Args:
        device: the device of the unit's tensors. CUDA gets two high-priority side streams; any
            other device gets none and every method below does nothing.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        if self.is_cuda:
            self.all_gather = torch.cuda.Stream(device, priority=-1)
            self.reduce_scatter = torch.cuda.Stream(device, priority=-1)
        else:
            self.all_gather = None
            self.reduce_scatter = None
        self._held: list[tuple] = []
        self.max_held = 1  # set_reduce_scatter_max_input_buffers
        self._post_optim_event = None  # set_post_optim_event: the next all-gather waits on it instead

    def set_post_optim_event(self, event) -> None:
        """The next :meth:`use` of the all-gather stream waits on ``event`` instead of the current
        stream (FSDP2's ``set_post_optim_event``: an event recorded after the optimizer step orders
        every earlier compute kernel too, without the false dependency on later work)."""
        if self.is_cuda:
            self._post_optim_event = event

    @contextlib.contextmanager
    def use(self, stream: "torch.cuda.Stream | None") -> Iterator[None]:
        """Make ``stream`` current inside the block, after it waited on the current stream."""
        if stream is None:
            yield
            return
        if stream is self.all_gather and self._post_optim_event is not None:
            stream.wait_event(self._post_optim_event)
            self._post_optim_event = None
        else:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield

    def order_after_current(self, stream: "torch.cuda.Stream | None") -> None:
        """Make ``stream`` wait on everything enqueued on the current stream so far (GPU; no-op on
        CPU or for None). Call it before freeing, from the host, a block ``stream`` owns that the
        current stream has read: see [Note: memory safety without record_stream]."""
        if self.is_cuda and stream is not None:
            stream.wait_stream(torch.cuda.current_stream(self.device))

    def record(self, stream: "torch.cuda.Stream | None" = None) -> "torch.cuda.Event | None":
        """An event recorded on ``stream`` (default: the current stream); None on CPU."""
        if not self.is_cuda:
            return None
        event = torch.cuda.Event()
        event.record(stream if stream is not None else torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: "torch.cuda.Event | None") -> None:
        """Make the current stream wait on ``event`` (no CPU synchronisation); no-op for None."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def hold_until_passed(self, event: "torch.cuda.Event | None", tensors: object) -> None:
        """Keep ``tensors`` alive until the compute stream waited on ``event`` (CUDA; no-op on CPU).

        With ``max_held`` entries held already, the oldest is released first (the compute stream
        waits on its event), so at most ``max_held`` units' reduce-scatter inputs are held past
        their reduce-scatter: FSDP2's scheme (``set_reduce_scatter_max_input_buffers``).
        """
        if not self.is_cuda:
            return
        while len(self._held) >= self.max_held:
            self.wait(self._held.pop(0)[0])
        self._held.append((event, tensors))

    def release_held(self) -> None:
        """Make the compute stream wait on every held event, then drop the held tensors."""
        for event, _ in self._held:
            self.wait(event)
        self._held = []

    def wait_for_reduce_scatter(self, unit_name: str = "<root>") -> None:
        """Make the current stream wait for everything enqueued on the reduce-scatter stream."""
        if self.is_cuda:
            prof = trace.active()
            with trace.label("wait_reduce_scatter", unit_name):
                waited = prof.now() if prof is not None else None
                torch.cuda.current_stream(self.device).wait_stream(self.reduce_scatter)
                if prof is not None:
                    prof.add("wait_reduce_scatter", unit_name, "compute", waited, prof.now())


_streams: dict[torch.device, DeviceStreams] = {}


def streams_for(device: torch.device) -> DeviceStreams:
    """The process-wide :class:`DeviceStreams` of ``device`` (created on first use)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if device not in _streams:
        _streams[device] = DeviceStreams(device)
    return _streams[device]
