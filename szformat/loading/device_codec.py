"""The device codec as the loading routes call it: batched decode, and in-place expansion over a slot.

The routes enqueue decoding through a :class:`DeviceCodec`; :func:`triton_codec` wraps the Triton kernels of
:mod:`szformat.codec.gpu` (imported only here, only when a device route is used), and tests pass the CPU reference
instead, so the scheduling runs the same without a GPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence

import torch

from ..codec import cpu as cpu_codec
from ..codec import planes as byte_planes
from ..codec.codebook import Codebook
from ..codec.layout import PayloadLayout
from ..errors import DecodeRouteError

__all__ = ["BatchEntry", "DeviceCodec", "HostCodec", "TritonCodec", "triton_codec", "pack_arrays", "unpack_arrays"]

_TABLE_ALIGNMENT = 16
"""Bytes each array of an uploaded batch table starts on (the widest element is 8 bytes)."""

BatchEntry = tuple[PayloadLayout, Codebook, int, int]
"""One tensor of a batch: layout, codebook, payload offset (bytes, multiple of 16) into the batch's payload buffer,
output offset (elements, multiple of 8) into its bfloat16 output buffer."""


class DeviceCodec(Protocol):
    """Decoding on the device. ``batch_tables`` is host work done ahead of time; the other calls enqueue on the
    current stream and never wait on the host."""

    def batch_tables(self, batches: Sequence[Sequence[BatchEntry]], device: torch.device) -> list[Any]:
        """Describe each batch once, on the host; their tables may cross to the device together, in one copy
        enqueued on the current stream."""

    def decode_batch(self, payloads: torch.Tensor, table: Any, out: torch.Tensor,
                     errors: torch.Tensor | None = None) -> None:
        """Decode every tensor of ``table`` from ``payloads`` (uint8) into ``out`` (bfloat16) in a few launches.

        With ``errors`` (int32 on the device, one per entry of the table), an entry whose escape streams break a
        rule of the spec gets a 1 there: its tensor is not to be used."""

    def decode_batch_at(self, payloads: torch.Tensor, table: Any, base: torch.Tensor) -> None:
        """The same, with output offsets counted from ``base`` (bfloat16, the lowest output) and allowed past its
        end: outputs are separate tensors of one address range the caller owns."""

    def decode(self, payload: torch.Tensor, layout: PayloadLayout, codebook: Codebook, out: torch.Tensor,
               errors: torch.Tensor | None = None) -> None:
        """Decode one payload (uint8) into ``out`` (bfloat16, ``layout.n`` elements); ``errors`` as for
        :meth:`decode_batch`."""

    def new_scratch(self) -> Any:
        """Reusable scratch for :meth:`decode_in_place`; keep one per stream."""

    def decode_in_place(self, buffer: torch.Tensor, layout: PayloadLayout, codebook: Codebook, scratch: Any,
                        errors: torch.Tensor | None = None) -> None:
        """Expand the payload in the leading ``layout.comp_bytes`` of ``buffer`` over ``buffer[:layout.raw_bytes]``;
        ``errors`` (one int32 on the device) as for :meth:`decode_batch`."""

    def join_planes(self, planes: torch.Tensor, out: torch.Tensor, itemsize: int, frame_size: int,
                    sign_last: bool) -> None:
        """Join the frames of ``frame_size`` bytes of byte planes in ``planes`` (uint8, as the inflater lays a raw
        tensor stored at rest out) into its elements ``out`` (uint8, as long)."""

    def copy_ranges(self, source: torch.Tensor, out: torch.Tensor, ranges: Any) -> None:
        """Copy every range of ``ranges`` (a :class:`~.gpu_inflate.FramePlan` whose frames are verbatim: stored
        offset, memory offset and length) from ``source`` into ``out`` (both uint8), in one launch."""


class HostCodec:
    """The batched decode of :class:`DeviceCodec` on CPU tensors, by the reference decoder (the resident route on
    the CPU); one decode per tensor of a batch."""

    def batch_tables(self, batches: Sequence[Sequence[BatchEntry]], device: torch.device) -> list[Any]:
        return [list(entries) for entries in batches]

    def decode_batch(self, payloads: torch.Tensor, table: Any, out: torch.Tensor,
                     errors: torch.Tensor | None = None) -> None:
        for i, (layout, codebook, payload_offset, output_offset) in enumerate(table):
            self.decode(payloads[payload_offset: payload_offset + layout.comp_bytes], layout, codebook,
                        out[output_offset: output_offset + layout.n], None if errors is None else errors[i:i + 1])

    def decode(self, payload: torch.Tensor, layout: PayloadLayout, codebook: Codebook, out: torch.Tensor,
               errors: torch.Tensor | None = None) -> None:
        cpu_codec.decode(payload, layout, codebook, out=out)

    def join_planes(self, planes: torch.Tensor, out: torch.Tensor, itemsize: int, frame_size: int,
                    sign_last: bool) -> None:
        source, target = memoryview(planes.numpy()), memoryview(out.numpy())
        for start in range(0, len(target), frame_size):
            frame = source[start: start + frame_size]
            plane = len(frame) // itemsize
            byte_planes.join_planes([frame[j * plane: (j + 1) * plane] for j in range(itemsize)],
                                    target[start: start + frame_size], itemsize, sign_last)

    def copy_ranges(self, source: torch.Tensor, out: torch.Tensor, ranges: Any) -> None:
        for start, target, length in zip(ranges.stored.tolist(), ranges.memory.tolist(),
                                         ranges.memory_lengths.tolist()):
            out[target: target + length].copy_(source[start: start + length])


class TritonCodec:
    """:class:`DeviceCodec` over the Triton kernels of :mod:`szformat.codec.gpu`."""

    def __init__(self, kernels: Any):
        self._kernels = kernels

    def batch_tables(self, batches: Sequence[Sequence[BatchEntry]], device: torch.device) -> list[Any]:
        tables = [self._kernels.build_batch_table(batch, device="cpu") for batch in batches]
        if device.type != "cuda" or not tables:
            return tables  # the Triton interpreter decodes CPU tensors
        # Every array of every table in one pinned buffer, so that one copy (only enqueued: a pageable one would
        # make the host wait for the stream) takes them all, and the device arrays are views of its result.
        arrays = [a for t in tables for a in (t.descriptors, t.tile_owner, t.escape_owner)]
        host, offsets = pack_arrays(arrays, pin=True)
        views = unpack_arrays(host.to(device, non_blocking=True), arrays, offsets)
        return [dataclasses.replace(t, descriptors=views[3 * i], tile_owner=views[3 * i + 1],
                                    escape_owner=views[3 * i + 2]) for i, t in enumerate(tables)]

    def decode_batch(self, payloads: torch.Tensor, table: Any, out: torch.Tensor,
                     errors: torch.Tensor | None = None) -> None:
        self._kernels.decode_batch(payloads, table, out=out, errors=errors)

    def decode_batch_at(self, payloads: torch.Tensor, table: Any, base: torch.Tensor) -> None:
        self._kernels.decode_batch_at(payloads, table, base)

    def decode(self, payload: torch.Tensor, layout: PayloadLayout, codebook: Codebook, out: torch.Tensor,
               errors: torch.Tensor | None = None) -> None:
        self._kernels.decode(payload, layout, codebook, out=out, errors=errors)

    def new_scratch(self) -> Any:
        return self._kernels.DecodeScratch()

    def decode_in_place(self, buffer: torch.Tensor, layout: PayloadLayout, codebook: Codebook, scratch: Any,
                        errors: torch.Tensor | None = None) -> None:
        self._kernels.decode_in_place(buffer, layout, codebook, scratch=scratch, errors=errors)

    def join_planes(self, planes: torch.Tensor, out: torch.Tensor, itemsize: int, frame_size: int,
                    sign_last: bool) -> None:
        self._kernels.join_planes(planes, out, itemsize, frame_size, sign_last)

    def copy_ranges(self, source: torch.Tensor, out: torch.Tensor, ranges: Any) -> None:
        self._kernels.copy_ranges(source, out, ranges.stored, ranges.memory, ranges.memory_lengths,
                                  ranges.max_memory_length)


def pack_arrays(arrays: Sequence[torch.Tensor], *, pin: bool = False) -> tuple[torch.Tensor, list[int]]:
    """The bytes of ``arrays`` (CPU tensors, any shape, empty ones too) in one flat uint8 buffer, each starting on a
    multiple of 16 bytes; returns the buffer (pinned if ``pin``) and each array's offset in it."""
    offsets, end = [], 0
    for array in arrays:
        offsets.append(end)
        end += -(-array.numel() * array.element_size() // _TABLE_ALIGNMENT) * _TABLE_ALIGNMENT
    packed = torch.empty(max(end, _TABLE_ALIGNMENT), dtype=torch.uint8, pin_memory=pin)
    for array, offset in zip(arrays, offsets):
        if array.numel():
            packed[offset: offset + array.numel() * array.element_size()] = (
                array.contiguous().reshape(-1).view(torch.uint8))
    return packed, offsets


def unpack_arrays(packed: torch.Tensor, like: Sequence[torch.Tensor], offsets: Sequence[int]) -> list[torch.Tensor]:
    """Views of ``packed`` (from :func:`pack_arrays`, wherever it was copied) shaped and typed as ``like``."""
    return [packed[offset: offset + a.numel() * a.element_size()].view(a.dtype).reshape(a.shape)
            for a, offset in zip(like, offsets)]


def triton_codec() -> TritonCodec:
    """The Triton codec, or a :class:`DecodeRouteError` that says why not (Triton missing or too old:
    :func:`~szformat.codec.gpu.triton_missing`) and how to do without."""
    from ..codec import gpu as kernels

    problem = kernels.triton_missing()
    if problem is None:
        try:
            kernels.decode_in_place  # noqa: B018 - the first use imports Triton
        except (ImportError, DecodeRouteError) as e:
            problem = str(e)
    if problem is not None:
        raise DecodeRouteError(f"decoding on the device cannot use Triton: {problem}; or pass route='cpu' to decode "
                               "on the CPU and copy the tensors")
    return TritonCodec(kernels)
