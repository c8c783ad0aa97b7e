"""Stream the raw bytes of a .szt file's tensors in bounded memory, with both of their checksums checked.

Decompression and verification both need every raw byte of every tensor exactly once, never the whole file at
once. Tensors are taken in groups of at most :data:`GROUP_BYTES` (:func:`tensor_groups`): a group is decoded by the
CPU loader on its threads into one buffer reused from group to group (:func:`decode_group`), a tensor larger than
that alone (verified in windows of that buffer on the loader's threads, :func:`raw_windows`; decompressed slice by
slice, :func:`iter_raw_bytes`); the file's pages are released after each group and tensor, so memory stays flat
however large the file and its tensors are.
"""

from __future__ import annotations

from typing import Iterator, Sequence

from .._lazy import cpu_codec, torch
from .._runs import runs_within
from ..checksum import crc32
from ..errors import ChecksumMismatchError
from ..format import constants as C
from ..format.header import TensorEntry
from ..format.payloads import decode_entry
from ..format.reader import SztFile, check_crc
from .pages import drop_pages

SLICE_BYTES = 8 << 20
"""Raw bytes produced per step of :func:`iter_raw_bytes`."""

GROUP_BYTES = 64 << 20
"""Raw bytes of the tensors decoded together by :func:`decode_group`: on 16 cores `szconvert verify` of a 2.2 GB
file took 0.30 s against 0.58 s slice by slice on one thread (``bench/RESULTS.md``, "Conversion", run 109)."""

SLOT_ALIGNMENT = 64
"""Each tensor of a group starts this many bytes into the buffer, so its bytes can be viewed as its dtype."""


def slot_bytes(entry: TensorEntry) -> int:
    """The bytes a tensor takes in a group's buffer."""
    return -(-entry.raw_length // SLOT_ALIGNMENT) * SLOT_ALIGNMENT


def tensor_groups(entries: Sequence[TensorEntry]) -> list[list[TensorEntry]]:
    """``entries`` in order, cut into groups whose slots (:func:`slot_bytes`) fill at most :data:`GROUP_BYTES`; a
    larger tensor alone (:func:`decoded_together` says which)."""
    return runs_within(entries, slot_bytes, GROUP_BYTES)


def decoded_together(group: Sequence[TensorEntry]) -> bool:
    """Whether a group of :func:`tensor_groups` fits :func:`decode_group`'s buffer (else it is one large tensor)."""
    return sum(map(slot_bytes, group)) <= GROUP_BYTES


def decode_group(file: SztFile, group: Sequence[TensorEntry], buffer: torch.Tensor) -> list[torch.Tensor]:
    """The raw bytes of a group that :func:`decoded_together`, decoded as ``load_file`` decodes them (on its
    threads, every checksum checked) into ``buffer`` (flat uint8 of :data:`GROUP_BYTES`, reused by the caller): one
    flat uint8 view per tensor, valid until the buffer is written again.

    Raises:
        ChecksumMismatchError, PayloadError: as :func:`iter_raw_bytes`, for the first bad tensor found.
    """
    from ..loading.host_decode import decode_entries

    slots = [slot_bytes(e) for e in group]
    outs = [slot[: e.raw_length] for slot, e in zip(buffer[: sum(slots)].split(slots), group)]
    try:
        decode_entries(file, group, check_stored=[True] * len(group), check_decoded=True, outs=outs, as_bytes=True)
    finally:  # a group's payloads follow one another in the file: one call releases them
        drop_pages(file.buffer, group[0].offset, group[-1].offset + group[-1].length - group[0].offset)
    return outs


def group_buffer() -> torch.Tensor:
    """The buffer :func:`decode_group` decodes into, made once per call of ``verify`` or ``decompress`` (its pages
    taken when first written, and only those: as huge pages where that pays, :mod:`~szformat.loading.host_pages`)."""
    from ..loading import host_pages

    return host_pages.empty(GROUP_BYTES, torch.uint8)


def raw_windows(file: SztFile, entry: TensorEntry, buffer: torch.Tensor) -> Iterator[torch.Tensor]:
    """The raw bytes of one tensor, in order, every checksum checked, as flat uint8 views valid until the next is
    asked for: decoded in windows of ``buffer`` (:func:`group_buffer`) on the loader's threads where
    :func:`~szformat.loading.host_decode.decode_windows` takes the tensor (a SplitZip tensor in the in-memory form),
    else slice by slice (:func:`iter_raw_bytes`). ``verify`` of a 1.9 GB file of 117 MB
    tensors on 16 cores: 0.21 s against 0.56 s slice by slice; ``decompress``, which its writes bound, took 1.58 s
    against 1.41 s (the disk idle while a window decodes), so it keeps the slices (``bench/RESULTS.md``, run 111).

    Raises:
        ChecksumMismatchError, PayloadError: as :func:`iter_raw_bytes`.
    """
    from ..loading.host_decode import decode_windows, windowed

    if not windowed(entry):
        yield from iter_raw_bytes(file, entry)
        return
    try:
        yield from decode_windows(file, entry, buffer)
    finally:
        drop_pages(file.buffer, entry.offset, entry.length)


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
        # The decode's few torch ops on one intra-op thread, as conversion runs them (convert.py): with 16 intra-op
        # threads, forking and joining a team around each made a 2.2 GB pass slower than on one thread.
        with cpu_codec.one_intra_op_thread():
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
