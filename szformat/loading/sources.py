"""Where the stored bytes of a load come from on the host: threaded reads into the staging slots
(:class:`ReadSource`), the registered page-cache mapping itself (:class:`MappedSource`), and, for files stored at
rest (.szt 1.1), reader threads inflating straight into the slots (:class:`InflatingSource`).

The device route moves in-memory SplitZip payloads and decodes them on the device. For a file whose payloads went
through the at-rest stage, the in-memory form exists nowhere on the host: :class:`InflatingSource` lays it out on a
line of its own (each tensor's in-memory payload at the next multiple of :data:`LINE_ALIGNMENT`), hands the route
entries that describe that line, and fills each slot from it by inflating, on the reader threads, the frames the
slot holds (stored bytes that went through no stage are copied). The route, its batching, its copies and its
decodes stay as they are.

Reader threads run side by side only while they hold no GIL, so every byte is moved by a call that releases it: the
stored bytes are read with ``pread`` (verbatim streams straight into the slot, each run of frames into a buffer of
the thread's own with one read), frames are inflated by zstd, a run with one reader. What runs with the GIL held
is kept short and rare, since on a many-core host it runs one thread at a time and every call that releases the
GIL is one more wait to take it back: a task handles its bytes as memoryviews (a torch call holds the GIL tens of
microseconds once a large read has left the caches cold), and takes the GIL back about once per 1 MiB frame and
once per read (``bench/at_rest.py --staging`` measures both).
"""

from __future__ import annotations

import bisect
import dataclasses
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, Sequence

import torch

from ..checksum import crc32
from ..format import at_rest
from ..format.header import TensorEntry
from ..format.payloads import payload_errors
from ..format.reader import SztFile
from .hostio import FileReader, RegisteredMapping, Staged
from .plan import Transfer
from .ring import Slot
from .stored_crc import StoredCrcCheck

__all__ = ["HostSource", "ReadSource", "MappedSource", "InflatingSource", "LINE_ALIGNMENT"]

LINE_ALIGNMENT = 256
"""In-memory payloads start at multiples of this on the line (the streams inside a payload are 4-byte aligned)."""

PIECE_BYTES = 8 << 20
"""In-memory bytes one reader-thread task produces at most: a large tensor is inflated by several threads (a slot
of 128 MiB makes 16 tasks). Tasks are cut at multiples of it within each payload, so (frames being
``DEFAULT_FRAME_SIZE`` from the payload's start) no frame of ``pk`` is shared by two tasks and inflated twice. 8 MiB
rather than 4: half the tasks, each with its fixed Python (one reader held the GIL 5.6 ms per 0.7 GB against 6.7;
16 MiB would leave fewer tasks per slot than the H200 host's 12 readers; ``bench/RESULTS.md``)."""

FRAME_BUFFER_LIMIT = at_rest.MAX_FRAME_SIZE
"""A task's run of stored frames longer than the longest content a frame may have (frames of valid zstd, but odd:
a task's frames hold at most ``PIECE_BYTES`` of content) is read from the file's mapping instead of into a thread's
buffer, which therefore never grows past this."""


class HostSource(Protocol):
    """Where the stored bytes of one file come from on the host."""

    host_writes: bool
    """Whether staging reads the bytes into the slot's host buffer on host threads (then a slot is refilled only
    after a host wait, and a check can ride along with the reads)."""

    def stage(self, transfer: Transfer, slot: Slot, *, verify: StoredCrcCheck | None = None, k: int = -1) -> Staged:
        """Start making file bytes ``[transfer.start, transfer.start + transfer.nbytes)`` available to copy from.

        ``verify`` takes the CRC-32 of the stored bytes on the reader thread that has just read them (sources with
        ``host_writes``); the transfer's piece items index its entries."""

    def close(self) -> None:
        """Release the file; every copy out of it must have completed."""


class ReadSource:
    """Threaded reads of the file into the slot's pinned buffer."""

    host_writes = True

    def __init__(self, reader: FileReader):
        self.reader = reader

    def stage(self, transfer: Transfer, slot: Slot, *, verify: StoredCrcCheck | None = None, k: int = -1) -> Staged:
        then = None if verify is None else (lambda start, piece: verify.add(transfer, start, piece))
        return self.reader.read_into(transfer.start, slot.host[: transfer.nbytes], then=then, k=k)

    def close(self) -> None:
        self.reader.close()


class MappedSource:
    """The registered page-cache mapping itself: each span is registered on ``pool`` just ahead of its copy, and
    the copy DMAs straight from it."""

    host_writes = False

    def __init__(self, mapping: RegisteredMapping, pool: ThreadPoolExecutor):
        self.mapping = mapping
        self.pool = pool

    def stage(self, transfer: Transfer, slot: Slot, *, verify: StoredCrcCheck | None = None, k: int = -1) -> Staged:
        if verify is not None:
            raise ValueError("the registered page cache is not read on the host: nothing can ride along")
        stop = transfer.start + transfer.nbytes
        return Staged(self.mapping.view[transfer.start: stop],
                      [self.mapping.register_async(transfer.start, stop, self.pool)])

    def close(self) -> None:
        self.mapping.close()



