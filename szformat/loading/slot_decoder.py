"""Slot decoding for runtimes that move bytes themselves: expand stored payloads into their device tensors.

Two shapes of the same job, each enqueued on the stream that carried the copies and returning the event the
consumer waits on before compute:

* **Scattered** (:meth:`SlotDecoder.expand_scattered`, the fast path): a group's stored bytes are copied into a
  device staging buffer (:meth:`SlotDecoder.copy_to_staging`; one buffer per stream, as large as the largest group's
  stored bytes), and one batched decode writes every tensor of the group to its own destination, wherever it lies. Two
  launches per group whatever its tensor count, no stash, and the decode reads each payload byte once: it runs at
  the rate of an out-of-place decode. The group's layout is described once (:meth:`SlotDecoder.scatter_plan`) and
  reused at every upload.
* **In place** (:meth:`SlotDecoder.expand`, :meth:`SlotDecoder.expand_packed`): the payload was copied into the
  leading ``comp_bytes`` of the tensor's own raw-sized slot; it is stashed in scratch memory first, since the tensor
  overwrites it. For runtimes that can only copy into the destination.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence

import torch

from ..codec.codebook import Codebook
from ..codec.layout import ENCODING_SPLITZIP
from ..codec.layout import PayloadLayout
from ..errors import DecodeRouteError
from .device_codec import DeviceCodec, triton_codec
from .ops import DeviceOps, cuda_ops

__all__ = ["PayloadLike", "Placement", "ScatterPlan", "SlotDecoder"]

PACKED_ALIGNMENT = 16
"""Tensors expanded together by :meth:`SlotDecoder.expand_packed` must start at multiples of this many bytes."""


class PayloadLike(Protocol):
    """What expansion needs to know of a stored tensor (``PayloadDescriptor`` and ``TensorEntry`` both fit)."""

    name: str
    encoding: str
    length: int
    raw_length: int
    layout: PayloadLayout | None
    codebook: Codebook | None


@dataclass(frozen=True)
class Placement:
    """One tensor of a scattered group: its stored bytes at ``staging_offset`` of the staging buffer, its raw bytes
    due at ``destination`` (a flat contiguous uint8 device tensor of ``payload.raw_length`` bytes)."""

    staging_offset: int
    destination: torch.Tensor
    payload: PayloadLike


@dataclass
class ScatterPlan:
    """A group's expansion, described once and reused at every upload of the group.

    ``batch`` lists the SplitZip tensors decoded together (layout, codebook, staging offset, output offset in
    elements from ``base``); ``copies`` the raw-stored tensors, copied from staging as they are; ``in_place`` the
    SplitZip tensors whose destination does not start on a 16-byte boundary, copied to their destination's head and
    expanded there. ``staging_bytes`` is what the staging buffer must hold.
    """

    staging_bytes: int
    base: torch.Tensor | None = None
    batch: list[tuple[PayloadLayout, Codebook, int, int]] = field(default_factory=list)
    copies: list[Placement] = field(default_factory=list)
    in_place: list[Placement] = field(default_factory=list)
    table: Any = None
    """The batch's device table, built on the stream at the first upload."""


