"""The compute, all-gather and reduce-scatter streams of one device, and their events.

On CUDA, copy-in + all-gather run on a dedicated high-priority all-gather stream and gradient
packing + reduce-scatter + accumulation on a dedicated reduce-scatter stream; the compute stream
(the current stream) only waits on events. On CPU there are no streams: every method is a no-op and
collectives overlap through asynchronous gloo work handles instead.

[Note: memory safety without record_stream]
The unsharded buffer's storage is allocated under the all-gather stream and freed (``resize_(0)``)
from the CPU as soon as the compute stream has *enqueued* its last use. The caching allocator hands
a freed block back only to the stream it was allocated on, and every unshard makes the all-gather
stream wait on the compute stream before it allocates: so the block is reused only after the
compute stream has passed every use enqueued before the free. Gradient buffers read by the
reduce-scatter stream are kept referenced until the compute stream waited on the event recorded
after that read. This is FSDP2's scheme (``_fsdp_collectives.py``) applied to one flat buffer.
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
        self._held: tuple = ()

    @contextlib.contextmanager
    def use(self, stream: "torch.cuda.Stream | None") -> Iterator[None]:
        """Make ``stream`` current inside the block, after it waited on the current stream."""
        if stream is None:
            yield
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            yield

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

        Releases what an earlier call held first (making the compute stream wait on its event), so
        at most one unit's gradients are held past their pack: FSDP2's reduce-scatter-input scheme.
        """
        if not self.is_cuda:
            return
        self.release_held()
        self._held = (event, tensors)

    def release_held(self) -> None:
        """Make the compute stream wait on the held event, then drop the held tensors."""
        if self._held:
            self.wait(self._held[0])
            self._held = ()

    def wait_for_reduce_scatter(self, unit_name: str = "<root>") -> None:
        """Make the current stream wait for everything enqueued on the reduce-scatter stream."""
        if self.is_cuda:
            prof = trace.active()
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
