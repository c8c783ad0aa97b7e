"""A streaming pass over a mapped file: each tensor's pages dropped once it is done, and the file's lost pages
read as zeros rather than killing the process.

Pages of a file mapping that the process has touched count in its resident set until they are unmapped, so reading
a 20 GB checkpoint tensor by tensor through one mapping would end with 20 GB resident. ``MADV_DONTNEED`` on a
read-only shared mapping releases them from this process only: the data stays in the page cache, and reading the
range again faults it back in.
"""

from __future__ import annotations

import mmap

from ..codec.cpu_kernel import native


def drop_pages(mapping: mmap.mmap, offset: int, length: int) -> None:
    """Release the pages of ``mapping`` that hold ``[offset, offset + length)``; a no-op where ``madvise`` is absent
    (Windows)."""
    if length <= 0 or not hasattr(mmap, "MADV_DONTNEED") or mapping.closed:
        return
    start = offset - offset % mmap.PAGESIZE
    stop = min(offset + length, len(mapping))
    if stop > start:
        mapping.madvise(mmap.MADV_DONTNEED, start, stop - start)


class CoveredMapping:
    """A read-only mapping of a file that reads as zeros from a page the file lost on (another process truncated
    it, or its disk failed) instead of ending the process with SIGBUS, whatever code reads it on whatever thread
    (``_native.cover_mapping``); :attr:`lost` says whether that happened, so the reader can refuse what it read.
    Where the C kernels do not cover mappings (another OS than Linux, no compiler), :meth:`of` gives ``None``."""

    def __init__(self, slot: int):
        self._slot: int | None = slot

    @classmethod
    def of(cls, mapping: mmap.mmap) -> CoveredMapping | None:
        """Cover ``mapping`` (until :meth:`close`), or ``None`` where that cannot be done here."""
        if native is None:
            return None
        with memoryview(mapping) as view:  # released at once: a view kept would stop the mapping from closing
            slot = native.cover_mapping(view)
        return None if slot is None else cls(slot)

    @property
    def lost(self) -> bool:
        """Whether a page could not be read (and read as zeros) since the mapping was covered."""
        return self._slot is not None and native.covered_faults(self._slot) > 0

    def close(self) -> None:
        """Stop covering; before the mapping is closed, once nothing reads it any more."""
        if self._slot is not None:
            native.uncover_mapping(self._slot)
            self._slot = None