class SlotDecoder:
    """Expands SplitZip payloads in place over device slots sized for their raw tensors.

    Args:
        device (`str` or `torch.device`, *optional*): the CUDA device of the slots; the current one by default.
        ops (`DeviceOps`, *optional*), codec (`DeviceCodec`, *optional*): replace the CUDA streams and the Triton
            kernels (tests run the same schedule on the CPU with them).

    Raises:
        DecodeRouteError: no CUDA device, or no Triton.

    Example:
        >>> decoder = SlotDecoder("cuda")  # doctest: +SKIP
        >>> slot[: d.length].copy_(pinned_payload, non_blocking=True)  # the runtime's own DMA, on `stream`
        >>> ready = decoder.expand(slot, d, stream)  # the BF16 tensor is slot[: d.raw_length] once `ready` fires
        >>> torch.cuda.current_stream().wait_event(ready)
    """

    def __init__(self, device: str | torch.device | None = None, *, ops: DeviceOps | None = None,
                 codec: DeviceCodec | None = None):
        self.ops = ops if ops is not None else cuda_ops(device if device is not None else "cuda")
        self.codec = codec if codec is not None else triton_codec()
        self._scratch: dict[Any, Any] = {}
        self._stash: dict[Any, torch.Tensor] = {}
        self._staging: dict[Any, torch.Tensor] = {}

    def scatter_plan(self, placements: Sequence[Placement]) -> ScatterPlan:
        """Describe the expansion of a group whose stored bytes sit in a staging buffer (see :class:`ScatterPlan`).

        Raises:
            DecodeRouteError: a staging offset is not a multiple of 16 bytes, a destination is not a flat uint8
                tensor of the raw size on the decoder's device, or two destinations overlap.
        """
        plan = ScatterPlan(staging_bytes=max((p.staging_offset + p.payload.length for p in placements), default=0))
        batched: list[Placement] = []
        for placement in placements:
            payload, destination = placement.payload, placement.destination
            if placement.staging_offset % PACKED_ALIGNMENT:
                raise DecodeRouteError(f"staging offset {placement.staging_offset} is not a multiple of "
                                       f"{PACKED_ALIGNMENT} bytes", path=_path(payload), tensor=payload.name)
            if (destination.dtype != torch.uint8 or destination.dim() != 1 or not destination.is_contiguous()
                    or destination.numel() != payload.raw_length):
                raise DecodeRouteError(f"destination must be a flat contiguous uint8 tensor of {payload.raw_length} "
                                       f"bytes, got {destination.dtype} {tuple(destination.shape)}",
                                       path=_path(payload), tensor=payload.name)
            if payload.encoding != ENCODING_SPLITZIP:
                plan.copies.append(placement)
            elif payload.layout.n and destination.data_ptr() % PACKED_ALIGNMENT == 0:
                batched.append(placement)
            elif payload.layout.n:
                _check_slot(destination, payload, 0)
                plan.in_place.append(placement)
        spans = sorted((p.destination.data_ptr(), p.destination.data_ptr() + p.payload.raw_length, p.payload.name)
                       for p in placements)
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if start < end:
                raise DecodeRouteError(f"destinations of {first} and {second} overlap", tensor=second)
        if batched:
            plan.base = min((p.destination for p in batched), key=torch.Tensor.data_ptr).view(torch.bfloat16)
            origin = plan.base.data_ptr()
            plan.batch = [(p.payload.layout, p.payload.codebook, p.staging_offset,
                           (p.destination.data_ptr() - origin) // 2) for p in batched]
        return plan

    def copy_to_staging(self, pieces: Sequence[tuple[int, torch.Tensor]], nbytes: int, stream: Any = None) -> None:
        """Enqueue on ``stream`` the copies of ``pieces`` (``(staging offset, host uint8 tensor)``, the host side
        pinned or registered so the copies only enqueue) into the stream's staging buffer, sized for ``nbytes``."""
        stream = self.ops.current_stream() if stream is None else stream

        def copy() -> None:
            staging = self._buffer_on(self._staging, stream, nbytes, spare=False)
            for offset, host in pieces:
                staging[offset: offset + host.numel()].copy_(host, non_blocking=True)

        self.ops.enqueue(stream, copy, "copy")

    def expand_scattered(self, plan: ScatterPlan, stream: Any = None) -> Any:
        """Enqueue on ``stream``, after the copies into its staging buffer (:meth:`copy_to_staging`), the expansion
        of every tensor of ``plan`` into its destination; return an event recorded after it, after which the staging
        buffer may be refilled."""
        stream = self.ops.current_stream() if stream is None else stream

        def expand() -> None:
            staging = self._buffer_on(self._staging, stream, plan.staging_bytes, spare=False)
            for placement in plan.copies:
                start = placement.staging_offset
                placement.destination.copy_(staging[start: start + placement.payload.raw_length])
            for placement in plan.in_place:
                start, length = placement.staging_offset, placement.payload.length
                placement.destination[:length].copy_(staging[start: start + length])
            if plan.batch:
                if plan.table is None:
                    (plan.table,) = self.codec.batch_tables([plan.batch], staging.device)
                self.codec.decode_batch_at(staging, plan.table, plan.base)

        if plan.batch or plan.copies or plan.in_place:
            self.ops.enqueue(stream, expand, "decode")
        for placement in plan.in_place:
            self.expand(placement.destination, placement.payload, stream)
        return self.ops.record(stream)

    def expand(self, slot: torch.Tensor, payload: PayloadLike, stream: Any = None) -> Any:
        """Enqueue on ``stream`` the expansion of the payload held in ``slot[:payload.length]`` over
        ``slot[:payload.raw_length]``, and return an event recorded after it.

        Args:
            slot (`torch.Tensor`): flat contiguous uint8 device tensor, 4-byte aligned, of at least
                ``max(payload.raw_length, payload.length)`` bytes, whose leading ``payload.length`` bytes were (or
                are being, earlier on ``stream``) copied from the stored payload.
            payload (`PayloadLike`): the tensor's header entry or descriptor. Raw entries need no expansion: the
                event then only marks the copy.
            stream (*optional*): the stream that carried the copy; the current stream by default.

        Raises:
            DecodeRouteError: the slot is too small for the payload or the tensor.
        """
        stream = self.ops.current_stream() if stream is None else stream
        _check_slot(slot, payload, 0)
        if payload.encoding == ENCODING_SPLITZIP and payload.layout.n:
            scratch = self._scratch_for(stream)
            self.ops.enqueue(stream, lambda: self.codec.decode_in_place(
                slot, payload.layout, payload.codebook, scratch), "decode")
        return self.ops.record(stream)

    def expand_packed(self, buffer: torch.Tensor, placed: Sequence[tuple[int, PayloadLike]], stream: Any = None) -> Any:
        """Enqueue on ``stream`` the expansion of many tensors placed in one buffer, and return an event after it.

        ``placed`` lists ``(offset, payload)``: tensor ``payload`` occupies ``buffer[offset: offset + raw_length]``
        and its stored bytes were copied to the leading ``payload.length`` bytes of that range. Offsets are
        multiples of 16 bytes and ranges do not overlap. One copy stashes the whole used range, then one batched
        decode expands every SplitZip tensor; raw tensors are left as they arrived.
        """
        stream = self.ops.current_stream() if stream is None else stream
        batch = []
        used = 0
        for offset, payload in placed:
            if offset % PACKED_ALIGNMENT:
                raise DecodeRouteError(f"offset {offset} in the packed buffer is not a multiple of "
                                       f"{PACKED_ALIGNMENT} bytes", path=_path(payload), tensor=payload.name)
            _check_slot(buffer, payload, offset)
            used = max(used, offset + max(payload.raw_length, payload.length))
            if payload.encoding == ENCODING_SPLITZIP and payload.layout.n:
                batch.append((payload.layout, payload.codebook, offset, offset // 2))
        if batch:
            region = buffer[: min(-(-used // PACKED_ALIGNMENT) * PACKED_ALIGNMENT, buffer.numel() // 2 * 2)]

            def expand() -> None:
                (table,) = self.codec.batch_tables([batch], buffer.device)
                stash = self._stash_on(stream, region.numel())
                stash.copy_(region)
                self.codec.decode_batch(stash, table, region.view(torch.bfloat16))

            self.ops.enqueue(stream, expand, "decode")
        return self.ops.record(stream)

    def _scratch_for(self, stream: Any) -> Any:
        """The codec's scratch for ``stream``: used on that stream only, so its reuse is ordered by it."""
        if stream not in self._scratch:
            self._scratch[stream] = self.codec.new_scratch()
        return self._scratch[stream]

    def _stash_on(self, stream: Any, nbytes: int) -> torch.Tensor:
        return self._buffer_on(self._stash, stream, nbytes)

    def _buffer_on(self, buffers: dict[Any, torch.Tensor], stream: Any, nbytes: int, spare: bool = True
                   ) -> torch.Tensor:
        """``nbytes`` of device memory reused on ``stream`` only; called from work enqueued there, so a buffer
        replaced by a larger one is recycled by the allocator only behind that stream's earlier work. With ``spare``
        it grows by half again, to spare regrowth; the staging buffer grows to the largest group exactly (a model's
        groups are few and alike, and its size is the route's extra device memory)."""
        buffer = buffers.get(stream)
        if buffer is None or buffer.numel() < nbytes:
            buffer = buffers[stream] = self.ops.device_buffer(nbytes + nbytes // 2 if spare else nbytes)
        return buffer[:nbytes]


def _path(payload: PayloadLike) -> str | os.PathLike | None:
    return getattr(payload, "path", None)


def _check_slot(slot: torch.Tensor, payload: PayloadLike, offset: int) -> None:
    if slot.dtype != torch.uint8 or slot.dim() != 1 or not slot.is_contiguous():
        raise ValueError(f"a slot must be a flat contiguous uint8 tensor, got {slot.dtype} {tuple(slot.shape)}")
    room = slot.numel() - offset
    if payload.length > room:
        raise DecodeRouteError(f"payload of {payload.length} bytes is larger than its slot ({room} bytes)",
                               path=_path(payload), tensor=payload.name)
    if payload.raw_length > room:
        raise DecodeRouteError(f"tensor of {payload.raw_length} bytes does not fit its slot ({room} bytes)",
                               path=_path(payload), tensor=payload.name)
