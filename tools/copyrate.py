"""Same-run copy ceilings for the GPU benchmarks: how fast this machine moves bytes from pinned host memory to the
device, timed with CUDA events, so that every figure can be read against the link it crossed."""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def median_copy_seconds(copy: Callable[[], object], reps: int) -> float:
    """Median device time of ``copy()`` over ``reps`` calls after one untimed call (CUDA events)."""
    copy()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copy()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def pinned_h2d_gbps(nbytes: int, reps: int, device: torch.device | str = "cuda") -> float:
    """GB/s of one pinned host-to-device copy of ``nbytes`` (median of ``reps``)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 256)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    try:
        return nbytes / median_copy_seconds(lambda: dev.copy_(host, non_blocking=True), reps) / 1e9
    finally:
        torch.cuda.synchronize(device)  # the buffers go with this frame, after their last copy
