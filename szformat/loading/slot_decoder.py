"""Native-transport slot decoding: expand a payload over the raw-sized device slot it was copied into.

An offloading runtime that moves bytes itself (its own DMA into a slot it allocated for the raw tensor) only has
to copy the leading ``comp_bytes`` of a tensor's payload: :meth:`SlotDecoder.expand` then enqueues, on the stream
that carried the copy, the expansion of the full BF16 tensor over the slot, and returns the event the consumer waits
on before compute. The payload is first stashed in scratch memory kept per stream, since the tensor overwrites it.
:meth:`SlotDecoder.expand_packed` does the same for many tensors placed in one buffer, with one stash copy and one
batched decode instead of launches per tensor.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, Sequence

import torch

from ..codec.codebook import Codebook
from ..codec.gate import ENCODING_SPLITZIP
from ..codec.layout import PayloadLayout
from ..errors import DecodeRouteError
from .gpu_codec import DeviceCodec, triton_codec
from .ops import DeviceOps, cuda_ops

__all__ = ["PayloadLike", "SlotDecoder"]

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
        """``nbytes`` of device memory reused on ``stream`` only; called from work enqueued there, so a buffer
        replaced by a larger one is recycled by the allocator only behind that stream's earlier work."""
        stash = self._stash.get(stream)
        if stash is None or stash.numel() < nbytes:
            stash = self._stash[stream] = self.ops.device_buffer(nbytes + nbytes // 2)
        return stash[:nbytes]


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
