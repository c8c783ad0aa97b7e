"""Which encoding each tensor gets, and the bit-exact round-trip check before anything is stored.

The codec takes a tensor only when it pays and is safe: BF16 with Top-16 coverage >= 0.99 and a payload smaller
than the raw bytes. Every other tensor (other dtypes, FP8 above all: it would expand) is stored raw, with a reason.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from types import ModuleType
from typing import Protocol

from .._lazy import cpu_codec as cpu
from .._lazy import torch
from .._reused import ReusedBuffer
from ..checksum import tensor_crc32
from ..errors import RoundTripMismatch
from .codebook import COVERAGE_GATE, Codebook
from .layout import ENCODING_RAW, ENCODING_SPLITZIP, PayloadLayout

TOO_LARGE_REASON = "more than 2^41 elements"
"""Why a BF16 tensor past :meth:`PayloadLayout.max_elements` is stored raw: its chunk ids would not fit an int32."""


class CodecBackend(Protocol):
    """What a device's codec offers: the CPU module and the Triton module both fit."""

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, PayloadLayout, Codebook]: ...

    def decode(self, payload: torch.Tensor, layout: PayloadLayout, codebook: Codebook) -> torch.Tensor: ...


@dataclass(frozen=True)
class EncodedTensor:
    """The bytes to store for one tensor, with what the header records about them."""

    encoding: str
    payload: torch.Tensor
    raw_length: int
    raw_crc32: int
    crc32: int
    layout: PayloadLayout | None = None
    codebook: Codebook | None = None
    raw_reason: str | None = None


def encode_tensor(raw: torch.Tensor, dtype: str, *, backend: CodecBackend | ModuleType = cpu,
                  device: str | torch.device = "cpu", gate: float = COVERAGE_GATE,
                  buffer: ReusedBuffer | None = None) -> EncodedTensor:
    """Choose the encoding of one tensor given its raw bytes (flat uint8, CPU) and safetensors dtype name.

    ``backend`` encodes and decodes on ``device`` (the CPU module, or the Triton module with a CUDA device); the
    stored bytes are the same either way. SplitZip payloads are decoded again and compared with the source bit for
    bit before they are returned: by the CPU codec as it writes them (``cpu.encode_into``), or on the device, from
    the host copy that will be stored. With ``buffer``, the CPU codec writes the payload into it: the payload
    returned is then valid until the buffer's next use.

    Raises:
        RoundTripMismatch: the payload does not decode to the source (a codec bug; nothing must be written).
    """
    if dtype != "BF16":
        reason = "FP8 would expand" if dtype.startswith("F8") else f"dtype {dtype} is not encoded"
        return _stored_raw(raw, tensor_crc32(raw), reason)
    if raw.numel() == 0:
        return _stored_raw(raw, tensor_crc32(raw), "empty")
    if raw.numel() // 2 > PayloadLayout.max_elements():  # chunk ids are int32
        return _stored_raw(raw, tensor_crc32(raw), TOO_LARGE_REASON)

    with _BesideTheCodec(raw) as raw_crc:
        x = raw.view(torch.bfloat16).to(device)
        checked = getattr(backend, "__name__", None) == cpu.__name__  # the CPU codec checks as it encodes
        payload, layout, codebook = backend.encode(x, buffer=buffer) if checked else backend.encode(x)
        if codebook.coverage < gate:
            return _stored_raw(raw, raw_crc.result(), f"coverage {codebook.coverage:.4f} < {gate}")
        if layout.comp_bytes >= layout.raw_bytes:
            return _stored_raw(raw, raw_crc.result(), "payload not smaller")
        payload = payload.cpu()
        with _BesideTheCodec(payload) as payload_crc:
            if not checked and not _decodes_to(backend, payload, layout, codebook, x):
                raise RoundTripMismatch("SplitZip payload does not decode bit for bit to the source tensor")
            return EncodedTensor(ENCODING_SPLITZIP, payload, raw.numel(), raw_crc.result(), payload_crc.result(),
                                 layout=layout, codebook=codebook)


def _stored_raw(raw: torch.Tensor, raw_crc: int, reason: str) -> EncodedTensor:
    return EncodedTensor(ENCODING_RAW, raw, raw.numel(), raw_crc, raw_crc, raw_reason=reason)


CRC_THREAD_MIN_BYTES = 1 << 20
"""Smaller buffers get their CRC-32 computed at once: handing them to the thread would cost more than it saves."""


def _start_crc_thread() -> None:
    """(Re)create the thread that computes CRC-32s beside the codec; a forked child gets a fresh one (it inherits
    the executor but not its thread)."""
    global _crc_thread
    _crc_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="szformat-crc32")


_start_crc_thread()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_start_crc_thread)


class _BesideTheCodec:
    """``with _BesideTheCodec(data) as crc:`` starts the CRC-32 of ``data`` on a thread of its own; ``crc.result()``
    waits for it. The CRC releases the GIL, so on a second core its time leaves the conversion's. Leaving the block
    waits too, whatever happens in it, so ``data`` (often a view of a mapping the caller will close) is never read
    after the block."""

    def __init__(self, data: torch.Tensor):
        if data.numel() >= CRC_THREAD_MIN_BYTES:
            self._future = _crc_thread.submit(tensor_crc32, data)
        else:
            self._future = Future()
            self._future.set_result(tensor_crc32(data))

    def __enter__(self) -> Future:
        return self._future

    def __exit__(self, *exc_info) -> None:
        wait([self._future])


def _decodes_to(backend: CodecBackend | ModuleType, payload: torch.Tensor, layout: PayloadLayout,
                codebook: Codebook, x: torch.Tensor) -> bool:
    """Whether ``payload`` (the bytes to be stored) decodes bit for bit to ``x`` on ``x``'s device."""
    decoded = backend.decode(payload.to(x.device), layout, codebook)
    return torch.equal(decoded.reshape(-1).view(torch.int16), x.reshape(-1).view(torch.int16))
