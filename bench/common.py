"""What the benchmarks share: same-run anchors (copy rates), memory counters, the peer loaders, a clock of the GIL
for reader threads, and the order in which a round times its methods.
"""

from __future__ import annotations

import importlib
import os
import statistics
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from time import perf_counter
from typing import Any, Callable, Iterator, Sequence, TypeVar

import torch
from zlib_ng import zlib_ng

from szformat.format import at_rest

__all__ = ["GilClock", "TimedPool", "median_copy_seconds", "pinned_h2d_gbps", "memory_status", "PEERS", "PeerLoader",
           "available_peers"]

Item = TypeVar("Item")


def round_order(items: Sequence[Item], round_: int) -> list[Item]:
    """The order ``items`` are timed in round ``round_``: rows of a balanced Latin square (Williams'), so that over
    ``len(items)`` rounds (twice that for an odd count) each runs first as often as the others and follows each other
    one as often: what ran just before a timing can leave the heap, the page cache or the CPU's caches in another
    state, and a plain rotation keeps one item after the same one in every round but the last."""
    n = len(items)
    if n == 0:
        return []
    first = [0]  # 0, 1, n-1, 2, n-2, ...
    low, high = 1, n - 1
    while len(first) < n:
        first.append(low)
        low += 1
        if len(first) < n:
            first.append(high)
            high -= 1
    r = round_ % (n if n % 2 == 0 else 2 * n)
    order = [items[(i + r) % n] for i in first]
    return order[::-1] if r >= n else order  # an odd count also needs each row mirrored


# --- gil clock: Where a reader thread's time goes with respect to the GIL, measured without a profiler.
#
# Reader threads work side by side only while none holds the GIL: on a host with many cores the time each spends
# holding it runs one thread at a time, and every call that releases it is one more time the thread must take it
# back (behind whichever thread holds it then). :class:`GilClock` measures both for work run on one reader thread:
#
# * every task the thread runs is timed end to end;
# * every call of the staging paths that releases the GIL is wrapped for the measurement and timed: ``os.preadv``,
#   zlib-ng's CRC-32, zstd's ``readinto``/``read``/``decompress``
#   (through :func:`szformat.format.at_rest.decompressor`),
#   torch's ``Tensor.copy_``. A zstd ``readinto`` counts one release per zstd frame in its input (python-zstandard
#   releases the GIL once per ``ZSTD_decompressStream`` call, which ends at each frame); a ``read`` after it, which
#   finds its input used up and returns at once, counts none;
# * a task's time outside those calls is time it held the GIL: with one reader thread and the thread that submits its
#   tasks kept waiting while it works (:meth:`GilClock.gate`), nothing else wants the GIL meanwhile;
# * the wrappers' own work (timing, counting frames) is timed and taken off, and so is their call overhead, measured
#   against a bare call (:meth:`GilClock.calibrate`).
#
# cProfile, used for this before, adds its own cost to every Python call it sees, so its split depended on how many
# calls a path makes (it put the at-rest form's held time at 0.055 s/GB where this clock measures 0.027-0.037).


