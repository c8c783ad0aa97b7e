"""The ``native`` route: DDO's ``vmm_fast`` native transport, moving only stored bytes and expanding them in place.

Under ``vmm_fast`` DDO keeps one virtual arena for the model's linear weights; before a block runs it pins the RAW
byte range of each weight, and its native shard transport reads the weight's checkpoint slice into a registered
host ring (64 MiB windows) and DMAs it into the range on the arena's upload stream. The compute stream then waits on
the token ``upload_ticket`` returned.

:class:`SztNativeShardTransport` is DDO's transport with two changes: the windows of a .szt slice cover its stored
bytes only, so the ring reads and the DMA moves exactly the payload into the head of the raw-sized range; and once
the last window of a SplitZip weight has been DMA'd, ``upload_ticket`` enqueues its expansion over the range on the
same upload stream and returns an event recorded after it, which DDO's compute fence then waits on. Raw-stored
weights cross unchanged. :class:`SztArenaWeightStore` is DDO's weight store, building that transport, and decoding
on the CPU on the one path where DDO reads a slice itself (its temporary fallback when a range cannot be pinned).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from ddo_vmm_allocator.model_arena_adapter import (ModelArenaWeightStore, _NativeCacheReadTicket, _NativeReadWindow,
                                                   _NativeShardTransport)

from ..codec.gate import ENCODING_SPLITZIP
from ..errors import DecodeRouteError
from ..loading import SlotDecoder
from .checkpoint import Checkpoint
from .ddo_compat import SztFileSlice
from .decoding import decode_on_cpu

__all__ = ["SztNativeShardTransport", "SztArenaWeightStore", "payload_windows"]


def payload_windows(file_offset: int, arena_offset: int, nbytes: int, window_bytes: int
                    ) -> Iterator[tuple[int, int, int]]:
    """``(file offset, arena offset, size)`` of each transfer window over ``nbytes`` stored bytes."""
    for start in range(0, nbytes, window_bytes):
        yield file_offset + start, arena_offset + start, min(window_bytes, nbytes - start)


class SztNativeShardTransport(_NativeShardTransport):
    """DDO's native shard transport, reading .szt payloads and expanding them after their DMA."""

    decoder: SlotDecoder | None = None

    def attach(self, decoder: SlotDecoder) -> None:
        self.decoder = decoder

    def _window_ranges(self, bindings: list[Any]) -> Iterator[_NativeReadWindow]:
        for binding in bindings:
            file_slice = binding.file_slice
            if not isinstance(file_slice, SztFileSlice):
                raise DecodeRouteError(f"DDO streams {binding.label} from a slice szformat did not make "
                                       f"({file_slice!r}); its CPU tensor holds no weights")
            for file_offset, arena_offset, size in payload_windows(file_slice.offset_bytes, binding.offset,
                                                                   file_slice.stored_bytes, self.window_size_bytes):
                yield _NativeReadWindow(-1, str(file_slice.path), file_offset, arena_offset, size)

    def upload_ticket(self, ticket: Any, arena: Any, stream: Any) -> Any:
        """DMA the ticket's windows (DDO), then expand every SplitZip weight whose last window was among them.

        Returns an event on ``stream`` after the expansions, in place of DDO's native slot token: ``stream`` first
        waits on that token (so the expansion follows the DMA wherever the driver ran it), and the event covers
        every expansion enqueued before it, those of earlier sub-tickets of a batch included.
        """
        if isinstance(ticket, _NativeCacheReadTicket):
            raise DecodeRouteError("DDO's native source cache is not supported with .szt checkpoints")
        if self.decoder is None:
            raise DecodeRouteError("DDO uploaded a checkpoint slice before szformat attached its decoder")
        ready = super().upload_ticket(ticket, arena, stream)
        ready.ring.wait_slot_async(ready.slot_index, stream=stream)
        ends = {window.arena_offset + window.size_bytes for window in ticket.windows}
        for binding in ticket.bindings:
            file_slice = binding.file_slice
            if file_slice.entry.encoding == ENCODING_SPLITZIP and binding.offset + file_slice.stored_bytes in ends:
                self.decoder.expand(binding.stable.detach().reshape(-1).view(torch.uint8), file_slice.entry, stream)
        return self.decoder.ops.record(stream)


class SztArenaWeightStore(ModelArenaWeightStore):
    """DDO's model-arena weight store, with szformat's transport and a CPU-decoded temporary fallback."""

    checkpoint: Checkpoint | None = None

    def attach(self, checkpoint: Checkpoint) -> None:
        self.checkpoint = checkpoint

    def temporary_source(self, binding: Any) -> Any:
        """The fallback's host copy of a weight: decoded from its payload, never read raw-sized from the file."""
        file_slice = binding.file_slice
        if not isinstance(file_slice, SztFileSlice):
            return super().temporary_source(binding)
        if self.checkpoint is None:
            raise DecodeRouteError("DDO read a checkpoint slice before szformat attached its checkpoint")
        name = file_slice.entry.name
        return decode_on_cpu(self.checkpoint.file(name), file_slice.entry)
