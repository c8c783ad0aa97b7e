"""The ``staging`` route: DDO's ``vmm_runtime`` with a staging pool that fills its slots from .szt payloads.

DDO's ``vmm_runtime`` uploads one execution group (a transformer block's linear weights, packed back to back by raw
size in one device range) at a time: it takes a pinned slot from its ``PinnedStagingPool``, asks the pool to stage
each weight's checkpoint slice (``stage_file_slices``), copies the pool's ``packed_bytes`` into the group's device
range on its upload stream, records an event and hands it to ``pool.mark_upload``; the compute stream later waits on
an event recorded after that.

:class:`SztStagingPool` is DDO's pool with the GPU doing the expansion and only stored bytes crossing PCIe:

* ``stage_file_slices`` places each weight's *stored* payload in the group's staging layout, back to back (16-byte
  aligned), and returns DDO the raw-sized views where each weight will be on the device. Where the file's pages are
  registered with the driver (:class:`~szformat.loading.hostio.RegisteredMapping`, set up once by the installer)
  nothing is copied on the host: the payload is DMA'd straight out of the page cache. Otherwise it is copied into
  DDO's pinned slot first;
* ``packed_bytes`` is the group's device range itself, so DDO's copy of it onto itself is no copy at all
  (``Tensor.copy_`` returns at once when source and destination are the same view);
* ``mark_upload`` enqueues, on DDO's upload stream after DDO's event, the copies of the stored bytes into a device
  staging buffer and one batched decode from there into every weight of the group
  (:meth:`SlotDecoder.expand_scattered`), then records DDO's event again: every consumer of that event and of later
  events on the stream (the slot's reuse, DDO's compute fence) sees decoded weights.

Without Triton the pool decodes each weight on the CPU into the slot at its raw offset instead, DDO copies the
raw bytes as it does for safetensors, and nothing is left to expand.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers_dynamic_offloader.vmm_weight_store import PinnedStagingPool

from ..codec.layout import ENCODING_SPLITZIP
from ..errors import DecodeRouteError
from ..format.reader import SztFile
from ..loading import SlotDecoder, StagedEntry, stage_entry
from ..loading.staging_pool import describe_entry
from ..loading.slot_decoder import PACKED_ALIGNMENT, Placement, ScatterPlan
from .ddo_compat import SztFileSlice
from .placeholders import Placeholders
from .registered import RegisteredPages

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
    plans: dict[GroupKey, ScatterPlan] = field(default_factory=dict)
    """Each group's expansion, described at its first upload."""
    pages: RegisteredPages | None = None
    """The payloads' page-cache pages registered with the driver, where it took them: copies of those DMA straight
    out of the page cache. Closed with the pool."""


@dataclass
class _Staged:
    """The group in the active slot: its key, its destination, and each entry (offset: in the slot)."""

    key: GroupKey
    destination: torch.Tensor
    entries: list[StagedEntry]
    pieces: list[tuple[int, torch.Tensor]]
    """``(staging offset, host bytes)`` to copy to the device: registered payloads, and runs of the pinned slot."""

    @property
    def stored_bytes(self) -> int:
        return sum(host.numel() for _, host in self.pieces)


