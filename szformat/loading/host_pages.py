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

Whatever their size, the pages are then faulted in by the thread about to write them, in one call
(:func:`populate`, ``MADV_POPULATE_WRITE``, Linux 5.14) rather than one fault per page: on the 2-core VM, 500 MB
decoded into new parameters as vLLM's loader does took 297-316 ms so against 384-435 ms (safetensors' copy 296-324),
and a fresh process's first load of a 2.2 GB checkpoint on two threads 525-565 against 698-760 ms
(``bench/RESULTS.md``, "CPU loading"). Memory the process had written before is left as it is
(``SZFORMAT_POPULATE=0`` never populates).
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

__all__ = ["HUGE_PAGE_BYTES", "POPULATE_MIN_BYTES", "advise_huge_pages", "empty", "populate", "populated_size",
           "reports_free_pages"]

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
def _libc() -> ctypes.CDLL | None:
    """The C library's ``madvise`` and ``mincore``, typed (``None`` where they are not: another OS)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    except (OSError, AttributeError):
        return None
    libc.madvise.restype = libc.mincore.restype = ctypes.c_int
    return libc


@cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise``, where there is a ``MADV_HUGEPAGE`` to give it (Linux) and the advice pays: asked for
    (``SZFORMAT_HUGE_PAGES=1``), or not turned off (``0``) and no balloon device reports free pages."""
    setting = os.environ.get("SZFORMAT_HUGE_PAGES", "")
    libc = _libc()
    if (setting == "0" or libc is None or not hasattr(mmap, "MADV_HUGEPAGE")
            or (setting != "1" and reports_free_pages())):
        return None
    return libc.madvise


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


MADV_POPULATE_WRITE = 23
"""Linux 5.14: fault in a range's pages, writable, as writes to each would (an older kernel refuses it, EINVAL)."""

POPULATE_MIN_BYTES = 64 << 10
"""Tensors smaller than this are left to fault in on their own: a few pages, often shared with other allocations
and in memory already, where the two calls of :func:`populate` would cost about what they save."""


@cache
def _populating() -> ctypes.CDLL | None:
    """The C library, where pages are populated: Linux, not turned off (``SZFORMAT_POPULATE=0``), a kernel that
    knows ``MADV_POPULATE_WRITE``."""
    libc = _libc()
    if os.environ.get("SZFORMAT_POPULATE", "") == "0" or libc is None:
        return None
    return libc if libc.madvise(0, 0, MADV_POPULATE_WRITE) == 0 else None  # no pages: only whether it is known


def populate(tensor: torch.Tensor) -> bool:
    """Fault in the pages inside a contiguous CPU tensor's bytes, which the calling thread is about to write whole,
    in one call rather than one fault per page; returns whether it did. Memory whose first page is in memory already
    (what the process wrote before: glibc reuses freed memory) is left as it is, since walking present pages costs
    what it saves (2.3 ms of a 13 ms MiniLM load repeated in one process); so is a tensor whose pages the kernel
    will not populate (out of memory: its writes then fault as they would have)."""
    size = tensor.numel() * tensor.element_size()
    if size < POPULATE_MIN_BYTES or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    libc = _populating()
    if libc is None:
        return False
    begin = tensor.data_ptr()
    first = -(-begin // mmap.PAGESIZE) * mmap.PAGESIZE
    last = (begin + size) // mmap.PAGESIZE * mmap.PAGESIZE
    resident = ctypes.create_string_buffer(1)
    if last <= first or libc.mincore(first, mmap.PAGESIZE, resident) != 0 or resident.raw[0] & 1:
        return False
    return libc.madvise(first, last - first, MADV_POPULATE_WRITE) == 0


def populated_size() -> int:
    """The smallest tensor :func:`populate` populates, or 0 where it populates none: what the C kernels' batched
    decode (``codec.cpu.decode_payloads``) is told, which populates each output as :func:`populate` would, without
    the 6 us of Python and ``ctypes`` a call costs here (a tenth of a small tensor's load)."""
    return POPULATE_MIN_BYTES if _populating() is not None else 0


def empty(size: int | Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A new CPU tensor (as ``torch.empty(size, dtype=dtype)``) that the caller writes whole, its pages advised huge
    (:func:`advise_huge_pages`)."""
    tensor = torch.empty(size, dtype=dtype)
    advise_huge_pages(tensor)
    return tensor
