"""CRC-32 of each tensor's stored bytes, computed by the reader threads on the pieces they have just read.

Checking stored bytes in a second pass over the file costs as much CPU as reading them and competes with the reads
for memory bandwidth. Instead each reader thread takes the CRC-32 of the bytes it has just read into the staging
slot, while they are still in its cache. The pieces of one tensor are read in parallel and finish in any order, so
their CRCs are joined afterwards in file order with :func:`..checksum.crc32_combine` (the CRC of ``A + B`` from the
CRCs of ``A`` and ``B`` and the length of ``B``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Sequence

import torch

from ..checksum import crc32, crc32_combine
from ..errors import ChecksumMismatchError
from ..format.header import TensorEntry
from .plan import Transfer

__all__ = ["StoredCrcCheck"]

class StoredCrcCheck:
    """Checks every tensor's stored-bytes CRC-32 from pieces handed in by reader threads, in any order.

    Args:
        entries (sequence of `TensorEntry`): the tensors of one load; transfers' piece items index into it.
        path (`Path`): the file, for error messages.
    """

    def __init__(self, entries: Sequence[TensorEntry], path: Path):
        self._entries = entries
        self._path = path
        self._parts: list[list[tuple[int, int, int]]] = [[] for _ in entries]
        self._seen = [0] * len(entries)
        self._actual: dict[int, int] = {i: 0 for i, e in enumerate(entries) if e.length == 0}
        self._lock = threading.Lock()

    def add(self, transfer: Transfer, start: int, data: torch.Tensor) -> None:
        """Bytes ``[start, start + len(data))`` of ``transfer``'s slot were just read into ``data``: take the CRC of
        each tensor's part of them (the padding between tensors is skipped)."""
        buffer = data.numpy()
        stop = start + data.numel()
        for piece in transfer.pieces:
            lo, hi = max(start, piece.slot_offset), min(stop, piece.slot_offset + piece.length)
            if lo < hi:
                crc = crc32(buffer[lo - start: hi - start])
                self.add_part(piece.item, piece.offset + lo - piece.slot_offset, hi - lo, crc)

    def add_part(self, item: int, offset: int, length: int, crc: int) -> None:
        """The CRC-32 of stored bytes ``[offset, offset + length)`` of tensor ``item``: each byte once, any order."""
        with self._lock:
            self._parts[item].append((offset, length, crc))
            self._seen[item] += length
            complete = self._seen[item] == self._entries[item].length
        if complete:  # this thread brought the last piece: join them all (no other thread touches them now)
            parts = sorted(self._parts[item])
            crc, cursor = 0, 0
            for offset, length, part in parts:
                if offset != cursor:
                    raise RuntimeError(f"stored bytes of {self._entries[item].name} were checked out of order "
                                       f"({offset} after {cursor})")
                crc = crc32_combine(crc, part, length) if cursor else part
                cursor += length
            self._actual[item] = crc

    def check(self) -> None:
        """Raise for the first tensor (in load order) whose CRC differs from its header's, or that was not read."""
        self.check_items(range(len(self._entries)))

    def check_items(self, items: Sequence[int]) -> None:
        """:meth:`check` for ``items`` only (their pieces all read), before their bytes go where nothing would
        catch a corrupt byte (an inflater that validates little)."""
        for i in items:
            entry = self._entries[i]
            actual = self._actual.get(i)
            if actual is None:
                raise RuntimeError(f"stored bytes of {entry.name} were not all read ({self._seen[i]} of "
                                   f"{entry.length})")
            if actual != entry.crc32:
                raise ChecksumMismatchError(f"CRC-32 of the stored bytes is {actual:#010x}, the header records "
                                            f"{entry.crc32:#010x}", path=self._path, tensor=entry.name)
