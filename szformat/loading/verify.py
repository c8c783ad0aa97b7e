"""CRC-32 of each tensor's stored bytes, computed by the reader threads on the pieces they have just read.

Checking stored bytes in a second pass over the file costs as much CPU as reading them and competes with the reads
for memory bandwidth. Instead each reader thread takes the CRC-32 of the bytes it has just read into the staging
slot, while they are still in its cache. The pieces of one tensor are read in parallel and finish in any order, so
their CRCs are joined afterwards in file order with :func:`crc32_combine` (the CRC of ``A + B`` from the CRCs of
``A`` and ``B`` and the length of ``B``), which Python's ``zlib`` does not offer: it is computed here in GF(2)
polynomial arithmetic modulo the CRC-32 polynomial, in the reflected bit order ``zlib`` uses.
"""

from __future__ import annotations

import functools
import threading
import zlib
from pathlib import Path
from typing import Sequence

import torch

from ..errors import ChecksumMismatchError
from ..format.header import TensorEntry
from .plan import Transfer

__all__ = ["crc32_combine", "StoredCrcCheck"]

_POLY = 0xEDB88320
"""The CRC-32 polynomial, reflected (bit 31 holds x^0)."""
_ONE = 1 << 31
"""The polynomial 1 in that order."""


def _multiply(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32 polynomial."""
    product = 0
    mask = _ONE
    while a:
        if a & mask:
            product ^= b
            a ^= mask
        mask >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1
    return product


@functools.lru_cache(maxsize=None)
def _shift_table(byte_index: int) -> tuple[int, ...]:
    """``x^(8 * v * 256**byte_index)`` modulo the polynomial for v = 0..255: shifting a CRC by ``v * 256**i`` bytes."""
    one_step = 1 << 30  # x^1
    for _ in range(3 + 8 * byte_index):  # x^(2^(3 + 8i)) = x^(8 * 256^i)
        one_step = _multiply(one_step, one_step)
    table = [_ONE]
    for _ in range(255):
        table.append(_multiply(table[-1], one_step))
    return tuple(table)


@functools.lru_cache(maxsize=4096)
def _shift(nbytes: int) -> int:
    """``x^(8 * nbytes)`` modulo the polynomial: appending ``nbytes`` bytes multiplies the CRC state by it."""
    result, index = _ONE, 0
    while nbytes:
        digit = nbytes & 0xFF
        if digit:
            result = _multiply(result, _shift_table(index)[digit])
        nbytes >>= 8
        index += 1
    return result


def crc32_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """``zlib.crc32(a + b)`` from ``crc_a = zlib.crc32(a)``, ``crc_b = zlib.crc32(b)`` and ``length_b = len(b)``."""
    if length_b < 0:
        raise ValueError(f"length must not be negative, got {length_b}")
    return _multiply(_shift(length_b), crc_a) ^ crc_b


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
                crc = zlib.crc32(buffer[lo - start: hi - start])
                self._add(piece.item, piece.offset + lo - piece.slot_offset, hi - lo, crc)

    def _add(self, item: int, offset: int, length: int, crc: int) -> None:
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
        for i, entry in enumerate(self._entries):
            actual = self._actual.get(i)
            if actual is None:
                raise RuntimeError(f"stored bytes of {entry.name} were not all read ({self._seen[i]} of "
                                   f"{entry.length})")
            if actual != entry.crc32:
                raise ChecksumMismatchError(f"CRC-32 of the stored bytes is {actual:#010x}, the header records "
                                            f"{entry.crc32:#010x}", path=self._path, tensor=entry.name)
