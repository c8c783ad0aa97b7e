"""Python's cyclic garbage collector paused while a checkpoint is read.

A load makes thousands of small objects and drops them when it ends (a header's entries with their layouts and
codebooks, each tensor's job, its ranges and views), none of them in a cycle. Every 700 of them start a
collection, and every few loads one of those walks every object the process holds (torch's modules, a model's):
on MiniLM's 104 tensors, 1-2 ms of a 7-11 ms load on two threads, more in its spikes (``bench/RESULTS.md``, "CPU
loading"). While any load of this process runs the collector is paused; the last one to end resumes it, if it ran
before the first began, so a caller who disabled it keeps it disabled.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_loads = 0  # loads of this process under way
_resume = False  # whether the collector ran when the first of them began


@contextmanager
def collector_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector for the ``with`` block (nested and concurrent blocks included)."""
    global _loads, _resume
    with _lock:
        if _loads == 0:
            _resume = gc.isenabled()
            gc.disable()
        _loads += 1
    try:
        yield
    finally:
        with _lock:
            _loads -= 1
            if _loads == 0 and _resume:
                gc.enable()
