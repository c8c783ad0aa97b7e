"""An optional record of where a device load spends its time, on the host and (on CUDA) on the copy stream.

Loading overlaps host reads, host waits, copies and decodes; a wall time alone cannot say which of them limits it.
Inside ``with recording() as timeline:`` every transfer loop notes, per transfer: the host's wait for a free slot,
the submission of its reads, each read piece on its reader thread (and the CRC-32 of it, when verifying), the host's
wait for those reads, the enqueueing of its copy and of its decode, and, on CUDA, when the copy and the decode ran
on the device (timing events). :meth:`Timeline.summary` folds that into totals; :meth:`Timeline.spans` gives the
raw spans. Outside ``recording()`` nothing is recorded and the loop pays one ``None`` check per step.

    from szformat.loading import timeline
    with timeline.recording() as tl:
        szformat.load_file("model.szt", device="cuda")
    print(tl.summary())
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

__all__ = ["Span", "Timeline", "recording", "current"]


@dataclass(frozen=True)
class Span:
    """``what`` happened for transfer ``k`` from ``start`` to ``end`` (seconds since the timeline began) on ``lane``:
    a host thread's name, or ``"device:copy"`` / ``"device:decode"``. ``nbytes`` is what it moved, where it moved
    any."""

    what: str
    k: int
    start: float
    end: float
    lane: str
    nbytes: int = 0


class Timeline:
    """Spans recorded by the loading pipeline; thread-safe to append to."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self._spans: list[Span] = []
        self._device: list[tuple[str, int, Any, Any, int, str]] = []
        self._device_origin: tuple[Any, float] | None = None
        self._elapsed: Callable[[Any, Any], float] | None = None
        self._lock = threading.Lock()

    def now(self) -> float:
        return time.perf_counter() - self.origin

    def add(self, what: str, k: int, start: float, end: float, nbytes: int = 0) -> None:
        """A host span of the calling thread (``start``/``end`` from :meth:`now`)."""
        span = Span(what, k, start, end, threading.current_thread().name, nbytes)
        with self._lock:
            self._spans.append(span)

    @property
    def has_device_origin(self) -> bool:
        return self._device_origin is not None

    def device_origin(self, event: Any, elapsed: Callable[[Any, Any], float]) -> None:
        """``event`` ran on an idle device just now; ``elapsed(a, b)`` gives seconds between two timing events.
        Device spans are placed on the host's clock through it."""
        self._device_origin = (event, self.now())
        self._elapsed = elapsed

    def add_device(self, what: str, k: int, begin: Any, end: Any, nbytes: int = 0) -> None:
        """A device span between two timing events (resolved once the work has run, in :meth:`spans`)."""
        with self._lock:
            self._device.append((what, k, begin, end, nbytes, f"device:{what}"))

    def spans(self) -> list[Span]:
        """Every span, the device ones resolved (call after the load returned), ordered by start."""
        out = list(self._spans)
        if self._device_origin is not None and self._elapsed is not None:
            origin, at = self._device_origin
            for what, k, begin, end, nbytes, lane in self._device:
                out.append(Span(what, k, at + self._elapsed(origin, begin), at + self._elapsed(origin, end), lane,
                                nbytes))
        return sorted(out, key=lambda s: (s.start, s.end))

    def summary(self) -> dict[str, float]:
        """Totals, in milliseconds and GB/s: ``wall``; per step of the loop the time spent in it: on its staging
        thread ``wait_slot`` (for a free slot) and ``stage`` (submitting reads), on its copying thread
        ``wait_reads`` (for a transfer's reads) and ``land`` (enqueueing its copy), on the calling thread ``expand``
        (enqueueing its decode), and on CUDA ``<kind>_call`` for each kind of device work enqueued (``copy``,
        ``inflate``, ``decode``), plus ``allocate`` (every destination, before the loop starts) and ``prepare``
        (what only the expansions need, made on the calling thread while the first reads run); per kind of work
        (``read`` and ``crc`` on the reader threads, each kind of device work on the device) the time any of it ran
        (``*_busy_ms``), its sum over threads (``*_thread_ms``), bytes over busy time (``*_gbps``), and when it
        first started and last ended; and how long a transfer's bytes waited between its last read and the start of
        its copy (``read_to_copy_mean_ms``/``_max_ms``)."""
        spans = self.spans()
        if not spans:
            return {}
        out: dict[str, float] = {"wall_ms": 1e3 * (max(s.end for s in spans) - min(s.start for s in spans))}
        by_what: dict[str, list[Span]] = {}
        for s in spans:
            by_what.setdefault(s.what if not s.lane.startswith("device:") else s.lane, []).append(s)
        calls = sorted(what for what in by_what if what.endswith("_call"))  # one per kind of device work enqueued
        for what in ("wait_slot", "stage", "wait_reads", "land", "expand", *calls, "allocate", "prepare"):
            out[f"{what}_ms"] = 1e3 * sum(s.end - s.start for s in by_what.get(what, []))
        lanes = sorted(what for what in by_what if what.startswith("device:"))
        for what, key in (("read", "read"), ("crc", "crc"), *((lane, lane.removeprefix("device:")) for lane in lanes)):
            group = by_what.get(what, [])
            if not group:
                continue
            busy = _union(group)
            out[f"{key}_busy_ms"] = 1e3 * busy
            out[f"{key}_thread_ms"] = 1e3 * sum(s.end - s.start for s in group)
            moved = sum(s.nbytes for s in group)
            if moved and busy > 0:
                out[f"{key}_gbps"] = moved / busy / 1e9
            out[f"first_{key}_ms"] = 1e3 * min(s.start for s in group)
            out[f"last_{key}_end_ms"] = 1e3 * max(s.end for s in group)
        read_done: dict[int, float] = {}
        for s in by_what.get("read", []):
            read_done[s.k] = max(read_done.get(s.k, s.end), s.end)
        copy_start = {s.k: s.start for s in by_what.get("device:copy", [])}
        lags = [copy_start[k] - done for k, done in read_done.items() if k in copy_start]
        if lags:  # bytes staged but not yet crossing: the copy stream is behind (or its enqueueing is late)
            out["read_to_copy_mean_ms"] = 1e3 * sum(lags) / len(lags)
            out["read_to_copy_max_ms"] = 1e3 * max(lags)
        return out


def _union(spans: list[Span]) -> float:
    """Length of the union of the spans' intervals."""
    total, end = 0.0, float("-inf")
    for s in sorted(spans, key=lambda s: s.start):
        if s.end > end:
            total += s.end - max(s.start, end)
            end = s.end
    return total


_current: Timeline | None = None


def current() -> Timeline | None:
    """The timeline being recorded, or ``None``."""
    return _current


@contextmanager
def recording() -> Iterator[Timeline]:
    """Record the loads started inside the block (one process-wide timeline; not for concurrent loads)."""
    global _current
    timeline = Timeline()
    previous, _current = _current, timeline
    try:
        yield timeline
    finally:
        _current = previous
