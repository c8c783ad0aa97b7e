"""Host side of the transfers: threaded reads into pinned slots, or the page cache itself registered for DMA.

One thread reading a page-cached file into pinned memory moves a few GB/s; sixteen reach about 40 GB/s on the H200
host, so a span is cut into pieces read in parallel with ``preadv`` (the GIL is released while the kernel copies).
Alternatively, a file mapped ``MAP_SHARED``/``PROT_READ`` can be registered with ``cudaHostRegister(...,
cudaHostRegisterReadOnly)``: copies then DMA straight out of the page cache with no host copy, but pinning the pages
costs more than reading them (about 18 GB/s there) and unpinning them more again, so it pays only for a file read
more than once. Spans are registered just before their copies, on worker threads, so pinning overlaps the DMA of
earlier spans. A private (copy-on-write) mapping must never be registered that way (the call can hang), so this
module makes its own shared read-only mapping rather than accepting one.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Sequence

import torch

from ..errors import TruncatedFileError
from ..format.reader import pread_exactly
from . import ops, timeline

__all__ = ["Staged", "FileReader", "RegisteredMapping", "default_threads"]

MIN_READ_PIECE = 4 << 20
"""A span is split across threads only into pieces of at least this many bytes: on the H200 host 2 MiB pieces read
1.8x slower than 4 MiB ones (Python and a thread hand-off per piece)."""

CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_HOST_REGISTER_READ_ONLY = 8


def default_threads() -> int:
    """Reader threads: twelve, or the host's cores if fewer. Sixteen read a page-cached file alone a little faster
    on the H200 host, but inside a load twelve finished sooner, leaving cores to the threads that drive it."""
    return max(1, min(12, os.cpu_count() or 1))


class Staged:
    """Host bytes of one transfer, ready once every read behind them has finished."""

    def __init__(self, value: torch.Tensor, futures: Sequence[Future] = ()):
        self._value = value
        self._futures = list(futures)

    def result(self) -> torch.Tensor:
        """Wait for the reads (re-raising the first failure) and return the staged bytes."""
        for future in self._futures:
            future.result()
        return self._value

    def settle(self) -> None:
        """Wait for the reads, ignoring failures (before the buffer they write is dropped)."""
        for future in self._futures:
            future.exception()


class FileReader:
    """Reads byte ranges of one file into host buffers, spread over a thread pool.

    Args:
        path (`str` or `os.PathLike`): the file.
        pool (`ThreadPoolExecutor`): the threads that read.
        threads (`int`): how many pieces a large range is cut into (the pool's size).
    """

    def __init__(self, path: str | os.PathLike, pool: ThreadPoolExecutor, threads: int):
        self.path = Path(path)
        self._pool = pool
        self._threads = max(1, threads)
        self._fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        try:
            self._size = os.fstat(self._fd).st_size
            self._mmap = None if hasattr(os, "preadv") else mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        except BaseException:  # no reader is returned, so nobody else could close the descriptor
            os.close(self._fd)
            raise

    def read_into(self, offset: int, out: torch.Tensor, *, then: Callable[[int, torch.Tensor], None] | None = None,
                  k: int = -1) -> Staged:
        """Start reading ``out.numel()`` bytes at ``offset`` into ``out`` (flat uint8 CPU); returns at once.

        ``then(start, piece)``, if given, runs on the reader thread right after each piece is read (``piece`` is
        ``out[start: start + len]``), while its bytes are still in that core's cache. ``k`` tags the pieces in a
        :mod:`timeline` being recorded.
        """
        nbytes = out.numel()
        if offset < 0 or offset + nbytes > self._size:
            raise TruncatedFileError(f"range [{offset}, {offset + nbytes}) is outside the file of {self._size} bytes",
                                     path=self.path)
        parts = max(1, min(self._threads, nbytes // MIN_READ_PIECE))
        step = -(-nbytes // parts)
        step = -(-step // 4096) * 4096
        recording = timeline.current()
        futures = [self._pool.submit(self._read_piece, offset + a, out[a: a + step], a, then, recording, k)
                   for a in range(0, nbytes, step)]
        return Staged(out, futures)

    def _read_piece(self, offset: int, out: torch.Tensor, start: int, then: Callable[[int, torch.Tensor], None] | None,
                    recording: timeline.Timeline | None, k: int) -> None:
        began = recording.now() if recording is not None else 0.0
        self._read(offset, out)
        if recording is not None:
            recording.add("read", k, began, recording.now(), out.numel())
        if then is not None:
            began = recording.now() if recording is not None else 0.0
            then(start, out)
            if recording is not None:
                recording.add("crc", k, began, recording.now(), out.numel())

    def _read(self, offset: int, out: torch.Tensor) -> None:
        if self._mmap is not None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only mapping: torch warns that the view is not writable
                out.copy_(torch.frombuffer(self._mmap, dtype=torch.uint8, count=out.numel(), offset=offset))
            return
        pread_exactly(self._fd, out, offset, path=self.path)

    def close(self) -> None:
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class RegisteredMapping:
    """A whole file mapped shared and read-only, registered with the CUDA driver span by span, so copies DMA
    straight from the page cache.

    Pinning a span's pages costs more than copying them, so a span is registered just before it is copied
    (:meth:`register_async`, on worker threads) and the registration of later spans overlaps the copies of earlier
    ones; spans stay registered (and are reused by later copies of the same span) until :meth:`close`.

    Use :meth:`open`, which returns ``None`` (and leaves no CUDA error behind) where the platform or the driver says
    no. A span that cannot be registered (it overlaps another one) is still copied correctly, through the driver's
    pageable path.
    """

    def __init__(self, path: Path, fd: int, mapping: mmap.mmap, view: torch.Tensor, cudart: ctypes.CDLL,
                 device_index: int):
        self.path = path
        self._fd = fd
        self._mmap = mapping
        self.view = view
        """The whole file as a flat uint8 tensor the device can copy from asynchronously."""
        self._cudart = cudart
        self._device_index = device_index
        self._spans: dict[tuple[int, int], Future] = {}

    @classmethod
    def open(cls, path: str | os.PathLike, device: torch.device) -> "RegisteredMapping | None":
        if os.name != "posix" or device.type != "cuda" or not torch.cuda.is_available():
            return None
        cudart = ops.cudart()
        if cudart is None:
            return None
        path = Path(path)
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size == 0:
                os.close(fd)
                return None
            if hasattr(os, "posix_fadvise"):  # start reading a cold file before pinning it (POSIX only)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
            mapping = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)  # MAP_SHARED + PROT_READ on POSIX
        except BaseException:
            os.close(fd)
            raise
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only mapping: torch warns that the view is not writable
            view = torch.frombuffer(mapping, dtype=torch.uint8)
        index = device.index if device.index is not None else torch.cuda.current_device()
        self = cls(path, fd, mapping, view, cudart, index)
        with torch.cuda.device(index):  # does the driver take this mapping at all? (one page)
            taken = self._register(0, min(size, mmap.PAGESIZE), set_device=False)
            if taken and cudart.cudaHostUnregister(ctypes.c_void_p(view.data_ptr())) != 0:
                cudart.cudaGetLastError()
                taken = False
        if not taken:
            self.close()
            return None
        return self

    def register_async(self, start: int, stop: int, pool: ThreadPoolExecutor) -> Future:
        """Register bytes ``[start, stop)`` (widened to whole pages) on ``pool``, unless that span already is.

        The future's result says whether the span is registered; copies are correct either way.
        """
        page = mmap.PAGESIZE
        span = (start // page * page, min(-(-stop // page) * page, self.view.numel()))
        future = self._spans.get(span)
        if future is None:
            future = self._spans[span] = pool.submit(self._register, *span)
        return future

    def _register(self, start: int, stop: int, *, set_device: bool = True) -> bool:
        if set_device:  # a worker thread: make its context the device the copies go to
            self._cudart.cudaSetDevice(self._device_index)
        status = self._cudart.cudaHostRegister(ctypes.c_void_p(self.view.data_ptr() + start),
                                               ctypes.c_size_t(stop - start),
                                               CUDA_HOST_REGISTER_READ_ONLY | CUDA_HOST_REGISTER_PORTABLE)
        if status != 0:
            self._cudart.cudaGetLastError()  # clear it, or the next unrelated CUDA call reports it
        return status == 0

    def close(self) -> None:
        """Unregister and unmap. Every copy out of the mapping must have completed."""
        if self._mmap is None:
            return
        for (start, _), future in self._spans.items():
            if future.result() and self._cudart.cudaHostUnregister(
                    ctypes.c_void_p(self.view.data_ptr() + start)) != 0:
                self._cudart.cudaGetLastError()
        self._spans.clear()
        self.view = None
        self._mmap.close()
        self._mmap = None
        os.close(self._fd)
