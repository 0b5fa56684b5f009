"""flashfsdp.runtime.memory: the resettable peak-memory meter, bracketing a region or as a context."""

from __future__ import annotations

import torch

from flashfsdp.runtime.memory import PeakMemoryMeter

SIZE = 256 * 2**20  # bytes of fp32, touched so that they are resident


def test_peak_memory_reset_forgets_what_came_before():
    meter = PeakMemoryMeter(torch.device("cpu"))
    meter.reset()
    big = torch.ones(SIZE // 4)
    high = meter.peak_bytes()
    # Most of it shows as growth (the allocator may reuse a few MiB that were already resident).
    assert high >= SIZE // 2
    del big
    meter.reset()
    assert meter.peak_bytes() < high - SIZE // 4  # what was freed before the reset no longer counts
    assert "since the reset" in meter.description


def test_context_measures_the_growth_during_the_block():
    held = torch.ones(SIZE // 4)  # resident before the block: not growth
    with PeakMemoryMeter(torch.device("cpu")) as meter:
        big = torch.ones(SIZE // 4)
        del big
    assert SIZE // 2 <= meter.peak < SIZE + SIZE // 2
    with meter:
        pass
    assert meter.peak < SIZE // 4  # the next block starts from what is held then
    del held
