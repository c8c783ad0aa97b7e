"""Python's cyclic garbage collector paused while a checkpoint is read, or a file converted.

A read makes thousands of small containers and drops them when it ends (a header's unpacked msgpack tree, several
containers per tensor; its entries with their layouts and codebooks; each tensor's job, its ranges and views), none
of them in a cycle; msgpack's documentation advises the same pause for large messages. Every 700 of them start a
collection, and every few reads one of those walks every object the process holds (torch's modules, a model's; in a
serving engine, millions of objects and hundreds of milliseconds each). Paused, an 18,000-tensor header opened in
291-329 ms instead of 517-577, and MiniLM's repeated loads lost their 80 ms spikes (``bench/RESULTS.md``, "CPU
loading"); a conversion makes as many per tensor, and one of MiniLM's conversions in three took 82 ms longer, a
full collection. While any read or conversion of this process runs the collector is paused; the last one to end
resumes it if it ran when the first began, so a program that turned it off keeps it off. Other threads go
uncollected for the milliseconds a read takes, the seconds a conversion takes.
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
