"""Which CPU kernels the codec runs: the C extension (``_native``, built by ``pip install`` where a C compiler is at
hand) or the PyTorch reference. Imports neither torch nor NumPy, so ``szconvert --version`` can say it at once."""

from __future__ import annotations

import array
import mmap
import os
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from .codebook import Codebook
    from .layout import PayloadLayout

__all__ = ["native", "KERNEL", "check_payloads", "checksums_in_kernel", "decode_payloads"]


def _load_native() -> ModuleType | None:
    """The C kernels, unless the package was built without them or ``SZFORMAT_CPU_CODEC=reference`` asks for the
    PyTorch loops."""
    if os.environ.get("SZFORMAT_CPU_CODEC", "") == "reference":
        return None
    try:
        from . import _native
    except ImportError:
        return None
    return _native


def checksums_in_kernel() -> bool:
    """Whether a checked range is decoded by one C call that also takes its CRC-32s block by block
    (``_native.decode_range_checked``): where the C kernels are built and zlib-ng exports its CRC-32 function. The
    function is handed to the kernels on the first call, not at import: ``szconvert --version`` imports this module
    and nothing else."""
    global _checksums_in_kernel
    if _checksums_in_kernel is None:
        _checksums_in_kernel = _hand_over_crc32(native)
    return _checksums_in_kernel


def _hand_over_crc32(kernels: ModuleType | None) -> bool:
    """Give the C kernels zlib-ng's CRC-32 function and the one that joins two CRC-32s, which they check before
    taking them; whether they took them."""
    if kernels is None:
        return False
    from ..checksum import crc32_function_address

    addresses = crc32_function_address("zng_crc32"), crc32_function_address("zng_crc32_combine")
    if None in addresses:
        return False
    try:
        kernels.use_crc32(*addresses)
    except ValueError:
        return False
    return True


def decode_payloads(kernels: ModuleType, payloads: Sequence[tuple[Any, PayloadLayout, Codebook, Any]], *,
                    checksums: bool, populate: int = 0, threads: int = 1, release: bool = False
                    ) -> list[tuple[int, int, str | None]]:
    """``kernels.decode_payloads`` of whole payloads ``(payload, layout, codebook, out)``, ``out`` a writable buffer
    of the layout's raw bytes: per payload ``(stored_crc, decoded_crc, error)``. Without torch; ``codec.cpu
    .decode_payloads`` says more. The call runs on up to ``threads`` threads of its own, the GIL released, each
    taking the next payload, or the next range of one of more than ``UNIT_ELEMENTS`` elements. Each output of at
    least ``populate`` bytes (0: none) whose first page is not in memory is faulted in by one call before it is
    written, as ``loading.host_pages.populate`` does. With ``release``, every payload a view of a read-only
    ``mmap`` (a file's mapping: checked), the pages each thread read are dropped from the process's page tables once
    decoded, so the mapping's close has next to nothing left to unmap.

    Raises:
        EOFError: a page of a payload could not be read; its ``item`` attribute says which payload.
        ValueError: ``release`` with a payload that is not a view of a read-only mapping.
    """
    _check_released(payloads, release)
    items = [(payload, bytes(codebook.dec_lut), out, layout.n_esc, layout.chunk_size)
             for payload, layout, codebook, out in payloads]
    return _item_by_item(lambda progress: kernels.decode_payloads(items, checksums, progress, populate, threads,
                                                                  release))


RELEASE_THREADS = 4
"""The fewest threads a decode from a file's mapping runs on for it to drop the pages it read as it goes
(``release``). Dropping them costs what the close's ``munmap`` would, plus a few microseconds a call for the other
threads' TLBs: on one or two threads a loss (an H100 host: the 2.2 GB load 10 ms slower on one thread, MiniLM's
0.3-0.4 ms on one or two), on 16 threads of it a fifth of the load saved (98 -> 79 ms; ``bench/RESULTS.md``, "CPU
loading")."""

RELEASE_BYTES = 64 << 20
"""The fewest stored bytes a decode from a file's mapping reads for it to drop them as it goes: the close unmaps
fewer in well under a millisecond (MiniLM's 34 MB: 0.25 ms)."""


def worth_releasing(threads: int, stored_bytes: int) -> bool:
    """Whether a decode of ``stored_bytes`` from a file's mapping on ``threads`` threads gains by dropping the pages
    it read as it goes (``release``), rather than leaving them to the close."""
    return threads >= RELEASE_THREADS and stored_bytes >= RELEASE_BYTES


def _check_released(payloads: Sequence[tuple[Any, ...]], release: bool) -> None:
    """Refuse ``release`` unless every payload (the first of each tuple) is a view of an ``mmap`` opened read-only
    (shared, so the pages dropped come back from the file unchanged): dropping the pages of anonymous or writable
    private memory would lose its bytes."""
    if release and not all(_read_only_mapping(payload) for payload, *_ in payloads):
        raise ValueError("release drops the pages of read-only file mappings only: a payload is not a view of one")


def _read_only_mapping(payload: Any) -> bool:
    if not (isinstance(payload, memoryview) and isinstance(payload.obj, mmap.mmap)):
        return False
    with memoryview(payload.obj) as whole:  # ACCESS_READ exports read-only buffers; ACCESS_WRITE and _COPY do not
        return whole.readonly


def check_payloads(kernels: ModuleType, payloads: Sequence[tuple[Any, PayloadLayout, Codebook]], *,
                   release: bool = False) -> list[tuple[int, int, str | None]]:
    """What :func:`decode_payloads` with checksums gives for ``(payload, layout, codebook)``, where nothing but the
    checks is wanted (``szconvert verify``, before it imports torch, on threads of its own): ``kernels.check_payloads``
    decodes each payload a block at a time into one small buffer, on the caller's thread, so no output takes fresh
    memory (a check of MiniLM's file went from 20 to 9 ms on the 2-core VM so). ``release`` as :func:`decode_payloads`'.
    Needs :func:`checksums_in_kernel`.

    Raises:
        EOFError: a page of a payload could not be read; its ``item`` attribute says which payload.
        ValueError: ``release`` with a payload that is not a view of a read-only mapping.
    """
    _check_released(payloads, release)
    items = [(payload, bytes(codebook.dec_lut), layout.n, layout.n_esc, layout.chunk_size)
             for payload, layout, codebook in payloads]
    return _item_by_item(lambda progress: kernels.check_payloads(items, progress, release))


def _item_by_item(call: Callable[[array.array], list[tuple[int, int, str | None]]]
                  ) -> list[tuple[int, int, str | None]]:
    """``call(progress)`` of a kernel that reports in ``progress`` the item a page of which it could not read: the
    EOFError says which in its ``item`` attribute."""
    progress = array.array("q", [0])
    try:
        return call(progress)
    except EOFError as e:
        e.item = progress[0]
        raise


native = _load_native()
_checksums_in_kernel: bool | None = None
KERNEL = f"native ({native.isa()})" if native is not None else "reference (PyTorch)"
"""``native (avx2+avx512bw+vpclmulqdq)``, ``native (avx2+avx512bw)``, ``native (avx2)``, ``native (scalar)`` (the C
extension, by the instructions it uses on this CPU) or ``reference (PyTorch)``."""
