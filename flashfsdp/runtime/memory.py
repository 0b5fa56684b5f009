"""Peak memory of this process, with a reset, without a sampling thread (no timing noise).

One meter for the benchmarks and the library: a measured region is either bracketed by
:meth:`PeakMemoryMeter.reset` and :meth:`PeakMemoryMeter.peak_bytes` (the peak above what the
process held when the meter was made), or run inside ``with meter:`` (the peak growth during the
block, in ``meter.peak``).
"""

from __future__ import annotations

import ctypes

import torch


class PeakMemoryMeter:
    """Peak memory of this process, with a reset, without a sampling thread (no timing noise).

    Call :meth:`reset` where the measured region starts (for training steps: after the model is
    built and sharded, so that the full model materialised before sharding does not count), then
    :meth:`peak_bytes` at its end. Or use the meter as a context manager: ``with meter: ...`` resets
    it on entry and leaves in ``meter.peak`` the peak growth during the block, above what was held
    at entry.

    - CUDA: ``torch.cuda.reset_peak_memory_stats`` / ``max_memory_allocated``: the most bytes held
      by tensors at any moment since the reset (model, optimizer state, activations, buffers).
    - CPU (Linux): the kernel's resident-set high-water mark (``VmHWM`` in ``/proc/self/status``),
      reset to the current RSS by writing ``5`` to ``/proc/self/clear_refs`` after glibc's
      ``malloc_trim(0)`` handed freed heap back; minus the RSS at construction (the interpreter,
      torch, the process group), so the figure counts the same things as on CUDA plus allocator
      slack. Where the reset is not possible, the high-water mark of the whole process (whose
      ``description`` then says so).

    Args:
        device: the device whose memory is measured.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self._base = 0 if device.type == "cuda" else self._rss()
        self.resettable = device.type == "cuda"
        self.description = "max_memory_allocated since the reset"
        self.peak = 0  # the growth of the last ``with`` block, in bytes
        self._entry = 0

    @staticmethod
    def _status_kib(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise OSError(f"/proc/self/status has no {field}")

    def _rss(self) -> int:
        try:
            return self._status_kib("VmRSS") * 1024
        except OSError:
            return 0

    def reset(self) -> None:
        """Start the peak from the memory held now."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):
            pass
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self._status_kib("VmHWM")
            self.resettable = True
            self.description = "peak RSS (VmHWM) since the reset, minus the RSS before the model"
        except OSError:
            self.resettable = False
            self.description = "peak RSS of the whole process (no reset on this OS), minus the RSS before the model"

    def _held_bytes(self) -> int:
        """What the process holds now: CUDA ``memory_allocated``; CPU the RSS."""
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self._rss()

    def _high_water_bytes(self, sync: bool = True) -> int:
        """The absolute peak since the reset (CUDA: allocated bytes; CPU: RSS)."""
        if self.device.type == "cuda":
            if sync:
                torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        if self.resettable:
            return self._status_kib("VmHWM") * 1024
        import resource  # noqa: PLC0415

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    def peak_bytes(self, sync: bool = True) -> int:
        """The peak since :meth:`reset`, in bytes (CPU: above the RSS at construction). ``sync=False``
        skips the CUDA synchronisation (a progress display: the peak of what was enqueued so far)."""
        return max(0, self._high_water_bytes(sync) - self._base)

    def __enter__(self) -> "PeakMemoryMeter":
        self.reset()
        self._entry = self._held_bytes()
        return self

    def __exit__(self, *exc) -> None:
        self.peak = max(0, self._high_water_bytes() - self._entry)
