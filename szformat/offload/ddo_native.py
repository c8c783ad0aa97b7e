"""The ``native`` route: DDO's ``vmm_fast`` native transport, moving only stored bytes, one batched decode per group.

Under ``vmm_fast`` DDO keeps one virtual arena for the model's linear weights. Before a block runs it pins the RAW
byte range of each weight and hands its native shard transport the group of weights to upload (``upload_batch``, or
``upload_ticket`` for a group read ahead with ``begin_read``): the transport reads the group's checkpoint slices into
a registered host ring (64 MiB windows), DMAs them into the arena on the upload stream and returns a token the
compute stream then waits on.

:class:`SztNativeShardTransport` is DDO's transport with its windows and its upload replaced:

* where the payloads' page-cache pages could be registered with the driver at install
  (:class:`~szformat.offload.registered.RegisteredPages`), nothing is read into the ring at all: a group's upload
  DMAs the same runs straight out of the page cache into the staging buffer. Otherwise:
* the windows of a group cover the group's *stored* bytes, read in runs: payloads that follow each other in the
  file (their alignment padding between them) are read by one window, so a block of small weights costs one read
  and one DMA, not one per weight;
* the windows are DMA'd into a device staging buffer (stored bytes only cross PCIe), and once the last window of a
  weight has arrived, one batched decode per upload writes every such weight from staging into its arena range
  (:meth:`SlotDecoder.expand_scattered`: two launches whatever the weight count, no stash). The group's layout
  (:class:`~szformat.loading.ScatterPlan`) is described at its first upload and reused at every later one;
* the token returned is an event recorded after the decode; a ring slot is reused only once the DMA out of it is
  done (:meth:`SztNativeShardTransport._acquire_slot`).

:class:`SztArenaWeightStore` is DDO's weight store, building that transport, and decoding on the CPU on the one path
where DDO reads a slice itself (its temporary fallback when a range cannot be pinned).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from ddo_vmm_allocator.model_arena_adapter import (ModelArenaWeightStore, _NativeCacheReadTicket, _NativeReadWindow,
                                                   _NativeShardTransport)

from ..errors import DecodeRouteError
from ..loading import SlotDecoder
from ..loading.slot_decoder import PACKED_ALIGNMENT, Placement, ScatterPlan
from .shards import Checkpoint
from .ddo_compat import SztFileSlice
from .decoding import decode_on_cpu
from .registered import RUN_GAP_BYTES, RegisteredPages

__all__ = ["SztNativeShardTransport", "SztArenaWeightStore", "RegisteredTicket", "StagedWindow", "staged_windows"]

@dataclass
class StagedWindow(_NativeReadWindow):
    """DDO's read window, landing at ``arena_offset`` of the group's device *staging* buffer (not of the arena).

    ``completes`` lists the bindings whose last stored byte arrives with this window."""

    completes: tuple = ()


def staged_windows(bindings: list[Any], window_bytes: int) -> Iterator[StagedWindow]:
    """The windows that read a group's stored bytes into its staging buffer, runs of nearby payloads sharing one.

    Each binding's payload lands at a staging offset that is a multiple of 16 bytes (the batched decode loads whole
    16-byte vectors); a payload whose file offset would break that starts a run of its own.
    """
    slices = []
    for binding in bindings:
        file_slice = binding.file_slice
        if not isinstance(file_slice, SztFileSlice):
            raise DecodeRouteError(f"DDO streams {binding.label} from a slice szformat did not make "
                                   f"({file_slice!r}); its CPU tensor holds no weights")
        if file_slice.stored_bytes:  # an empty tensor has nothing to read and nothing to decode
            slices.append((str(file_slice.path), file_slice.offset_bytes, file_slice.stored_bytes, binding))
    slices.sort(key=lambda item: (item[0], item[1]))
    runs: list[list] = []  # [path, file start, file end, staging start, [(file end of a payload, binding)]]
    staging_end = 0
    for path, offset, stored, binding in slices:
        run = runs[-1] if runs else None
        if (run is not None and run[0] == path and run[2] <= offset <= run[2] + RUN_GAP_BYTES
                and (offset - run[1]) % PACKED_ALIGNMENT == 0):
            run[2] = offset + stored
        else:
            staging_end = -(-staging_end // PACKED_ALIGNMENT) * PACKED_ALIGNMENT
            run = [path, offset, offset + stored, staging_end, []]
            runs.append(run)
        run[4].append((offset + stored, binding))
        staging_end = run[3] + run[2] - run[1]
    for path, start, end, staging_start, ends in runs:
        for offset in range(start, end, window_bytes):
            size = min(window_bytes, end - offset)
            yield StagedWindow(-1, path, offset, staging_start + offset - start, size,
                               tuple(binding for last, binding in ends if offset < last <= offset + size))


@dataclass(eq=False)
class RegisteredTicket:
    """A group read ahead whose payloads all sit in registered pages: nothing to read, so nothing holds a slot."""

    bindings: list[Any]
    active: bool = True


class SztNativeShardTransport(_NativeShardTransport):
    """DDO's native shard transport, reading .szt payloads into a device staging buffer and expanding them there."""

    decoder: SlotDecoder | None = None
    _pages: RegisteredPages | None = None

    def attach(self, decoder: SlotDecoder, pages: RegisteredPages | None = None) -> None:
        """Start serving uploads with ``decoder``, DMA'ing what ``pages`` registered straight from the page cache
        (the transport closes ``pages`` with itself)."""
        self.decoder = decoder
        self._pages = pages
        self._plans: dict[tuple, ScatterPlan] = {}
        self._registered_groups: dict[tuple, tuple[ScatterPlan, list, int] | None] = {}
        self._slot_views: dict[int, torch.Tensor] = {}
        self._slot_done: dict[int, Any] = {}
        self._last_ready: Any = None
        self.copied_bytes = 0
        """Bytes DMA'd host to device so far: the stored bytes of every upload (with run padding)."""

    def begin_read(self, bindings: list[Any]) -> Any:
        self._require_decoder()
        if self._all_registered(bindings):
            return RegisteredTicket(list(bindings))
        return super().begin_read(bindings)

    def upload_batch(self, bindings: list[Any], arena: Any, stream: Any) -> Any:
        self._require_decoder()
        if self._all_registered(bindings):
            return self._upload_registered(bindings, stream)
        return super().upload_batch(bindings, arena, stream)

    def ticket_active(self, ticket: Any) -> bool:
        if isinstance(ticket, RegisteredTicket):
            return ticket.active
        return super().ticket_active(ticket)

    def discard_ticket(self, ticket: Any) -> None:
        if isinstance(ticket, RegisteredTicket):
            ticket.active = False
            return
        super().discard_ticket(ticket)

    def _require_decoder(self) -> None:
        """Refuse DDO's calls before :meth:`attach` (the transport's state is set there)."""
        if self.decoder is None:
            raise DecodeRouteError("DDO uploaded a checkpoint slice before szformat attached its decoder")

    def _all_registered(self, bindings: list[Any]) -> bool:
        return self._registered_group(bindings) is not None

    def _registered_group(self, bindings: list[Any]) -> tuple[ScatterPlan, list, int] | None:
        """A group's upload out of registered pages (its plan, its copies, their bytes), described at its first
        upload; None when some payload of it is not registered."""
        if self._pages is None:  # closed, or nothing registered
            return None
        key = tuple(binding.offset for binding in bindings)
        if key not in self._registered_groups:
            group = None
            if all(isinstance(b.file_slice, SztFileSlice) for b in bindings):
                windows = list(staged_windows(bindings, self.window_size_bytes))
                pieces = [(w.arena_offset, self._pages.view(w.path, w.file_offset, w.file_offset + w.size_bytes))
                          for w in windows]
                if all(host is not None for _, host in pieces):
                    plan = self._plan(bindings, [binding for window in windows for binding in window.completes])
                    group = (plan, pieces, sum(host.numel() for _, host in pieces))
            self._registered_groups[key] = group
        return self._registered_groups[key]

    def _upload_registered(self, bindings: list[Any], stream: Any) -> Any:
        """DMA the group's runs out of registered pages into the staging buffer, then decode them all."""
        plan, pieces, nbytes = self._registered_group(bindings)
        self.decoder.copy_to_staging(pieces, plan.staging_bytes, stream)
        self.read_bytes += nbytes
        self.copied_bytes += nbytes
        self._last_ready = self.decoder.expand_scattered(plan, stream)
        return self._last_ready

    def _window_ranges(self, bindings: list[Any]) -> Iterator[_NativeReadWindow]:
        return staged_windows(bindings, self.window_size_bytes)

    def _acquire_slot(self) -> int:
        """DDO's slot, once the DMA szformat enqueued out of it has run (DDO's own slot events never see it)."""
        slot = super()._acquire_slot()
        done = self._slot_done.pop(slot, None)
        if done is not None:
            self.decoder.ops.synchronize(done)
        return slot

    def upload_ticket(self, ticket: Any, arena: Any, stream: Any) -> Any:
        """DMA the ticket's windows into the staging buffer, then decode every weight whose last window was among
        them into its arena range, in one batched decode; return the event after it (DDO's compute fence).

        The event also covers earlier sub-tickets of the same group: they were enqueued before it on ``stream``.
        """
        if isinstance(ticket, _NativeCacheReadTicket):
            raise DecodeRouteError("DDO's native source cache is not supported with .szt checkpoints")
        self._require_decoder()
        if not self.ticket_active(ticket):
            raise DecodeRouteError("DDO uploaded a native read ticket that is no longer active")
        if isinstance(ticket, RegisteredTicket):
            ticket.active = False
            return self._upload_registered(ticket.bindings, stream)
        read = ticket.windows
        try:
            for window in read:
                self.ring.wait_file_read(window.slot_index)
            plan = self._plan(ticket.bindings, [b for window in read for b in window.completes])
            self.decoder.copy_to_staging([(w.arena_offset, self._slot_view(w.slot_index)[: w.size_bytes])
                                          for w in read], plan.staging_bytes, stream)
            copied = self.decoder.ops.record(stream)
            for window in read:
                self._slot_done[window.slot_index] = copied
            ready = self._last_ready = self.decoder.expand_scattered(plan, stream)
        finally:
            for window in read:
                self._pending.pop(window.slot_index, None)
        nbytes = sum(window.size_bytes for window in read)
        self.read_seconds += time.perf_counter() - ticket.started_at
        self.read_bytes += nbytes
        self.copied_bytes += nbytes
        return ready

    def _plan(self, bindings: list[Any], completed: list[Any]) -> ScatterPlan:
        """The expansion of the weights ``completed`` of group ``bindings``, described at the group's first upload.

        The staging buffer is sized for the whole group (a group larger than the ring crosses in several tickets,
        and a weight may span two), so it is never regrown while a group is in flight.
        """
        key = (tuple(binding.offset for binding in bindings), tuple(binding.offset for binding in completed))
        plan = self._plans.get(key)
        if plan is None:
            windows = list(staged_windows(bindings, self.window_size_bytes))
            at = {id(binding): window.arena_offset + binding.file_slice.offset_bytes - window.file_offset
                  for window in windows for binding in window.completes}
            plan = self.decoder.scatter_plan([
                Placement(at[id(binding)], binding.stable.detach().reshape(-1).view(torch.uint8),
                          binding.file_slice.entry) for binding in completed])
            plan.staging_bytes = max(window.arena_offset + window.size_bytes for window in windows)
            self._plans[key] = plan
        return plan

    def _slot_view(self, slot: int) -> torch.Tensor:
        """A host tensor over ring slot ``slot`` (registered memory: copies out of it are true DMA)."""
        view = self._slot_views.get(slot)
        if view is None:
            array = (ctypes.c_uint8 * self.window_size_bytes).from_address(self.ring.slot_address(slot))
            view = self._slot_views[slot] = torch.frombuffer(array, dtype=torch.uint8)
        return view

    def close(self) -> None:
        """Wait for szformat's DMAs out of the ring and the registered pages before they are freed."""
        if self.decoder is not None:
            if self._last_ready is not None:
                self.decoder.ops.synchronize(self._last_ready)
            for done in self._slot_done.values():
                self.decoder.ops.synchronize(done)
            self._slot_done = {}
        super().close()
        if self._pages is not None:
            self._registered_groups.clear()  # their copies are views of the pages' mappings, which must go first
            self._pages.close()
            self._pages = None


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
