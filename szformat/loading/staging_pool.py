"""The staging-pool decoder: a pinned pool whose entries advance by raw size, expanded on the device after upload.

An offloader that streams weights group by group packs each group into a pinned staging slot and uploads the slot
into a device buffer laid out the same way. With .szt files an entry reserves the tensor's *raw* size (so host and
device layouts stay the same whatever the route) while only its leading ``comp_bytes`` hold the stored payload and
cross PCIe. After the copies, the expansion is enqueued on the same stream, and only then is the upload marked done:
whoever waits on that event sees the decoded tensors. Without Triton (Windows) or with ``route="cpu"`` the CPU
decodes each tensor into its entry instead, bit for bit the same, and the raw bytes cross.

The two steps are reusable on their own: :func:`stage_entry` fills one entry of any pinned range, and
:func:`copy_and_expand` copies entries to a device buffer and expands them there, on one stream, returning the event.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..codec.codebook import Codebook
from ..codec.layout import ENCODING_SPLITZIP
from ..codec.layout import PayloadLayout
from ..errors import DecodeRouteError
from ..format.payloads import decode_entry
from ..format.reader import SztFile
from .device_codec import DeviceCodec, triton_codec
from .ops import DeviceOps, cuda_ops
from .ring import Slot, StagingRing
from .slot_decoder import SlotDecoder

__all__ = ["StagedEntry", "StagingPoolDecoder", "describe_entry", "stage_entry", "copy_and_expand"]

ROUTES = ("auto", "gpu", "cpu")


@dataclass(frozen=True)
class StagedEntry:
    """One tensor staged at ``offset`` of a pinned slot (and of the device buffer it is uploaded into).

    ``payload_bytes`` leading bytes cross PCIe: the stored payload, or the raw bytes when the host already decoded
    it. ``layout``/``codebook`` are set when the device still has to expand it.
    """

    name: str
    path: Path | None
    offset: int
    raw_length: int
    payload_bytes: int
    layout: PayloadLayout | None = None
    codebook: Codebook | None = None

    @property
    def encoding(self) -> str:
        """``splitzip`` while the device must expand it, ``raw`` once its bytes are the tensor's (a PayloadLike)."""
        return ENCODING_SPLITZIP if self.layout is not None else "raw"

    @property
    def length(self) -> int:
        return self.payload_bytes

    @property
    def reserved(self) -> int:
        """Bytes the entry occupies: the raw size, or the payload's if larger."""
        return max(self.raw_length, self.payload_bytes)


def stage_entry(source: SztFile, name: str, host: torch.Tensor, offset: int, *, decode_on_host: bool) -> StagedEntry:
    """Fill ``host[offset:]`` (a pinned uint8 range) with tensor ``name`` of ``source``.

    With ``decode_on_host`` a SplitZip tensor is decoded into its full raw bytes there; otherwise only its stored
    payload is copied, for the device to expand. Raw tensors are copied as they are.

    Raises:
        DecodeRouteError: the range cannot hold the entry.
        PayloadError: the payload does not decode (host decode only).
    """
    entry = source.entry(name)
    staged = describe_entry(source, name, offset, decode_on_host=decode_on_host)
    if offset + staged.reserved > host.numel():
        raise DecodeRouteError(
            f"staging slot of {host.numel()} bytes is too small: the tensor needs {staged.reserved} bytes at offset "
            f"{offset}; give the pool larger slots", path=source.path, tensor=name)
    payload = source.memory_payload(name)  # (inflated, for a file at rest: only once the tensor fits)
    target = host[offset: offset + staged.payload_bytes]
    if entry.encoding == ENCODING_SPLITZIP and decode_on_host:
        decode_entry(source.path, entry, payload, target.view(torch.bfloat16))
    else:
        target.copy_(payload)
    return staged


def describe_entry(source: SztFile, name: str, offset: int, *, decode_on_host: bool) -> StagedEntry:
    """The :class:`StagedEntry` that :func:`stage_entry` makes, without staging anything (for bytes that reach the
    device another way, e.g. DMA'd straight from registered pages)."""
    entry = source.entry(name)
    expand_on_device = entry.encoding == ENCODING_SPLITZIP and not decode_on_host
    return StagedEntry(name=name, path=source.path, offset=offset, raw_length=entry.raw_length,
                       payload_bytes=entry.memory_length if expand_on_device else entry.raw_length,
                       layout=entry.layout if expand_on_device else None,
                       codebook=entry.codebook if expand_on_device else None)