class InflatingSource:
    """The in-memory form of an open at-rest file, produced into staging slots by ``pool``.

    Args:
        file (`SztFile`): the open file; stays open while the source is used.
        pool (`ThreadPoolExecutor`): the reader threads.
    """

    host_writes = True

    def __init__(self, file: SztFile, pool: ThreadPoolExecutor):
        self.file = file
        self.pool = pool
        self._memory: dict[str, TensorEntry] = {}
        cursor = 0
        for entry in file.header.tensors:
            cursor = -(-cursor // LINE_ALIGNMENT) * LINE_ALIGNMENT
            self._memory[entry.name] = dataclasses.replace(entry, offset=cursor, length=entry.memory_length,
                                                           at_rest=None, blocks=None)
            cursor += entry.memory_length
        self._line = list(self._memory.values())
        self._starts = [e.offset for e in self._line]
        self._segments = {e.name: e.segments() for e in file.header.tensors
                          if e.at_rest is not None}  # the header parse checked them; computed once per file
        self._segment_starts = {name: [seg.memory for seg in pieces] for name, pieces in self._segments.items()}
        self._buffers = threading.local()

    def memory_entries(self, entries: Sequence[TensorEntry]) -> list[TensorEntry]:
        """``entries`` of the file as the route sees them: offsets and lengths on the in-memory line. (Their
        ``crc32`` still checks the stored bytes: pass a :class:`StoredCrcCheck` of the file's own entries to
        :meth:`stage`.)"""
        return [self._memory[e.name] for e in entries]

    def stage(self, transfer: Transfer, slot: Slot, *, verify: StoredCrcCheck | None = None, k: int = -1) -> Staged:
        """Inflate the in-memory bytes of ``transfer`` into the slot, in tasks on the reader threads. With
        ``verify`` each task also takes the CRC-32 of the stored bytes it has just read (a frame in the task where
        it starts), so the stored bytes are read once, checks or not."""
        out = slot.host[: transfer.nbytes]
        view = memoryview(out.numpy())
        futures = []
        for piece in transfer.pieces:
            line_offset = transfer.start + piece.slot_offset - piece.offset  # where the tensor starts on the line
            entry = self._line[bisect.bisect_right(self._starts, line_offset) - 1]  # (empty tensors come first)
            a, hi = piece.offset, piece.offset + piece.length
            while a < hi:
                b = min((a // PIECE_BYTES + 1) * PIECE_BYTES, hi)
                target = view[piece.slot_offset + a - piece.offset: piece.slot_offset + b - piece.offset]
                futures.append(self.pool.submit(self._fill, entry.name, a, target, piece.item, verify))
                a = b
        return Staged(out, futures)

    def _fill(self, name: str, start: int, out: memoryview, item: int, verify: StoredCrcCheck | None) -> None:
        """In-memory bytes ``[start, start + len(out))`` of tensor ``name`` (``item`` of ``verify``) into ``out``."""
        stored = _FileBytes(self, name, start, item, verify)
        pieces = self._segments.get(name)
        if pieces is None:  # stored as it is in memory
            stored.copy_into(start, out)
            return
        first = max(0, bisect.bisect_right(self._segment_starts[name], start) - 1)
        with payload_errors(self.file.path, name):
            at_rest.inflate_segments(stored, pieces, out, start=start, first=first)

    def _frame_buffer(self, nbytes: int) -> memoryview:
        """This thread's buffer for stored frames, at least ``nbytes`` long (not zeroed: a ``bytearray`` would
        write it all while holding the GIL; its pages are first touched by ``pread``, which releases it)."""
        buffer = getattr(self._buffers, "frames", None)
        if buffer is None or len(buffer) < nbytes:
            buffer = torch.empty(max(nbytes, PIECE_BYTES), dtype=torch.uint8)
            buffer = self._buffers.frames = memoryview(buffer.numpy())
        return buffer

    def close(self) -> None:
        """Nothing to release: the file belongs to the caller."""


class _FileBytes:
    """:class:`at_rest.StoredBytes` of one tensor for one task (from in-memory byte ``start``), read from the file
    with ``pread`` (as the in-memory form is read): verbatim streams straight into the slot, each run of frames into
    the reading thread's buffer in one read. With ``verify``, the CRC-32 of what it reads (of a frame only in the
    task where it starts)."""

    def __init__(self, source: InflatingSource, name: str, start: int, item: int, verify: StoredCrcCheck | None):
        self.source = source
        self.name = name
        self.length = source.file.entry(name).length
        self.start = start
        self.item = item
        self.verify = verify

    def copy_into(self, start: int, out: memoryview) -> None:
        self.source.file.readinto(self.name, start, out)
        if self.verify is not None:
            self.verify.add_part(self.item, start, len(out), crc32(out))

    def frames(self, run: Sequence[at_rest.Segment]) -> memoryview:
        start, stop = run[0].stored, run[-1].stored + run[-1].stored_length
        if stop - start > FRAME_BUFFER_LIMIT:
            view = memoryview(self.source.file.payload(self.name)[start:stop].numpy())
        else:
            view = self.source._frame_buffer(stop - start)[: stop - start]
            self.source.file.readinto(self.name, start, view)
        if self.verify is not None and run[0].memory >= self.start:
            self.verify.add_part(self.item, start, len(view), crc32(view))
        return view