class SztStagingPool(PinnedStagingPool):
    """DDO's pinned staging pool, filled with .szt payloads that the GPU expands after one copy per group."""

    context: StagingContext | None = None
    _pending: _Staged | None = None
    copied_bytes: int = 0
    """Bytes this pool's uploads moved host to device: stored bytes with the GPU decoder, raw bytes without."""

    def attach(self, context: StagingContext) -> None:
        self.context = context

    def stage_file_slices(self, entries: list[tuple[torch.Tensor, Any]]) -> list[torch.Tensor]:
        """Stage a group's slices; returns each weight's raw-sized view, as DDO's does (on the device when the GPU
        expands them: that is where they will be once uploaded)."""
        context = self._attached()
        buffer = self._active_buffer()
        key = tuple(source.data_ptr() for source, _ in entries)
        destination = context.destinations.get(key) if context.decoder is not None else None
        if context.decoder is not None and destination is None:
            raise DecodeRouteError(f"DDO uploaded a group szformat has no device range for ({len(entries)} weights)")
        views, staged, pieces, raw_offset, cursor = [], [], [], 0, 0  # DDO stages one group per slot
        for source, file_slice in entries:
            nbytes = source.numel() * source.element_size()
            if source.device.type != "cpu" or not source.is_contiguous():
                raise ValueError("Pinned file staging accepts contiguous CPU tensors only")
            if not isinstance(file_slice, SztFileSlice) or nbytes != file_slice.size_bytes:
                raise DecodeRouteError(f"DDO staged {tuple(source.shape)} {source.dtype} from a slice szformat did "
                                       f"not make ({file_slice!r})")
            if raw_offset + nbytes > self.size_bytes:  # DDO sizes slots for a group's raw bytes; so does its check
                raise RuntimeError(f"Pinned staging buffer is too small: need {(raw_offset + nbytes) / 1024**2:.1f} "
                                   f"MiB, have {self.size_bytes / 1024**2:.1f} MiB")
            name = file_slice.entry.name
            started = time.perf_counter()
            if destination is None:  # decoded on the host into the slot, at its raw offset
                entry = stage_entry(context.files[str(file_slice.path)], name, buffer, raw_offset, decode_on_host=True)
            else:
                cursor = -(-cursor // PACKED_ALIGNMENT) * PACKED_ALIGNMENT
                file, payload = context.files[str(file_slice.path)], None
                if context.pages is not None:
                    payload = context.pages.view(file_slice.path, file_slice.offset_bytes,
                                                 file_slice.offset_bytes + file_slice.stored_bytes)
                entry = (stage_entry(file, name, buffer, cursor, decode_on_host=False) if payload is None
                         else describe_entry(file, name, cursor, decode_on_host=False))
                pieces.append((cursor, buffer[cursor: cursor + entry.length] if payload is None else payload))
                cursor += entry.length
            self._record_shard_read(file_slice.stored_bytes, time.perf_counter() - started)
            staged.append(entry)
            home = buffer if destination is None else destination
            views.append(home[raw_offset: raw_offset + nbytes].view(source.dtype).view(source.shape))
            raw_offset += nbytes
        self._offset = raw_offset  # DDO counts the group's raw bytes
        if destination is not None:
            self._pending = _Staged(key, destination[:raw_offset], staged, pieces)
        else:
            self.copied_bytes += raw_offset
        return views

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

    @property
    def packed_bytes(self) -> torch.Tensor:
        """What DDO copies into the group's device range: that range itself while the GPU expands the group (DDO's
        copy is then no copy), the slot's raw bytes otherwise."""
        if self._pending is not None:
            return self._pending.destination
        return super().packed_bytes

    def mark_upload(self, event: Any) -> None:
        """Enqueue, after ``event`` on the upload stream, the copy of the group's stored bytes and their expansion,
        record ``event`` again after them, then retire the slot as DDO does."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._upload(pending, event)
        super().mark_upload(event)

    def _upload(self, staged: _Staged, event: Any) -> None:
        context = self._attached()
        decoder, stream = context.decoder, context.stream
        plan = context.plans.get(staged.key)
        if plan is None:
            raw_offsets, offset = [], 0
            for entry in staged.entries:
                raw_offsets.append(offset)
                offset += entry.raw_length
            plan = context.plans[staged.key] = decoder.scatter_plan([
                Placement(entry.offset, staged.destination[at: at + entry.raw_length], entry)
                for at, entry in zip(raw_offsets, staged.entries)])
        decoder.ops.wait(stream, event)  # DDO's (empty) copy may have run on another stream (its synchronous path)
        decoder.copy_to_staging(staged.pieces, plan.staging_bytes, stream)
        decoder.expand_scattered(plan, stream)
        event.record(stream)
        self.copied_bytes += staged.stored_bytes

    def close(self) -> None:
        """DDO's close, after szformat's copies out of the pinned slots and registered pages have run; then the
        registered mappings are released."""
        context = self.context
        if context is not None and context.decoder is not None:
            context.decoder.ops.synchronize(context.decoder.ops.record(context.stream))
        super().close()
        if context is not None and context.pages is not None:
            context.pages.close()
            context.pages = None

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
