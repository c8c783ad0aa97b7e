"""The device decode route: the stored bytes cross to the device (compressed, so fewer of them cross PCIe) and
are expanded there. A packed slot of small tensors crosses in one copy and is expanded by one batched decode; a
tensor larger than a slot streams into the leading bytes of its own destination and is expanded there in place.
Raw-passthrough tensors take the same slots and copies, without a decode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..codec.layout import ENCODING_SPLITZIP
from ..format.header import TensorEntry
from . import timeline
from .device_codec import DeviceCodec
from .gpu_inflate import FrameInflater, FramePlan, frames_of, plan_frames, plane_frames_of
from .hostio import Staged
from .ops import DeviceOps
from .plan import Extent, Transfer, plan_transfers
from .ring import Slot
from .sources import HostSource
from .stored_crc import StoredCrcCheck
from .transfer import TransferLoop, allocate

__all__ = ["DeviceChecks", "DeviceDecodeRoute", "destination_bytes"]

ARENA_ALIGNMENT = 256
"""Tensors sharing a packed transfer's output allocation start at multiples of this many bytes."""
INFLATED_ALIGNMENT = 16
"""In-memory payloads inflated on the device start at multiples of this many bytes: the batched decode loads
16-byte vectors."""
STREAMED_LANES = 2
"""Tensors too large for a slot and stored at rest are inflated and expanded on this many streams of their own, in
turn, each with a scratch buffer of the largest one's in-memory size. One nvCOMP call lasts about one frame's decode
(about 10 ms on the H200 for 1 MiB frames) however many frames it takes, so on one stream the large tensors of a
file queued behind each other and the load ended up to three calls after its last read (``bench/RESULTS.md``)."""


def destination_bytes(entry: TensorEntry) -> int:
    """Bytes to allocate for a tensor that streams into its own destination: its raw size, or its payload's if that
    is larger (the payload must fit there before it is expanded over it)."""
    return max(entry.raw_length, entry.length)


class DeviceChecks:
    """What the device checks while it decodes a load, as int32 flags on the device, read once it has finished:
    one flag per SplitZip tensor, which the kernels' escape pass sets when the tensor's escape streams break a rule
    of the spec, and one status per zstd frame inflated on the device, nonzero when the frame failed.

    The device checks the very bytes it decodes, at no host cost: checked on the host beside the transfer, the
    escape streams of a 2.3 GB checkpoint's 114 tensors held back its first read by 20 ms on the H200 host (their
    thread contended for the GIL with the load's own setup), a sixth of the whole load.

    Args:
        ops (`DeviceOps`): allocates the flags (zeroed on the current stream, which the load's streams wait for).
        escapes (`Sequence[int]`): the entry each escape flag stands for; the rows of one batch table are
            consecutive.
        frames (`Sequence[int]`): the entry each frame status stands for, frames of one call consecutive.
    """

    def __init__(self, ops: DeviceOps, escapes: Sequence[int], frames: Sequence[int] = ()):
        self._items = list(escapes) + list(frames)
        self._escapes = len(escapes)
        self._index = {item: i for i, item in enumerate(escapes)}
        self._flags = ops.device_buffer(4 * len(self._items)).view(torch.int32).zero_() if self._items else None

    def escapes(self, items: Sequence[int]) -> torch.Tensor | None:
        """The escape flags of ``items`` (consecutive in ``escapes``), for one decode call; ``None`` for none, or
        for items given no flag (a tensor without escapes)."""
        start = self._index.get(items[0]) if items else None
        return None if start is None else self._flags[start: start + len(items)]

    def frames(self, first: int, count: int) -> torch.Tensor:
        """The statuses of frames ``[first, first + count)`` of ``frames``, for one inflate call."""
        return self._flags[self._escapes + first: self._escapes + first + count]

    def failed(self) -> tuple[list[int], list[int]]:
        """The entries whose escape flag is set, and those with a frame that failed to inflate."""
        if self._flags is None:
            return [], []
        flags = self._flags.cpu().tolist()
        escapes = [item for item, flag in zip(self._items[: self._escapes], flags) if flag]
        frames = [item for item, flag in zip(self._items[self._escapes:], flags[self._escapes:]) if flag]
        return escapes, frames


