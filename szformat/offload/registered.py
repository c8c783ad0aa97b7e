"""Stored payloads in page-cache pages registered with the CUDA driver, for routes that upload them again and again.

An offloading route copies the same weights to the device at every forward. Copying them through a pinned staging
slot or a read ring costs a host copy each time (one thread moves a few GB/s); registering the file's pages once lets
every later copy DMA straight out of the page cache at the link's rate. Registering costs about as much as reading
the bytes once, paid at install, and keeps the stored bytes (not the raw ones) resident and pinned while the route
runs.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from ..loading.hostio import RegisteredMapping, default_threads

__all__ = ["RegisteredPages", "RUN_GAP_BYTES", "runs"]

RUN_GAP_BYTES = 64 << 10
"""Payloads of one file closer than this are registered, read and copied as one run, the bytes between them included:
padding between consecutive payloads is under a page, and a small tensor between two weights costs less than a
second copy."""


def runs(extents: Iterable[tuple[int, int]], gap: int = RUN_GAP_BYTES) -> list[tuple[int, int]]:
    """``[start, stop)`` byte ranges covering ``extents`` (``(offset, length)``), joining those closer than ``gap``."""
    merged: list[list[int]] = []
    for offset, length in sorted(extents):
        if merged and offset <= merged[-1][1] + gap:
            merged[-1][1] = max(merged[-1][1], offset + length)
        else:
            merged.append([offset, offset + length])
    return [(start, stop) for start, stop in merged]


class RegisteredPages:
    """The registered spans of some files: which byte ranges can be DMA'd straight out of the page cache.

    Use :meth:`register`, which registers what the driver accepts and leaves out what it refuses (a platform without
    registration, a span the driver declines): a range that is not registered is simply not offered by :meth:`view`,
    and the route takes its other way for it. :meth:`close` once no copy out of the pages is pending.
    """

    def __init__(self):
        self._mappings: dict[str, RegisteredMapping] = {}
        self._spans: dict[str, list[tuple[int, int]]] = {}

    @classmethod
    def register(cls, extents_by_file: dict[str, list[tuple[int, int]]], device: torch.device,
                 threads: int | None = None) -> "RegisteredPages":
        """Register, file by file, the runs of ``extents_by_file`` (file path -> ``(offset, length)`` of payloads)."""
        pages = cls()
        with ThreadPoolExecutor(threads or default_threads()) as pool:
            for path, extents in extents_by_file.items():
                mapping = RegisteredMapping.open(path, device)
                if mapping is None:
                    continue
                pages._mappings[str(path)] = mapping
                pending = [(span, mapping.register_async(*span, pool)) for span in runs(e for e in extents if e[1])]
                pages._spans[str(path)] = sorted(span for span, done in pending if done.result())
        return pages

    def view(self, path: str | os.PathLike, start: int, stop: int) -> torch.Tensor | None:
        """Bytes ``[start, stop)`` of file ``path`` as registered host memory, or None if they are not registered."""
        spans = self._spans.get(str(path), [])
        at = bisect.bisect_right(spans, (start, float("inf"))) - 1
        if at < 0 or not (spans[at][0] <= start and stop <= spans[at][1]):
            return None
        return self._mappings[str(path)].view[start: stop]

    def close(self) -> None:
        for mapping in self._mappings.values():
            mapping.close()
        self._mappings.clear()
        self._spans.clear()