class GilClock:
    """Seconds one reader thread spends holding the GIL and in calls that release it, and how many such calls.

    ``tasks``, ``task_seconds``: the reader's tasks and their time; ``released_seconds``, ``releases``: time in the
    calls that release the GIL and how many times they release it; ``bookkeeping``, ``wrapped_calls``: the
    wrappers' own timed work and how many wrappers ran (each costing ``residual`` more, see :meth:`calibrate`);
    ``driver_seconds``: the submitting thread's time inside :meth:`gate` blocks.
    """

    def __init__(self) -> None:
        self.tasks = 0
        self.task_seconds = 0.0
        self.released_seconds = 0.0
        self.releases = 0
        self.wrapped_calls = 0
        self.bookkeeping = 0.0
        self.driver_seconds = 0.0
        self.residual = 0.0
        self._readers: set[int] = set()

    @property
    def held_seconds(self) -> float:
        """Task time outside the releasing calls, less the wrappers' own work."""
        return (self.task_seconds - self.released_seconds - self.bookkeeping
                - self.wrapped_calls * self.residual)

    def enter(self) -> None:
        """Register the calling thread as the reader (a pool initializer)."""
        self._readers.add(threading.get_ident())

    def run_task(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run one of the reader's tasks, timed end to end."""
        began = perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.task_seconds += perf_counter() - began
            self.tasks += 1

    def timed(self, fn: Callable[..., Any], releases: int = 1) -> Callable[..., Any]:
        """``fn`` timed as a call that releases the GIL ``releases`` times, on the reader thread only."""
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() not in self._readers:
                return fn(*args, **kwargs)
            return self.call(perf_counter(), releases, fn, *args, **kwargs)
        return wrapper

    def call(self, entered: float, releases: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn``, a call that releases the GIL ``releases`` times, for a wrapper entered at ``entered``."""
        began = perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            ended = perf_counter()
            self.released_seconds += ended - began
            self.releases += releases
            self.wrapped_calls += 1
            self.bookkeeping += began - entered + perf_counter() - ended

    def wrap(self, make: Callable[[], Any]) -> Any:
        """``make()``, a wrapper object made for the measurement: its time is the wrappers' own."""
        began = perf_counter()
        try:
            return make()
        finally:
            self.bookkeeping += perf_counter() - began
            self.wrapped_calls += 1

    def calibrate(self, calls: int = 20000) -> None:
        """Measure what a wrapper costs beyond what it times itself (its call, the thread check): taken off per
        wrapped call."""
        probe = GilClock()
        probe.enter()
        wrapped, data = probe.timed(len), b"x"
        best = float("inf")
        for _ in range(5):
            before = probe.bookkeeping + probe.released_seconds
            began = perf_counter()
            for _ in range(calls):
                wrapped(data)
            wrapped_seconds = perf_counter() - began - (probe.bookkeeping + probe.released_seconds - before)
            began = perf_counter()
            for _ in range(calls):
                len(data)
            best = min(best, (wrapped_seconds - (perf_counter() - began)) / calls)
        self.residual = max(0.0, best)

    @contextmanager
    def installed(self) -> Iterator["GilClock"]:
        """Wrap the releasing calls for the duration."""
        preadv, crc32, copy = os.preadv, zlib_ng.crc32, torch.Tensor.copy_
        decompressor = at_rest.decompressor
        clock = self

        def timed_decompressor() -> Any:
            dctx = decompressor()
            return clock.wrap(lambda: _TimedZstd(dctx, clock)) if threading.get_ident() in clock._readers else dctx

        os.preadv = self.timed(preadv)
        zlib_ng.crc32 = self.timed(crc32)
        torch.Tensor.copy_ = self.timed(copy)
        at_rest.decompressor = timed_decompressor
        try:
            yield self
        finally:
            os.preadv, zlib_ng.crc32, at_rest.decompressor = preadv, crc32, decompressor
            del torch.Tensor.copy_  # back to the method torch.Tensor inherits

    @contextmanager
    def gate(self, pool: ThreadPoolExecutor) -> Iterator[None]:
        """Hold the reader back while the block submits its tasks (timed as the driver's), so that neither waits
        for the GIL the other holds."""
        opened = threading.Event()
        ThreadPoolExecutor.submit(pool, opened.wait)
        began = perf_counter()
        try:
            yield
        finally:
            self.driver_seconds += perf_counter() - began
            opened.set()


class TimedPool(ThreadPoolExecutor):
    """One reader thread whose every task is timed by ``clock``."""

    def __init__(self, clock: GilClock):
        super().__init__(1, initializer=clock.enter)
        self.clock = clock

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        return super().submit(self.clock.run_task, fn, *args, **kwargs)


def _frames_in(source: Any) -> int:
    """How many zstd frames a buffer holds back to back (bytes after them that are not a frame count for none)."""
    view, count, cursor = memoryview(source), 0, 0
    while cursor < len(view):
        try:
            cursor += at_rest.frame_compressed_size(view[cursor:])
        except at_rest.AtRestError:
            break
        count += 1
    return max(count, 1)


class _TimedZstd:
    """A zstd context whose inflating calls are timed by ``clock``."""

    def __init__(self, dctx: Any, clock: GilClock):
        self._dctx = dctx
        self._clock = clock

    def stream_reader(self, source: Any, *args: Any, **kwargs: Any) -> Any:
        reader = self._dctx.stream_reader(source, *args, **kwargs)
        return self._clock.wrap(lambda: _TimedReader(reader, source, self._clock))

    def decompress(self, data: Any, *args: Any, **kwargs: Any) -> Any:
        return self._clock.call(perf_counter(), 1, self._dctx.decompress, data, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._dctx, name)


class _TimedReader:
    """A zstd stream reader whose ``readinto`` counts one GIL release per frame of its input (the staging paths call
    it once per reader, for all of its input)."""

    def __init__(self, reader: Any, source: Any, clock: GilClock):
        self._reader = reader
        self._source = source
        self._clock = clock

    def readinto(self, out: Any) -> int:
        entered = perf_counter()
        return self._clock.call(entered, _frames_in(self._source), self._reader.readinto, out)

    def read(self, size: int = -1) -> bytes:
        return self._clock.call(perf_counter(), 0, self._reader.read, size)



# --- copyrate: Same-run copy ceilings for the GPU benchmarks: how fast this machine moves bytes from pinned host
# memory to the
# device, timed with CUDA events, so that every figure can be read against the link it crossed.
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



# --- procstatus: The memory counters of this process from ``/proc/self/status`` (Linux), in bytes, for the benchmarks.

COUNTERS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def memory_status() -> dict[str, int]:
    """Resident set now (``VmRSS``), its high-water mark (``VmHWM``) and its anonymous, file and shared parts."""
    found = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in COUNTERS:
                found[key] = int(value.split()[0]) * 1024
    return found



# --- peer loaders: Other projects' fastest ways from a safetensors file to CUDA tensors, each as one function, for
# the same-run peer
# rows of ``bench/load.py``.
#
# Every loader takes the file's path and returns ``{name: tensor on the current CUDA device}``, owning its memory, so
# that it can be timed and checked bit for bit like ``szformat.load_file(..., device="cuda")``. Each is written the
# way its project documents it, with its defaults unless named:
#
# ==========================  ======================================================================================
# ``safetensors``             ``safetensors.torch.load_file(path, device="cuda")``
# ``instanttensor``           InstantTensor ``safe_open(...).tensors()``, default backend (io_uring or AIO direct I/O
#                             on a disk file, mmap on tmpfs)
# ``instanttensor-buffered``  the same with ``backend=BackendPolicy.BUFFERED`` (buffered io_uring, else mmap)
# ``fastsafetensors``         ``fastsafe_open(path, device="cuda:N", nogds=True)`` (pread through a bounce buffer)
# ``runai``                   Run:ai Model Streamer ``SafetensorsStreamer.stream_file(path, device="cuda:N")``
# ==========================  ======================================================================================

PeerLoader = Callable[[Path], dict[str, torch.Tensor]]


def _device() -> str:
    return f"cuda:{torch.cuda.current_device()}"


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path, device=_device())


def instanttensor(buffered: bool) -> PeerLoader:
    def load(path: Path) -> dict[str, torch.Tensor]:
        from instanttensor import BackendPolicy, safe_open

        backend = BackendPolicy.BUFFERED if buffered else None
        with safe_open(str(path), framework="pt", device=torch.cuda.current_device(), backend=backend) as f:
            return dict(f.tensors())

    return load


def load_fastsafetensors(path: Path) -> dict[str, torch.Tensor]:
    from fastsafetensors import fastsafe_open

    with fastsafe_open(str(path), framework="pt", device=_device(), nogds=True) as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def load_runai(path: Path) -> dict[str, torch.Tensor]:
    from runai_model_streamer import SafetensorsStreamer

    with SafetensorsStreamer() as streamer:
        streamer.stream_file(str(path), device=_device())
        return dict(streamer.get_tensors())


PEERS: dict[str, tuple[str, PeerLoader]] = {
    "safetensors": ("safetensors", load_safetensors),
    "instanttensor": ("instanttensor", instanttensor(buffered=False)),
    "instanttensor-buffered": ("instanttensor", instanttensor(buffered=True)),
    "fastsafetensors": ("fastsafetensors", load_fastsafetensors),
    "runai": ("runai_model_streamer", load_runai),
}
"""Peer name -> (the module it imports, its loader)."""


def available_peers(names: list[str]) -> tuple[dict[str, PeerLoader], dict[str, str]]:
    """The loaders of ``names`` whose package imports here, and for each other one the reason it is skipped."""
    loaders, skipped = {}, {}
    for name in names:
        module, load = PEERS[name]
        try:
            importlib.import_module(module)
        except Exception as error:  # an installed package can fail at import too (a missing native library)
            skipped[name] = f"import {module} failed: {type(error).__name__}: {error}"
        else:
            loaders[name] = load
    return loaders, skipped
