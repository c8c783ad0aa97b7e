"""Fresh CPU memory for decoded tensors, faulted in as transparent huge pages where that pays.

Every byte a CPU load returns lands in memory nobody wrote before, and the kernel hands it out a page at a time on
first write: a fault and a zeroed page per 4 KiB. Linux maps 2 MiB pages instead for a range advised
``MADV_HUGEPAGE`` where ``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` (most distributions' default)
or ``always``: on the H200 hosts a new 1 GiB buffer was written in 37-58 ms advised against 51-86 ms in 4 KiB pages
(``bench/RESULTS.md``, "CPU loading").

Except in a virtual machine whose kernel reports its free memory to the hypervisor (a virtio balloon with free page
reporting, ``VIRTIO_BALLOON_F_REPORTING``, as Firecracker and QEMU offer): it reports free blocks of 2 MiB and more,
which the host then takes back, and those blocks are what huge pages are made of, so each one comes back through
512 faults of the host's. On such a 2-core VM a new 256 MB buffer took 195-533 ms advised once the memory had been
idle a few seconds, against 104-119 ms in 4 KiB pages (25 ms advised when written again right after the last was
freed, before the report), and vLLM's weight-loading phase 3.4x safetensors' against 1.3x. So by default the advice
is given unless a balloon device reports free pages (:func:`reports_free_pages`); ``SZFORMAT_HUGE_PAGES=1`` gives it
anyway and ``SZFORMAT_HUGE_PAGES=0`` never (``python -m bench.cpu --sections first`` times a fresh process's load).

Only the 2 MiB-aligned pages inside a tensor about to be written whole are advised, so no memory is mapped that
would not be written anyway; the advice never changes a byte, and where it is refused (another OS, THP compiled
out, memory the kernel will not advise) the pages stay 4 KiB.
"""

from __future__ import annotations

import ctypes
import glob
import mmap
import os
import sys
from functools import cache
from typing import Callable, Sequence

import torch

__all__ = ["HUGE_PAGE_BYTES", "advise_huge_pages", "empty", "reports_free_pages"]

HUGE_PAGE_BYTES = 2 << 20
"""The transparent huge page size of x86-64 and of arm64 with 4 KiB base pages."""

BALLOON_FEATURES = "/sys/bus/virtio/drivers/virtio_balloon/*/features"
"""The features each virtio balloon device negotiated, one character per feature bit (``1``: on)."""

FREE_PAGE_REPORTING_BIT = 5
"""``VIRTIO_BALLOON_F_REPORTING`` (virtio 1.2, section 5.5.3)."""


def reports_free_pages() -> bool:
    """Whether a virtio balloon device of this machine negotiated free page reporting: its kernel then hands the host
    the free blocks huge pages are made of."""
    for path in glob.glob(BALLOON_FEATURES):
        try:
            with open(path) as f:
                bits = f.read().strip()
        except OSError:
            continue
        if bits[FREE_PAGE_REPORTING_BIT: FREE_PAGE_REPORTING_BIT + 1] == "1":
            return True
    return False


@cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise``, where there is a ``MADV_HUGEPAGE`` to give it (Linux) and the advice pays: asked for
    (``SZFORMAT_HUGE_PAGES=1``), or not turned off (``0``) and no balloon device reports free pages."""
    setting = os.environ.get("SZFORMAT_HUGE_PAGES", "")
    if (setting == "0" or not sys.platform.startswith("linux") or not hasattr(mmap, "MADV_HUGEPAGE")
            or (setting != "1" and reports_free_pages())):
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
