"""Appending the bulk of a large output with direct I/O (``O_DIRECT``): its bytes bypass the page cache.

An output is written once and read by nobody while it is written. Through the page cache the kernel copies every
byte into a cache page it allocates and the file system tracks the page dirty until the final ``fsync`` writes it
out: on the 2-core build VM (ext4) 2 GiB cost 0.85-1.5 CPU-seconds and 2.0-2.5 s to write and fsync, against 0.08
CPU-seconds and 1.4 s with ``O_DIRECT`` (``bench/RESULTS.md``, "Conversion"). Direct writes also leave the user's page
cache alone (the checkpoint being converted above all) instead of filling it with dirty pages of an output that
nobody reads yet, and a conversion larger than memory is never throttled by the kernel's dirty-page limits.

How: the bytes appended are copied into one of two page-aligned staging buffers of :data:`STAGING_BYTES`; a full
buffer is written at its offset (a multiple of the buffer's size) by a thread of its own while the other fills, so
the disk writes while the codec encodes. The last buffer is zero-padded to :data:`BLOCK` and the file truncated to
its length. Direct I/O is asked of the file system, never assumed: where it refuses ``O_DIRECT`` (tmpfs before Linux
6.6, some network and FUSE file systems), or refuses a direct write with ``EINVAL``, the bytes go through the page
cache as before. Only Linux has ``O_DIRECT``; elsewhere nothing changes. ``SZFORMAT_DIRECT_IO=0`` turns it off.
"""

from __future__ import annotations

import errno
import mmap
import os
from concurrent.futures import Future, ThreadPoolExecutor

__all__ = ["BLOCK", "STAGING_BYTES", "DirectAppender"]

BLOCK = 4096
"""Alignment of every direct write's offset, length and memory: the largest logical block size disks report."""

STAGING_BYTES = 16 << 20
"""Bytes per staging buffer (two per output). With 4 MiB buffers `decompress` of a 2.2 GB file ran 3.1-3.5 s on the
build VM against 2.2-3.3 s with 16 MiB (a larger write keeps the disk busier while the next buffer fills); their
first touch (about 34 ms for the two on that VM) is why small outputs do not use them (``atomic.DIRECT_FROM_BYTES``)."""


def direct_io_enabled() -> bool:
    """Whether outputs may use direct I/O here: Linux, and not turned off with ``SZFORMAT_DIRECT_IO=0``."""
    return hasattr(os, "O_DIRECT") and os.environ.get("SZFORMAT_DIRECT_IO", "1") != "0"


def _set_direct(fd: int, on: bool) -> None:
    import fcntl

    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT if on else flags & ~os.O_DIRECT)


class DirectAppender:
    """Appends to an open file descriptor through direct I/O, from ``size`` bytes already written on.

    Made by :meth:`start`; :meth:`finish` writes what is left and returns the file to ordinary I/O; :meth:`close`
    gives the buffers back whatever happened. Errors of the writing thread (a full disk) are raised by the next
    :meth:`append` or by :meth:`finish`.
    """

    def __init__(self, fd: int, base: int, head: bytes):
        self._fd = fd
        self._base = base  # file offset of the staging buffer being filled
        self._buffers = [mmap.mmap(-1, STAGING_BYTES), mmap.mmap(-1, STAGING_BYTES)]
        self._current = 0
        self._fill = len(head)
        self._buffers[0][: self._fill] = head
        self._direct = True  # until a direct write is refused
        self._pending: Future | None = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="szformat-direct-io")

    @classmethod
    def start(cls, fd: int, size: int) -> DirectAppender | None:
        """Switch ``fd``, holding ``size`` bytes written through the page cache, to direct appends; ``None`` where
        direct I/O is off here or the file system refuses it (the caller goes on as before)."""
        if not direct_io_enabled():
            return None
        base = size - size % BLOCK
        head = os.pread(fd, size - base, base)  # the last partial block: written again from its start
        if len(head) != size - base:
            raise OSError(errno.EIO, f"read {len(head)} of the {size - base} bytes just written")
        try:
            _set_direct(fd, True)
        except OSError:
            return None
        return cls(fd, base, head)  # staging buffers refused: the caller's write error ends the file anyway

    def append(self, data) -> None:
        """Append ``data`` (any contiguous buffer)."""
        view = memoryview(data).cast("B")
        while view.nbytes:
            take = min(view.nbytes, STAGING_BYTES - self._fill)
            self._buffers[self._current][self._fill: self._fill + take] = view[:take]
            self._fill += take
            view = view[take:]
            if self._fill == STAGING_BYTES:
                self._hand_over(STAGING_BYTES)

    def finish(self) -> None:
        """Write what is left, truncate the file to the bytes appended and return it to ordinary I/O."""
        length = self._base + self._fill
        if self._fill:
            padded = -(-self._fill // BLOCK) * BLOCK
            self._buffers[self._current][self._fill: padded] = bytes(padded - self._fill)
            self._hand_over(padded)
        self._wait()
        os.ftruncate(self._fd, length)
        if self._direct:
            _set_direct(self._fd, False)

    def close(self) -> None:
        """Wait for a write in flight (it cannot be stopped) and give the buffers back; errors are not raised."""
        try:
            self._wait()
        except OSError:
            pass
        finally:
            self._thread.shutdown(wait=True)
            for buffer in self._buffers:
                try:
                    buffer.close()
                except BufferError:
                    pass  # still viewed by a failed write's traceback: unmapped when that goes

    def _hand_over(self, nbytes: int) -> None:
        """Have the thread write the current buffer's first ``nbytes`` at its offset; fill the other one meanwhile."""
        self._wait()
        self._pending = self._thread.submit(self._write, self._buffers[self._current], nbytes, self._base)
        self._current ^= 1
        self._base += nbytes
        self._fill = 0

    def _wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def _write(self, buffer: mmap.mmap, nbytes: int, offset: int) -> None:
        """Write ``buffer[:nbytes]`` at ``offset`` (on the thread); a refused direct write goes through the page
        cache, and so does every later one."""
        view = memoryview(buffer)[:nbytes]
        while view.nbytes:
            try:
                written = os.pwrite(self._fd, view, offset)
            except OSError as e:
                if e.errno != errno.EINVAL or not self._direct:
                    raise
                _set_direct(self._fd, False)
                self._direct = False
                continue
            view, offset = view[written:], offset + written
