"""The host decode route: the CPU decodes into the staging slots (which then advance by the raw size) and raw
bytes cross to the device; it needs no Triton, and gives bit-identical tensors.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import torch

from ..codec.layout import ENCODING_SPLITZIP
from ..format.header import TensorEntry
from ..format.payloads import decode_entry
from ..format.reader import SztFile
from .hostio import Staged
from .plan import Transfer, plan_transfers, raw_extents
from .ring import Slot
from .transfer import TransferLoop, allocate

__all__ = ["HostDecodeRoute"]


class HostDecodeRoute:
    """The CPU decodes into the staging slots (advancing by raw size); raw bytes cross to the device.

    Args:
        loop (`TransferLoop`): its ring needs host buffers only.
        pool (`ThreadPoolExecutor`): runs the decoding of staged transfers while earlier ones are copied.
    """

    def __init__(self, loop: TransferLoop, pool: ThreadPoolExecutor):
        self.loop = loop
        self.pool = pool

    def load(self, file: SztFile, entries: Sequence[TensorEntry]) -> list[torch.Tensor]:
        """Decode ``entries`` of ``file`` on the host and copy them to the device; returns their raw bytes there,
        flat uint8, in the order given, each in its own allocation. Call ``loop.finish()`` before reading them."""
        ops = self.loop.ops
        transfers = plan_transfers(raw_extents([e.raw_length for e in entries]), self.loop.ring.slot_bytes)
        dests = allocate(ops, [e.raw_length for e in entries])

        def stage(k: int, transfer: Transfer, slot: Slot) -> Staged:
            host = slot.host[: transfer.nbytes]
            return Staged(host, [self.pool.submit(self._decode, file, entries, transfer, host)])

        def copy(k: int, slot: Slot, host: torch.Tensor) -> Any:
            def copy_pieces() -> None:
                for piece in transfers[k].pieces:
                    dests[piece.item][piece.offset: piece.offset + piece.length].copy_(
                        host[piece.slot_offset: piece.slot_offset + piece.length], non_blocking=True)

            self.loop.enqueue(self.loop.copy_stream, copy_pieces, "copy", k, transfers[k].nbytes)
            return ops.record(self.loop.copy_stream)

        self.loop.run(transfers, stage, copy, lambda k, slot, copied: None, host_writes=True)
        return dests

    @staticmethod
    def _decode(file: SztFile, entries: Sequence[TensorEntry], transfer: Transfer, host: torch.Tensor) -> None:
        for piece in transfer.pieces:
            entry = entries[piece.item]
            out = host[piece.slot_offset: piece.slot_offset + piece.length]
            if entry.encoding != ENCODING_SPLITZIP:  # as stored, or inflated from byte planes (what it needs)
                lo, hi = piece.offset, piece.offset + piece.length
                ranges = [(lo, hi)] if entry.at_rest is not None else None
                out.copy_(file.memory_payload(entry.name, ranges=ranges)[lo:hi])
                continue
            start, stop = piece.offset // 2, (piece.offset + piece.length) // 2
            ranges = entry.layout.byte_ranges(start, stop) if entry.at_rest is not None else None
            payload = file.memory_payload(entry.name, ranges=ranges)  # at rest: inflates what the piece needs
            decode_entry(file.path, entry, payload, out.view(torch.bfloat16), start=start, stop=stop)
