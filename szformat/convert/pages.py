"""Keep a streaming pass over a mapped file from growing the process: drop each tensor's pages once it is done.

Pages of a file mapping that the process has touched count in its resident set until they are unmapped, so reading
a 20 GB checkpoint tensor by tensor through one mapping would end with 20 GB resident. ``MADV_DONTNEED`` on a
read-only shared mapping releases them from this process only: the data stays in the page cache, and reading the
range again faults it back in.
"""

from __future__ import annotations

import mmap


def drop_pages(mapping: mmap.mmap, offset: int, length: int) -> None:
    """Release the pages of ``mapping`` that hold ``[offset, offset + length)``; a no-op where ``madvise`` is absent
    (Windows)."""
    if length <= 0 or not hasattr(mmap, "MADV_DONTNEED") or mapping.closed:
        return
    start = offset - offset % mmap.PAGESIZE
    stop = min(offset + length, len(mapping))
    if stop > start:
        mapping.madvise(mmap.MADV_DONTNEED, start, stop - start)
