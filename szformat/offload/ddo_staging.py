"""The ``staging`` route: DDO's ``vmm_runtime`` with a staging pool that fills entries from .szt payloads.

DDO's ``vmm_runtime`` uploads one execution group (a transformer block's linear weights, packed back to back) at a
time: it takes a pinned slot from its ``PinnedStagingPool``, asks the pool to stage each weight's checkpoint slice
(``stage_file_slices``), copies the slot's packed bytes into the group's device range on its upload stream, records
an event and hands it to ``pool.mark_upload``; the compute stream later waits on an event recorded after that.

:class:`SztStagingPool` is DDO's pool with two changes. Its entries still advance by the RAW size of each weight (so
the slot, the device range and DDO's byte accounting line up), but only an entry's leading stored bytes are filled
from the .szt file. And ``mark_upload`` first enqueues, on DDO's upload stream and after the copy, the expansion of
every SplitZip entry inside the device range, then records DDO's event again: every consumer of that event and of
later events on the stream (the slot's reuse, DDO's compute fence) sees decoded weights. Without Triton the pool
decodes each entry on the CPU into the slot instead, and nothing is left to expand.

DDO copies the whole packed range, so this route moves raw bytes over PCIe; what it saves is host memory (weights
stay compressed in the file's pages) and file reads. The ``native`` route moves only the stored bytes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers_dynamic_offloader.vmm_weight_store import PinnedStagingPool

from ..codec.gate import ENCODING_SPLITZIP
from ..errors import DecodeRouteError
from ..format.reader import SztFile
from ..loading import SlotDecoder, StagedEntry, stage_entry
from ..loading.slot_decoder import PACKED_ALIGNMENT
from .ddo_compat import SztFileSlice
from .placeholders import Placeholders

__all__ = ["SztStagingPool", "StagingContext", "group_destinations"]

GroupKey = tuple[int, ...]
"""A group's identity at upload time: the addresses of its CPU sources, in order."""


@dataclass
class StagingContext:
    """What the pool needs once DDO has built its runtime: files, where each group lands, and how to expand it.

    ``decoder`` is None when payloads are decoded on the CPU while staging. ``destinations`` maps each group's key
    to the flat uint8 device range its packed slot is copied into. ``stream`` is DDO's upload stream.
    """

    files: dict[str, SztFile]
    placeholders: Placeholders
    decoder: SlotDecoder | None
    stream: Any = None
    destinations: dict[GroupKey, torch.Tensor] = field(default_factory=dict)