def copy_and_expand(host: torch.Tensor, dest: torch.Tensor, entries: Sequence[StagedEntry], stream: Any, *,
                    ops: DeviceOps, decoder: SlotDecoder | None = None) -> Any:
    """Copy each entry's leading ``payload_bytes`` from ``host`` to ``dest`` at the same offset, expand them in place,
    all on ``stream``, and return the event after which ``dest`` holds every tensor and ``host`` may be reused.

    Runs of entries whose bytes are all final (raw or host-decoded) cross in one copy, alignment padding included.
    ``decoder`` is needed only when some entry is still to be expanded.
    """
    runs: list[list[int]] = []  # [start, end, whether the bytes up to the next entry are all final]
    for entry in entries:
        end = entry.offset + entry.payload_bytes
        final = entry.layout is None
        if runs and runs[-1][2]:
            runs[-1][1:] = [end, final]
        else:
            runs.append([entry.offset, end, final])

    def copy() -> None:
        for start, end, _ in runs:
            dest[start:end].copy_(host[start:end], non_blocking=True)

    ops.enqueue(stream, copy, "copy")
    expand = [(e.offset, e) for e in entries if e.layout is not None]
    if not expand:
        return ops.record(stream)
    if decoder is None:
        raise DecodeRouteError("entries staged for the device to expand need a SlotDecoder", tensor=expand[0][1].name)
    return decoder.expand_packed(dest, expand, stream)


class StagingPoolDecoder:
    """A pinned staging pool for .szt tensors: entries advance by raw size, the device expands after upload.

    Use it as ``begin_upload()``, ``stage(...)`` for each tensor of a group, then ``upload(dest, stream)``, which
    enqueues the copies and the expansion on ``stream`` and marks the slot busy until they are done.

    Args:
        size_bytes (`int`): bytes per slot; a group's raw bytes (each entry rounded up to 256) must fit.
        slots (`int`, *optional*): slots in the ring, at least 2 (default), so one fills while another uploads.
        device (`str` or `torch.device`, *optional*): the CUDA device uploads go to.
        route (`str`, *optional*): ``"gpu"`` (expand on the device; needs Triton), ``"cpu"`` (decode on the host),
            or ``"auto"`` (the device when Triton is available, else the host).
        ops (`DeviceOps`, *optional*), codec (`DeviceCodec`, *optional*): replace the CUDA streams and the Triton
            kernels (tests run the same schedule on the CPU with them).

    Raises:
        DecodeRouteError: no CUDA device, or ``route="gpu"`` without Triton.
    """

    ALIGNMENT = 256
    """Entries start at multiples of this many bytes (``SlotDecoder.expand_packed`` needs 16)."""

    def __init__(self, size_bytes: int, slots: int = 2, *, device: str | torch.device = "cuda", route: str = "auto",
                 ops: DeviceOps | None = None, codec: DeviceCodec | None = None):
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
        ops = ops if ops is not None else cuda_ops(device)
        if route != "cpu" and codec is None:
            try:
                codec = triton_codec()
            except DecodeRouteError:
                if route == "gpu":
                    raise
                route = "cpu"
        self.route = "cpu" if route == "cpu" else "gpu"
        self.ops = ops
        self.decoder = SlotDecoder(ops=ops, codec=codec) if self.route == "gpu" else None
        self._ring = StagingRing(ops, slots, size_bytes, host=True, device=False)
        self._slot: Slot | None = None
        self._entries: list[StagedEntry] = []
        self._cursor = 0

    @property
    def size_bytes(self) -> int:
        return self._ring.slot_bytes

    @property
    def slots(self) -> int:
        return self._ring.slots

    def begin_upload(self) -> None:
        """Take the next slot, waiting (on the host) only until its previous upload is done."""
        if self._slot is not None:
            raise RuntimeError("begin_upload called twice without an upload in between")
        self._slot = self._ring.acquire(host_writes=True)
        self._entries = []
        self._cursor = 0

    def stage(self, source: SztFile, name: str) -> StagedEntry:
        """Stage tensor ``name`` of ``source`` at the next entry of the active slot (advancing by its raw size)."""
        if self._slot is None:
            raise RuntimeError("call begin_upload before staging")
        entry = stage_entry(source, name, self._slot.host, self._cursor, decode_on_host=self.route == "cpu")
        self._entries.append(entry)
        self._cursor = -(-(entry.offset + entry.reserved) // self.ALIGNMENT) * self.ALIGNMENT
        return entry

    @property
    def entries(self) -> list[StagedEntry]:
        """Entries staged in the active slot, in order."""
        return list(self._entries)

    @property
    def packed_bytes(self) -> int:
        """Bytes of the active slot in use: the size of the device buffer an upload needs."""
        return self._cursor

    def upload(self, dest: torch.Tensor, stream: Any = None) -> Any:
        """Copy the active slot's entries into ``dest`` (flat uint8 device tensor of at least ``packed_bytes``) on
        ``stream`` (the current stream by default), expand them there, and mark the upload done with the returned
        event: the slot is reused only after it, and consumers wait on it before reading ``dest``."""
        if self._slot is None:
            raise RuntimeError("call begin_upload before upload")
        if dest.numel() < self._cursor:
            raise DecodeRouteError(f"destination of {dest.numel()} bytes is smaller than the {self._cursor} bytes "
                                   "staged")
        ops = self.ops
        stream = ops.current_stream() if stream is None else stream
        slot, self._slot = self._slot, None
        try:
            event = copy_and_expand(slot.host, dest, self._entries, stream, ops=ops, decoder=self.decoder)
        except BaseException:
            self._ring.release(slot, ops.record(stream))
            raise
        self._ring.release(slot, event)
        return event
