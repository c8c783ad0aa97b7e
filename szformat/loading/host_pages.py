"""Fresh CPU memory for decoded tensors, faulted in as transparent huge pages where asked for
(``SZFORMAT_HUGE_PAGES=1``).

Every byte a CPU load returns lands in memory nobody wrote before, and the kernel hands it out a page at a time on
first write: a fault and a zeroed page per 4 KiB. Linux maps 2 MiB pages instead for a range advised
``MADV_HUGEPAGE`` where ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (most distributions' default)
or ``always``. Whether that pays depends on the machine, by a wide margin (``bench/RESULTS.md``, "CPU loading"): on
the H200 hosts, whose memory is all backed (a GPU passed through pins it), a new 1 GiB buffer was written in
37-58 ms advised against 51-86 ms in 4 KiB pages; on a 2-core cloud VM whose memory its host backs on first touch,
a new 512 MB buffer took 40-600 ms advised against 104-132 ms, and vLLM's weight loading phase 2.8-3.2x
safetensors' against 1.25-1.33x. So the advice is off by default, as safetensors and PyTorch leave it (PyTorch
offers it for all its CPU allocations behind ``THP_MEM_ALLOC_ENABLE=1``); ``SZFORMAT_HUGE_PAGES=1`` turns it on
where a measurement (``python -m bench.cpu --sections first``) says it helps.

Only the 2 MiB-aligned pages inside a tensor about to be written whole are advised, so no memory is mapped that
would not be written anyway; the advice never changes a byte, and where it is refused (another OS, THP compiled
out, memory the kernel will not advise) the pages stay 4 KiB.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
from functools import cache
from typing import Callable, Sequence

import torch

__all__ = ["HUGE_PAGE_BYTES", "advise_huge_pages", "empty"]

HUGE_PAGE_BYTES = 2 << 20
"""The transparent huge page size of x86-64 and of arm64 with 4 KiB base pages."""


@cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise``, where the advice is turned on (``SZFORMAT_HUGE_PAGES=1``) and there is a
    ``MADV_HUGEPAGE`` to give it (Linux)."""
    if (os.environ.get("SZFORMAT_HUGE_PAGES", "0") != "1" or not sys.platform.startswith("linux")
            or not hasattr(mmap, "MADV_HUGEPAGE")):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def advise_huge_pages(tensor: torch.Tensor) -> int:
    """Advise huge pages for the 2 MiB-aligned pages inside a contiguous CPU tensor's bytes, before they are first
    written; returns the bytes advised (0 where nothing was: turned off, too small, another OS, the advice
    refused)."""
    size = tensor.numel() * tensor.element_size()
    if size < HUGE_PAGE_BYTES:  # holds no whole huge page: most of a model's tensors, asked first as the cheapest
        return 0
    madvise = _madvise()
    if madvise is None or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0
    begin = tensor.data_ptr()
    first = -(-begin // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    last = (begin + size) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if last <= first or madvise(first, last - first, mmap.MADV_HUGEPAGE) != 0:
        return 0
    return last - first


def empty(size: int | Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor (as ``torch.empty(size, dtype=dtype)``) that the caller writes whole, its pages advised huge
    (:func:`advise_huge_pages`)."""
    tensor = torch.empty(size, dtype=dtype)
    advise_huge_pages(tensor)
    return tensor
