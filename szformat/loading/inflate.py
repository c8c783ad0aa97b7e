"""A host source for files stored at rest (.szt 1.1): the reader threads inflate straight into the staging slots.

The device route moves in-memory SplitZip payloads and decodes them on the device. For a file whose payloads went
through the at-rest stage, the in-memory form exists nowhere on the host: :class:`InflatingSource` lays it out on a
line of its own (each tensor's in-memory payload at the next multiple of :data:`LINE_ALIGNMENT`), hands the route
entries that describe that line, and fills each slot from it by inflating, on the reader threads, the frames the
slot holds (stored bytes that went through no stage are copied). The route, its batching, its copies and its
decodes stay as they are.
"""

from __future__ import annotations

import bisect
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from ..errors import PayloadError
from ..format import at_rest
from ..format.header import TensorEntry
from ..format.reader import SztFile
from .hostio import Staged
from .plan import Transfer
from .ring import Slot

__all__ = ["InflatingSource", "LINE_ALIGNMENT"]

LINE_ALIGNMENT = 256
"""In-memory payloads start at multiples of this on the line (the streams inside a payload are 4-byte aligned)."""

PIECE_BYTES = 4 << 20
"""In-memory bytes one reader-thread task produces at most: a large tensor is inflated by several threads."""


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
                                                           at_rest=None)
            cursor += entry.memory_length
        self._line = list(self._memory.values())
        self._starts = [e.offset for e in self._line]

    def memory_entries(self, entries: Sequence[TensorEntry]) -> list[TensorEntry]:
        """``entries`` of the file as the route sees them: offsets and lengths on the in-memory line. (Their
        ``crc32`` still checks the stored bytes; the loader checks those apart.)"""
        return [self._memory[e.name] for e in entries]

    def stage(self, transfer: Transfer, slot: Slot, *, then=None, k: int = -1) -> Staged:
        if then is not None:
            raise ValueError("in-memory bytes are made, not read: checks of the stored bytes run apart")
        out = slot.host[: transfer.nbytes]
        start, stop = transfer.start, transfer.start + transfer.nbytes
        futures = []
        for i in range(max(0, bisect.bisect_right(self._starts, start) - 1), len(self._line)):
            entry = self._line[i]
            if entry.offset >= stop:
                break
            lo, hi = max(start, entry.offset) - entry.offset, min(stop, entry.offset + entry.length) - entry.offset
            for a in range(lo, hi, PIECE_BYTES):
                b = min(a + PIECE_BYTES, hi)
                target = out[entry.offset + a - start: entry.offset + b - start]
                futures.append(self.pool.submit(self._fill, entry.name, a, b, target))
        return Staged(out, futures)

    def _fill(self, name: str, start: int, stop: int, out: torch.Tensor) -> None:
        """In-memory bytes ``[start, stop)`` of tensor ``name`` into ``out``."""
        entry = self.file.entry(name)
        stored = self.file.payload(name)
        if entry.at_rest is None:
            out.copy_(stored[start:stop])
            return
        try:
            at_rest.inflate(stored, entry.layout, entry.at_rest, out, start=start, stop=stop)
        except at_rest.AtRestError as e:
            raise PayloadError(str(e), path=self.file.path, tensor=name) from None

    def close(self) -> None:
        """Nothing to release: the file belongs to the caller."""
