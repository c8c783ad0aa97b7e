"""Cut a list of tensors into transfers that each fit one staging slot.

Tensors are laid out along a line of bytes: for the device-decode route that line is the file itself (payloads in
file order, alignment padding included), so a run of small payloads crosses as one contiguous read and one copy;
for the host-decode route it is the tensors' raw bytes, each starting at an aligned cursor (staging advances by the
raw size). Small tensors are packed, several to a slot; a tensor larger than a slot is cut into as few pieces of
equal size as fit the slots, which go straight to its destination.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

__all__ = ["Extent", "Piece", "Transfer", "plan_transfers", "raw_extents", "streamed_piece_bytes"]

PAGE = 4096


@dataclass(frozen=True)
class Extent:
    """Where tensor ``item`` (an index into the caller's list) lies on the line: ``[start, start + length)``."""

    item: int
    start: int
    length: int


@dataclass(frozen=True)
class Piece:
    """Bytes ``[offset, offset + length)`` of one tensor, held at ``slot_offset`` in the staging slot.

    ``last`` says no later transfer carries bytes of this tensor: once this piece is across, the tensor is.
    """

    item: int
    slot_offset: int
    offset: int
    length: int
    last: bool


@dataclass(frozen=True)
class Transfer:
    """Line bytes ``[start, start + nbytes)`` staged into one slot, and the tensor pieces they hold.

    ``packed`` transfers hold whole tensors and cross in one copy to a device slot, to be expanded from there;
    the pieces of other transfers belong to one tensor too large for a slot and go straight to its destination.
    """

    start: int
    nbytes: int
    pieces: tuple[Piece, ...]
    packed: bool


def plan_transfers(extents: Iterable[Extent], slot_bytes: int) -> list[Transfer]:
    """Pack ``extents`` (ascending, non-overlapping) into transfers of at most ``slot_bytes`` each.

    Empty extents carry no bytes and get no piece.
    """
    if slot_bytes <= 0:
        raise ValueError(f"slot size must be positive, got {slot_bytes}")
    transfers: list[Transfer] = []
    batch: list[Piece] = []
    batch_start = batch_end = 0

    def flush() -> None:
        nonlocal batch
        if batch:
            transfers.append(Transfer(batch_start, batch_end - batch_start, tuple(batch), packed=True))
            batch = []

    previous_end = None
    for extent in extents:
        if previous_end is not None and extent.start < previous_end:
            raise ValueError(f"extent of item {extent.item} starts at {extent.start}, inside the previous one")
        previous_end = extent.start + extent.length
        if extent.length == 0:
            continue
        if extent.length > slot_bytes:
            flush()
            step = streamed_piece_bytes(extent.length, slot_bytes)
            for offset in range(0, extent.length, step):
                length = min(step, extent.length - offset)
                piece = Piece(extent.item, 0, offset, length, last=offset + length == extent.length)
                transfers.append(Transfer(extent.start + offset, length, (piece,), packed=False))
            continue
        if batch and extent.start + extent.length - batch_start > slot_bytes:
            flush()
        if not batch:
            batch_start = extent.start
        batch.append(Piece(extent.item, extent.start - batch_start, 0, extent.length, last=True))
        batch_end = extent.start + extent.length
    flush()
    return transfers


def streamed_piece_bytes(length: int, slot_bytes: int) -> int:
    """Bytes per piece of a tensor too large for a slot: as few pieces as fit, of (nearly) equal size, so no piece
    is a sliver that takes a whole slot turn (whole pages, where that still fits a slot)."""
    pieces = -(-length // slot_bytes)
    step = -(-length // pieces)
    paged = -(-step // PAGE) * PAGE
    return paged if paged <= slot_bytes else step


def raw_extents(lengths: Sequence[int], *, alignment: int = 64) -> list[Extent]:
    """Extents for tensors of these byte lengths laid end to end, each starting at a multiple of ``alignment``."""
    extents = []
    cursor = 0
    for item, length in enumerate(lengths):
        extents.append(Extent(item, cursor, length))
        cursor = -(-(cursor + length) // alignment) * alignment
    return extents