class SztStagingPool(PinnedStagingPool):
    """DDO's pinned staging pool, filled from .szt payloads and expanding them on the device after each upload."""

    context: StagingContext | None = None
    _pending: tuple[GroupKey, list[StagedEntry]] | None = None

    def attach(self, context: StagingContext) -> None:
        self.context = context

    def stage_file_slices(self, entries: list[tuple[torch.Tensor, Any]]) -> list[torch.Tensor]:
        """Stage a group's slices at consecutive raw-sized entries; returns the typed entry views, as DDO's does."""
        context = self._attached()
        buffer = self._active_buffer()
        staged_views, staged = [], []
        for source, file_slice in entries:
            nbytes = source.numel() * source.element_size()
            if source.device.type != "cpu" or not source.is_contiguous():
                raise ValueError("Pinned file staging accepts contiguous CPU tensors only")
            if not isinstance(file_slice, SztFileSlice) or nbytes != file_slice.size_bytes:
                raise DecodeRouteError(f"DDO staged {tuple(source.shape)} {source.dtype} from a slice szformat did "
                                       f"not make ({file_slice!r})")
            end = self._offset + nbytes
            if end > self.size_bytes:
                raise RuntimeError(f"Pinned staging buffer is too small: need {end / 1024**2:.1f} MiB, "
                                   f"have {self.size_bytes / 1024**2:.1f} MiB")
            file = context.files[str(file_slice.path)]
            started = time.perf_counter()
            entry = stage_entry(file, file_slice.entry.name, buffer, self._offset,
                                decode_on_host=context.decoder is None)
            self._record_shard_read(file_slice.stored_bytes, time.perf_counter() - started)
            staged.append(entry)
            staged_views.append(buffer[self._offset: end].view(source.dtype).view(source.shape))
            self._offset = end
        self._pending = (tuple(source.data_ptr() for source, _ in entries), staged)
        return staged_views

    def stage_file_slices_async(self, entries: list[tuple[torch.Tensor, Any]]) -> tuple[list[torch.Tensor], list]:
        return self.stage_file_slices(entries), []

    def stage_file_slice(self, source: torch.Tensor, file_slice: Any) -> torch.Tensor:
        return self.stage_file_slices([(source, file_slice)])[0]

    def stage(self, source: torch.Tensor) -> torch.Tensor:
        """DDO's copy of a CPU tensor, refused for placeholders: they hold no weights, their slice holds them."""
        if self._attached().placeholders.contains(source):
            raise DecodeRouteError(f"DDO tried to upload a {tuple(source.shape)} {source.dtype} weight from CPU "
                                   "memory instead of its checkpoint slice; szformat cannot serve this DDO layout")
        return super().stage(source)

    def mark_upload(self, event: Any) -> None:
        """Enqueue the expansion of the group just copied (after ``event``, on the upload stream), re-record
        ``event`` after it, then retire the slot as DDO does."""
        pending, self._pending = self._pending, None
        if pending is not None:
            key, staged = pending
            expand = [entry for entry in staged if entry.layout is not None]
            if expand:
                self._expand(key, expand, event)
        super().mark_upload(event)

    def _expand(self, key: GroupKey, staged: list[StagedEntry], event: Any) -> None:
        context = self._attached()
        destination = context.destinations.get(key)
        if destination is None:
            raise DecodeRouteError(f"DDO uploaded a group szformat has no device range for (tensor {staged[0].name})")
        decoder, stream = context.decoder, context.stream
        decoder.ops.wait(stream, event)  # the copy may have run on another stream (DDO's synchronous path)
        packed = [(entry.offset, entry) for entry in staged if entry.offset % PACKED_ALIGNMENT == 0]
        if packed:
            decoder.expand_packed(destination, packed, stream)
        for entry in staged:
            if entry.offset % PACKED_ALIGNMENT:
                decoder.expand(destination[entry.offset: entry.offset + entry.reserved], entry, stream)
        event.record(stream)

    def _attached(self) -> StagingContext:
        if self.context is None:
            raise DecodeRouteError("DDO staged a checkpoint slice before szformat attached its decoder")
        return self.context


def group_destinations(groups: list[tuple[str, list[tuple[str, torch.Tensor]]]], weight: Callable[[str], torch.Tensor],
                       slice_of: Callable[[torch.Tensor], Any]) -> dict[GroupKey, torch.Tensor]:
    """The flat device range each packed group is uploaded into, by group key; checks that szformat serves it.

    ``groups`` is DDO's packed layout (group name, then ``(weight name, CPU source)`` in packing order),
    ``weight(name)`` the device view DDO made for a weight and ``slice_of(source)`` the registry's slice for a
    source. The range starts at the group's first weight and spans the raw bytes of all of them.

    Raises:
        DecodeRouteError: a source has no .szt slice (DDO would upload the placeholder's zeros), a weight does not
            sit where packing by raw size puts it (where its entry is staged), or a SplitZip weight does not start
            on a 4-byte boundary (the in-place decoder needs one).
    """
    destinations: dict[GroupKey, torch.Tensor] = {}
    uncovered = [name for _, pairs in groups for name, source in pairs
                 if not isinstance(slice_of(source), SztFileSlice)]
    if uncovered:
        raise DecodeRouteError(f"DDO streams {len(uncovered)} weight(s) szformat has no checkpoint slice for "
                               f"({', '.join(uncovered[:5])}); their CPU tensors hold no weights")
    for group, pairs in groups:
        first = weight(pairs[0][0])
        offset = 0
        for name, source in pairs:
            at = weight(name).data_ptr() - first.data_ptr()
            if at != offset:
                raise DecodeRouteError(f"DDO placed {name} at byte {at} of group {group}, not at {offset} where its "
                                       "entry is staged")
            if offset % 4 and slice_of(source).entry.encoding == ENCODING_SPLITZIP:
                raise DecodeRouteError(f"{name} starts at byte {offset} of group {group}, not on a 4-byte boundary; "
                                       "the in-place decoder cannot expand it there")
            offset += source.numel() * source.element_size()
        base = first.reshape(-1).view(torch.uint8)
        destinations[tuple(source.data_ptr() for _, source in pairs)] = base.as_strided(
            (offset,), (1,), base.storage_offset())
    return destinations
