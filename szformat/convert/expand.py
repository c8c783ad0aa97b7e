"""Stream a tensor's raw bytes out of a .szt file in bounded slices, with both of its checksums checked.

Decompression and verification both need every raw byte of every tensor exactly once, never the whole tensor at
once: slices of a few MB are decoded on the CPU (the reference codec) into one reused buffer, and the file's pages
are released after each tensor, so memory stays flat however large the tensors are.
"""

from __future__ import annotations

from typing import Iterator

from .._lazy import torch
from ..checksum import crc32
from ..errors import ChecksumMismatchError
from ..format import constants as C
from ..format.header import TensorEntry
from ..format.payloads import decode_entry
from ..format.reader import SztFile, check_crc
from .pages import drop_pages

SLICE_BYTES = 8 << 20
"""Raw bytes produced per step."""


def iter_raw_bytes(file: SztFile, entry: TensorEntry, *, slice_bytes: int | None = None) -> Iterator[torch.Tensor]:
    """Yield the raw bytes of ``entry`` in order, as flat uint8 CPU tensors of at most ``slice_bytes``
    (default :data:`SLICE_BYTES`).

    The stored bytes are checked against their CRC-32 before the first slice; the decoded bytes against theirs
    after the last one (the generator raises then, so a consumer writing an atomic output discards it). Each slice
    is only valid until the next is requested.

    Raises:
        ChecksumMismatchError: stored or decoded bytes differ from the checksums the header records.
        PayloadError: the escape stream of a SplitZip payload is inconsistent.
    """
    slice_bytes = slice_bytes or SLICE_BYTES
    payload = file.memory_payload(entry.name, verify=True)
    try:
        if entry.encoding == C.ENCODING_RAW:  # as stored (crc32 == raw_crc32), or inflated from byte planes
            if entry.at_rest is not None:
                check_crc(payload, entry.raw_crc32, what="decoded bytes", path=file.path, tensor=entry.name)
            for start in range(0, entry.raw_length, slice_bytes):
                yield payload[start: start + slice_bytes]
            return
        yield from _decoded_slices(file, entry, payload, max(1, slice_bytes // 2))
    finally:
        del payload
        drop_pages(file.buffer, entry.offset, entry.length)


def _decoded_slices(file: SztFile, entry: TensorEntry, payload: torch.Tensor,
                    slice_elements: int) -> Iterator[torch.Tensor]:
    assert entry.layout is not None and entry.codebook is not None
    n = entry.layout.n
    buffer = torch.empty(min(slice_elements, n), dtype=torch.bfloat16)
    crc = 0
    for start in range(0, n, slice_elements):
        stop = min(start + slice_elements, n)
        out = buffer[: stop - start]
        decode_entry(file.path, entry, payload, out, start=start, stop=stop)
        chunk = out.view(torch.uint8)
        crc = crc32(memoryview(chunk.numpy()), crc)
        yield chunk
    if crc != entry.raw_crc32:
        raise ChecksumMismatchError(f"CRC-32 of the decoded bytes is {crc:#010x}, the header records "
                                    f"{entry.raw_crc32:#010x}", path=file.path, tensor=entry.name)