@dataclass
class _Inflation:
    """How one transfer's at-rest payloads are inflated on the device: its frames, its verbatim copies (a plan of
    ranges, copied in one launch), where its frames' statuses start, and the entries whose CRC-32 must be checked
    first (every entry of the transfer)."""

    plan: FramePlan
    copies: FramePlan
    first_status: int
    items: list[int]
    owners: list[int]
    """The entry of each frame."""


@dataclass
class _Expansions:
    """What a load's expansions need: per packed transfer its SplitZip tensors (the rows of its batch table) and
    where its payloads lie in its payload buffer, per transfer at rest its inflation, the device's checks, the
    batch tables (filled on the decode stream)."""

    rows: dict[int, list[int]]
    payload_offsets: dict[int, dict[int, int]]
    inflations: dict[int, _Inflation]
    checks: DeviceChecks
    tables: dict[int, Any]


class DeviceDecodeRoute:
    """Stored bytes cross to the device; the device expands them.

    The tensors of one packed transfer are decoded by one batched launch into one allocation, of which each tensor
    is a view (as ``safetensors`` does for a whole file on the CPU); a tensor too large for a slot gets an
    allocation of its own. Every destination is allocated before the first transfer lands (allocation cost 0.2 ms
    per transfer on the loop's critical path on the H200 host).

    Payloads stored at rest (.szt 1.1) are inflated on the device when an ``inflater`` is given: their stored
    bytes cross as they are, and once the CRC-32 of a transfer's tensors has been checked (the inflater validates
    little), a packed transfer's frames are inflated on its slot's own stream into its slot's own payload buffer
    and batch-decoded from there; a streamed tensor's, on the decode stream, into scratch it is decoded from. A raw
    tensor stored as byte planes (1.2) is inflated the same way, its planes laid out frame by frame, and the codec
    joins them into its destination.

    Args:
        loop (`TransferLoop`): its ring needs device buffers.
        codec (`DeviceCodec`): batched and in-place decoding.
        inflater (`FrameInflater`, *optional*): inflates zstd frames on the device.
    """

    def __init__(self, loop: TransferLoop, codec: DeviceCodec, inflater: FrameInflater | None = None):
        self.loop = loop
        self.codec = codec
        self.inflater = inflater
        self._scratch = codec.new_scratch()  # used on the decode stream only, so reuse is ordered
        self._inflate_streams: list[Any] = []  # one per slot, so that the inflation of transfers overlaps
        self._slot_payloads: list[torch.Tensor] = []  # per slot: the in-memory payloads of its packed transfer
        self._lane_streams: list[Any] = []  # where streamed tensors stored at rest are inflated, in turn
        self._lane_payloads: list[torch.Tensor] = []  # per lane: the in-memory payload of its streamed tensor
        self._next_lane = 0

    def load(self, entries: Sequence[TensorEntry], source: HostSource, *,
             verify: StoredCrcCheck | None = None) -> tuple[list[torch.Tensor], DeviceChecks]:
        """Transfer ``entries`` (of one file) to the device; returns their raw bytes there, flat uint8, in the
        order given, and the device's checks of them. The device work is enqueued, not finished: call
        ``loop.finish()`` before reading either.

        ``verify`` (a source with ``host_writes`` only) takes the CRC-32 of each piece on the thread that read it;
        call its ``check()`` once this returns. Entries stored at rest need an ``inflater`` and ``verify``."""
        at_rest = any(e.at_rest is not None for e in entries)
        if at_rest and (self.inflater is None or verify is None):
            raise ValueError("entries stored at rest are inflated on the device only with an inflater and the "
                             "CRC-32 of their stored bytes checked first")
        order = sorted(range(len(entries)), key=lambda i: entries[i].offset)
        transfers = plan_transfers([Extent(i, entries[i].offset, entries[i].length) for i in order],
                                   self.loop.ring.slot_bytes)
        dests, arenas = self._allocate(transfers, entries)
        planned: list[_Expansions] = []  # made while the first reads run (see ``TransferLoop.run``'s ``prepare``)

        def stage(k: int, transfer: Transfer, slot: Slot) -> Staged:
            return source.stage(transfer, slot, verify=verify, k=k)

        def copy(k: int, slot: Slot, host: torch.Tensor) -> Any:
            transfer = transfers[k]
            if transfer.packed:  # into the slot's device buffer, to be decoded out of it
                self.loop.ring.claim_device(slot, self.loop.copy_stream)
                target = slot.device[: transfer.nbytes]
            else:  # straight into the leading bytes of the tensor's own destination
                (piece,) = transfer.pieces
                target = dests[piece.item][piece.offset: piece.offset + piece.length]
            self.loop.enqueue(self.loop.copy_stream, lambda: target.copy_(host, non_blocking=True), "copy", k,
                              transfer.nbytes)
            return self.loop.ops.record(self.loop.copy_stream)

        def expand(k: int, slot: Slot, copied: Any) -> None:
            transfer, plan = transfers[k], planned[0]
            inflation = plan.inflations.get(k)
            if inflation is not None and verify is not None:
                verify.check_items(inflation.items)  # nothing unchecked reaches the inflater
            if transfer.packed:
                self._expand_packed(k, transfer, arenas[k][0], plan.tables, plan.checks, plan.rows.get(k, ()),
                                    inflation, slot, copied, entries, dests, plan.payload_offsets.get(k, {}))
            else:
                self._expand_streamed(k, transfer, copied, entries, dests, plan.checks, inflation)

        self._next_lane = 0
        self.loop.run(transfers, stage, copy, expand, host_writes=source.host_writes,
                      prepare=lambda: planned.append(self._expansions(transfers, entries, arenas, at_rest)))
        return [dest[: entry.raw_length] for dest, entry in zip(dests, entries)], planned[0].checks

    def _expansions(self, transfers: Sequence[Transfer], entries: Sequence[TensorEntry],
                    arenas: dict[int, tuple[torch.Tensor, list[int]]], at_rest: bool) -> _Expansions:
        """What expanding the transfers needs and copying them does not: the batch tables, the device's checks, the
        frame plans and payload buffers of an at-rest file (5-6 ms of host work for 1.5 GB of FP32 byte planes on
        the H200 host, which held back the first read). Made while the first reads run; the device work it
        enqueues on the current stream comes before every expansion (each stream the route expands on waits)."""
        ops = self.loop.ops
        rows = {k: [p.item for p in transfers[k].pieces if entries[p.item].encoding == ENCODING_SPLITZIP]
                for k in arenas}  # the rows of each packed transfer's batch table
        rows = {k: items for k, items in rows.items() if items}
        streamed = [p.item for t in transfers if not t.packed for p in t.pieces
                    if p.last and entries[p.item].encoding == ENCODING_SPLITZIP and entries[p.item].layout.n_esc]
        payload_offsets, inflations = self._plan_inflation(transfers, entries, rows) if at_rest else ({}, {})
        checks = DeviceChecks(ops, [item for items in rows.values() for item in items] + streamed,
                              [item for inflation in inflations.values() for item in inflation.owners])
        prepared = ops.record(ops.current_stream())
        for stream in (self.loop.decode_stream, *self._inflate_streams, *self._lane_streams):
            ops.wait(stream, prepared)
        tables = self._batch_tables(rows, transfers, entries, arenas, payload_offsets)
        return _Expansions(rows, payload_offsets, inflations, checks, tables)

    def release_scratch(self) -> None:
        """Drop the buffers a load of at-rest payloads used (a payload buffer per slot and per lane, the inflater's
        own), once its device work has finished: an open file (``safe_open``) keeps its loader, and these can hold
        more than a GB of device memory."""
        self._slot_payloads, self._lane_payloads = [], []
        if self.inflater is not None:
            self.inflater.release()

    def _plan_inflation(self, transfers: Sequence[Transfer], entries: Sequence[TensorEntry],
                        rows: dict[int, list[int]]) -> tuple[dict[int, dict[int, int]], dict[int, _Inflation]]:
        """For each transfer with payloads stored at rest: where each SplitZip payload and each tensor's byte planes
        of a packed transfer lie in the in-memory payload buffer (its SplitZip tensors stored in memory are copied
        there too), and how the transfer is inflated; a streamed tensor is inflated, whole, into a scratch buffer
        once its last piece is across.
        Returns the payload offsets per packed transfer and the inflations per transfer."""
        payload_offsets: dict[int, dict[int, int]] = {}
        laid_out = {}  # transfer -> (its entries, their frames, copies and frame owners)
        packed, streamed, streamed_count = 0, 0, 0
        for k, transfer in enumerate(transfers):
            if not any(entries[p.item].at_rest is not None for p in transfer.pieces):
                continue
            if transfer.packed:
                placed, cursor = payload_offsets.setdefault(k, {}), 0
                slot_offset = {p.item: p.slot_offset for p in transfer.pieces}
                planes = [p.item for p in transfer.pieces if entries[p.item].byte_planes]
                for item in list(rows.get(k, ())) + planes:
                    placed[item] = cursor
                    cursor += -(-entries[item].memory_length // INFLATED_ALIGNMENT) * INFLATED_ALIGNMENT
                packed = max(packed, cursor)
                laid_out[k] = ([p.item for p in transfer.pieces],
                               self._lay_out([(item, slot_offset[item], placed[item]) for item in placed], entries))
            else:
                (piece,) = transfer.pieces
                if piece.last:
                    laid_out[k] = ([piece.item], self._lay_out([(piece.item, 0, 0)], entries))
                    streamed = max(streamed, entries[piece.item].memory_length)
                    streamed_count += 1
        self._provide_payload_buffers(packed, streamed, min(streamed_count, STREAMED_LANES))
        inflations: dict[int, _Inflation] = {}
        if laid_out:
            calls = [frames for _, (frames, _, _) in laid_out.values()]
            # the verbatim ranges as "frames" stored as they are: (stored, length, memory, length)
            calls += [copies[:, [0, 2, 1, 2]] for _, (_, copies, _) in laid_out.values()]
            plans = plan_frames(calls, self.loop.ops.device)
            first_status = 0
            for (k, (items, (_, _, owners))), plan, copies in zip(laid_out.items(), plans, plans[len(laid_out):]):
                inflations[k] = _Inflation(plan, copies, first_status, items, owners)
                first_status += plan.count
        return payload_offsets, inflations

    def _provide_payload_buffers(self, packed: int, streamed: int, lanes: int) -> None:
        """In-memory payload buffers of ``packed`` bytes per slot and of ``streamed`` bytes for each of ``lanes``
        lanes of streamed tensors, and their streams, allocated before the run (so none is freed while the device
        may use it): the previous load has finished with the ones they replace. The streams stay, and the loop
        waits for them as for its own (``TransferLoop.side_streams``)."""
        ops, slots = self.loop.ops, self.loop.ring.slots
        if packed and (len(self._slot_payloads) < slots or self._slot_payloads[0].numel() < packed):
            self._slot_payloads = []
            self._slot_payloads = [ops.device_buffer(packed) for _ in range(slots)]
        while packed and len(self._inflate_streams) < slots:
            self._inflate_streams.append(ops.new_stream())
        if lanes and (len(self._lane_payloads) < lanes or self._lane_payloads[0].numel() < streamed):
            self._lane_payloads = []
            self._lane_payloads = [ops.device_buffer(streamed) for _ in range(lanes)]
        while len(self._lane_streams) < lanes:
            self._lane_streams.append(ops.new_stream())
            self.loop.side_streams.append(self._lane_streams[-1])

    @staticmethod
    def _lay_out(placed: Sequence[tuple[int, int, int]], entries: Sequence[TensorEntry]
                 ) -> tuple[np.ndarray, np.ndarray, list[int]]:
        """The frames, the verbatim copies and the entry of each frame that lay out payloads ``(item, stored
        offset, memory offset)`` in memory form (:func:`~.gpu_inflate.frames_of`'s arrays)."""
        no_frames = np.empty((0, 4), dtype=np.int64)
        frames, copies, owners = [no_frames], [np.empty((0, 3), dtype=np.int64)], []
        for item, stored, memory in placed:
            entry = entries[item]
            if entry.at_rest is None:  # stored in memory form: copied as it is
                more_frames, more_copies = no_frames, np.array([[stored, memory, entry.length]], dtype=np.int64)
            elif entry.byte_planes:
                more_frames, more_copies = plane_frames_of(entry.at_rest, entry.raw_length, stored, memory)
            else:
                more_frames, more_copies = frames_of(entry.segments(), stored, memory)
            frames.append(more_frames)
            copies.append(more_copies)
            owners += [item] * len(more_frames)
        return np.concatenate(frames), np.concatenate(copies), owners

    def _allocate(self, transfers: Sequence[Transfer], entries: Sequence[TensorEntry]
                  ) -> tuple[list[torch.Tensor], dict[int, tuple[torch.Tensor, list[int]]]]:
        """Every destination, before the first transfer is copied, so that the loop only enqueues device work: one
        allocation per streamed tensor, one per packed transfer (its tensors are views of it at ``ARENA_ALIGNMENT``
        offsets, decoded by one batched launch), one per tensor with nothing stored; all of them reserved together
        first (:meth:`DeviceOps.reserve`). Returns the destinations in
        the order of ``entries`` and, per packed transfer, its allocation and the offsets in it."""
        record = timeline.current()
        began = record.now() if record is not None else 0.0
        sizes: dict[int, int] = {}  # allocation -> bytes: -1 - k for packed transfer k, the entry's index otherwise
        offsets_of: dict[int, list[int]] = {}
        for k, transfer in enumerate(transfers):
            if transfer.packed:
                offsets, cursor = [], 0
                for piece in transfer.pieces:
                    offsets.append(cursor)
                    cursor += -(-entries[piece.item].raw_length // ARENA_ALIGNMENT) * ARENA_ALIGNMENT
                sizes[-1 - k], offsets_of[k] = cursor, offsets
            elif transfer.pieces[0].offset == 0:
                sizes[transfer.pieces[0].item] = destination_bytes(entries[transfer.pieces[0].item])
        covered = {piece.item for k in offsets_of for piece in transfers[k].pieces}
        for i, entry in enumerate(entries):
            if i not in covered and i not in sizes:  # nothing stored: an empty tensor
                sizes[i] = entry.raw_length
        buffers = dict(zip(sizes, allocate(self.loop.ops, list(sizes.values()))))
        dests: list[torch.Tensor | None] = [buffers.get(i) for i in range(len(entries))]
        arenas: dict[int, tuple[torch.Tensor, list[int]]] = {}
        for k, offsets in offsets_of.items():
            arena = arenas[k] = (buffers[-1 - k], offsets)
            for piece, offset in zip(transfers[k].pieces, offsets):
                dests[piece.item] = arena[0][offset: offset + entries[piece.item].raw_length]
        if record is not None:
            record.add("allocate", -1, began, record.now(), sum(d.numel() for d in dests))
        return dests, arenas

    def _batch_tables(self, rows: dict[int, list[int]], transfers: Sequence[Transfer],
                      entries: Sequence[TensorEntry], arenas: dict[int, tuple[torch.Tensor, list[int]]],
                      payload_offsets: dict[int, dict[int, int]]) -> dict[int, Any]:
        """The batch table of every packed transfer holding SplitZip tensors (``rows[k]``: their entries; their
        payloads at ``payload_offsets[k]`` when inflated on the device, else where they lie in the slot), built
        before the first transfer is copied and sent to the device in one copy on the decode stream (built one by
        one as decodes are enqueued, with a pinned allocation and copies each, they cost the decoding thread 1-10 ms
        apiece on the H200 host)."""
        batches = {}
        for k, items in rows.items():
            at = dict(zip((p.item for p in transfers[k].pieces), zip(transfers[k].pieces, arenas[k][1])))
            placed = payload_offsets.get(k)
            batches[k] = [(entries[i].layout, entries[i].codebook,
                           at[i][0].slot_offset if placed is None else placed[i], at[i][1] // 2) for i in items]
        tables: dict[int, Any] = {}
        if batches:
            upload = lambda: tables.update(zip(batches, self.codec.batch_tables(  # noqa: E731
                list(batches.values()), self.loop.ops.device)))
            self.loop.ops.enqueue(self.loop.decode_stream, upload, "tables")
        return tables

    def _expand_packed(self, k: int, transfer: Transfer, arena: torch.Tensor, tables: dict[int, Any],
                       checks: DeviceChecks, rows: Sequence[int], inflation: _Inflation | None, slot: Slot,
                       copied: Any, entries, dests, placed: dict[int, int]) -> None:
        """Decode a packed transfer out of its slot once copied, then release the slot's device buffer. Stored at
        rest, it is first inflated on a stream of the slot's own into a buffer of the slot's own (``placed``: where
        each tensor's payload or planes lie there): one call of nvCOMP takes 8-10 ms on the H200 whatever its
        frames, so the transfers' calls must overlap."""
        ops, loop = self.loop.ops, self.loop
        staged = slot.device[: transfer.nbytes]
        payloads = staged
        if inflation is not None:
            stream, payloads = self._inflate_streams[slot.index], self._slot_payloads[slot.index]
            ops.wait(stream, copied)
            loop.enqueue(stream, lambda: self._inflate(staged, inflation, payloads, checks), "inflate", k)
            copied = ops.record(stream)

        def expand() -> None:
            for piece in transfer.pieces:  # raw pieces are copied as they are, or joined from their planes
                entry = entries[piece.item]
                if entry.byte_planes:
                    start = placed[piece.item]
                    self._join(entry, payloads[start: start + entry.raw_length], dests[piece.item])
                elif entry.encoding != ENCODING_SPLITZIP:
                    dests[piece.item].copy_(staged[piece.slot_offset: piece.slot_offset + piece.length])
            if k in tables:
                self.codec.decode_batch(payloads, tables[k], arena.view(torch.bfloat16), checks.escapes(rows))

        ops.wait(loop.decode_stream, copied)
        try:
            loop.enqueue(loop.decode_stream, expand, "decode", k)
        finally:  # a failed launch still ends the claim (the run is failing, and waits for the device)
            loop.ring.release_device(slot, ops.record(loop.decode_stream))

    def _expand_streamed(self, k: int, transfer: Transfer, copied: Any, entries, dests, checks: DeviceChecks,
                         inflation: _Inflation | None) -> None:
        """Once the last piece of a streamed tensor is copied, expand the tensor over its destination: in place on
        the decode stream, or, stored at rest, on the next lane (:data:`STREAMED_LANES`): its payload, or its
        planes, inflated into the lane's scratch and decoded, or joined, from there."""
        (piece,) = transfer.pieces
        entry = entries[piece.item]
        if not piece.last or not (entry.byte_planes or entry.encoding == ENCODING_SPLITZIP):
            return  # raw bytes stored as they are: already in place
        dest, errors = dests[piece.item], checks.escapes([piece.item])
        stream, label = self.loop.decode_stream, "decode"
        if inflation is not None:
            lane = self._next_lane % len(self._lane_payloads)  # the lanes of this load (streams may be more)
            self._next_lane += 1
            stream, scratch, label = self._lane_streams[lane], self._lane_payloads[lane], "inflate"
        if entry.byte_planes:
            def work() -> None:
                planes = self._inflate(dest, inflation, scratch, checks)[: entry.raw_length]
                self._join(entry, planes, dest[: entry.raw_length])
        elif inflation is None:
            work = lambda: self.codec.decode_in_place(  # noqa: E731
                dest, entry.layout, entry.codebook, self._scratch, errors)
        else:
            def work() -> None:
                payload = self._inflate(dest, inflation, scratch, checks)[: entry.memory_length]
                self.codec.decode(payload, entry.layout, entry.codebook,
                                  dest[: entry.raw_length].view(torch.bfloat16), errors)
        self.loop.ops.wait(stream, copied)
        self.loop.enqueue(stream, work, label, k)

    def _join(self, entry: TensorEntry, planes: torch.Tensor, out: torch.Tensor) -> None:
        """Join the byte planes of raw tensor ``entry``, inflated into ``planes``, into its elements ``out``."""
        stage = entry.at_rest
        self.codec.join_planes(planes, out, stage.itemsize, stage.frame_size, stage.transform == "sign_last")

    def _inflate(self, stored: torch.Tensor, inflation: _Inflation, out: torch.Tensor,
                 checks: DeviceChecks) -> torch.Tensor:
        """Lay out ``inflation``'s payloads in memory form in ``out`` from their stored bytes (on the current
        stream); returns ``out``."""
        self.inflater.inflate(stored, inflation.plan, out, checks.frames(inflation.first_status, inflation.plan.count))
        if inflation.copies.count:
            self.codec.copy_ranges(stored, out, inflation.copies)
        return out


