"""Load .szt tensors onto a device: choose the route and the host transport, run the pipeline, hand back tensors.

:class:`DeviceLoader` serves ``safe_open(..., device="cuda")`` and ``load_file(..., device="cuda")``. It keeps the
expensive pieces between calls (pinned slots, streams, reader threads, page-cache registrations) and releases them
in :meth:`DeviceLoader.close`. :func:`load_to_device` loads a whole checkpoint: one file, a sharded index, or a folder.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..errors import DecodeRouteError, PayloadError
from ..format.header import TensorEntry
from ..format.index import load_checkpoint
from ..format.reader import SztFile, check_crc
from .device_codec import DeviceCodec, triton_codec
from .gpu_inflate import FrameInflater, nvcomp_inflater
from .hostio import FileReader, RegisteredMapping, default_threads
from .ops import DeviceOps, cuda_ops
from .device_route import DeviceChecks, DeviceDecodeRoute
from .host_route import HostDecodeRoute
from .ring import StagingRing
from .sources import HostSource, InflatingSource, MappedSource, ReadSource
from .stored_crc import StoredCrcCheck
from .transfer import TransferLoop

__all__ = ["StagingConfig", "DeviceLoader", "load_to_device", "announcing_reads"]

ROUTES = ("auto", "gpu", "cpu")
TRANSPORTS = ("staged", "registered")
SLOT_GRANULE = 4096


@dataclass(frozen=True)
class StagingConfig:
    """How a device load moves bytes.

    The defaults are the fastest slot setting measured with the default reader threads on an H200 host, with and
    without verification (``bench/RESULTS.md``).

    Args:
        slot_bytes (`int`): size of each pinned staging slot (128 MiB: few transfers, so little host work per
            byte, and a 7B model's largest matrices fit one slot whole, so they are decoded out of it by a batched
            launch instead of being expanded in place; 64 MiB measured 15-30% slower, see ``bench/RESULTS.md``).
            A small checkpoint gets smaller slots, as large as it needs.
        slots (`int`): slots in the ring, at least 2, so staging one overlaps copying and decoding another; 4
            (default) lets the reads run three slots ahead.
        threads (`int`, *optional*): host reader threads; ``min(12, cores)`` by default.
        transport (`str`): ``"staged"`` (default) reads through the pinned slots; ``"registered"`` registers the
            file's read-only page-cache mapping with the driver, span by span, and copies straight out of it.
            Pinning and unpinning pages cost more than the reads they save for a one-time load (measured on the
            H200 host: about 18 GB/s to pin, 35 GB/s to unpin, against 40 GB/s to read), so registration pays only
            for a file that stays open and is read again (``safe_open`` keeps its registration until closed).
            A file in the at-rest form (format 1.1 and 1.2) is always staged.
        device_inflate (`bool`): inflate the at-rest form's zstd frames on the device with nvCOMP (when it is
            installed; the GPU route, staged reads) instead of on the reader threads: the stored bytes cross as they
            are, 1.0-1.25x the in-memory form's load time on the H200 against 1.6-1.9x (``bench/RESULTS.md``).
            **For files you trust only** (default off): nvCOMP does not validate what it inflates (its documentation:
            corrupt data is undefined behaviour), and a crafted file whose CRC-32s match its corrupt frames makes it
            fail the CUDA context, which ends the process (the spec's refusal vectors ``at_rest_frame_lengths``,
            ``at_rest_frame_corrupt`` and ``at_rest_bomb`` do). The reader threads' zstd refuses such frames with a
            PayloadError naming the file and the tensor. The stored bytes are CRC-checked before nvCOMP sees them,
            ``verify`` or not, which stops accidental corruption, not a forged checksum.
    """

    slot_bytes: int = 128 << 20
    slots: int = 4
    threads: int | None = None
    transport: str = "staged"
    device_inflate: bool = False

    def __post_init__(self) -> None:
        if self.slot_bytes < SLOT_GRANULE:
            raise ValueError(f"slot_bytes must be at least {SLOT_GRANULE}, got {self.slot_bytes}")
        if self.slots < 2:
            raise ValueError(f"slots must be at least 2, got {self.slots}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be positive, got {self.threads}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")


class DeviceLoader:
    """Loads tensors of open .szt files onto one device.

    Args:
        device (`str` or `torch.device`): a CUDA device.
        route (`str`, *optional*): ``"gpu"`` moves the stored (compressed) bytes and decodes on the device (needs
            Triton); ``"cpu"`` decodes on the host and moves raw bytes; ``"auto"`` (default) is ``"gpu"``.
        staging (`StagingConfig`, *optional*): slot size and count, reader threads, host transport.
        verify (`bool`, *optional*): check the CRC-32 of each tensor's stored bytes while the transfer runs (with
            staged reads, each reader thread checks the piece it has just read); a mismatch raises after the
            transfer and no tensor is returned. The GPU route does not check the decoded bytes' CRC-32 (they stay
            on the device); its kernels check the escape streams of SplitZip payloads as they decode them,
            ``verify`` or not, and a tensor whose streams break a rule raises after the transfer. Stored bytes
            that the device inflates (the at-rest form, with an inflater) are CRC-checked ``verify`` or not.
        ops (`DeviceOps`, *optional*), codec (`DeviceCodec`, *optional*): replace CUDA and the Triton kernels (tests).
        inflater (`FrameInflater`, *optional*): inflates the at-rest form's zstd frames on the device; by default
            nvCOMP's where ``staging.device_inflate`` asks for it and it is installed (and CUDA is not replaced).

    Raises:
        DecodeRouteError: no such CUDA device, or the GPU route without Triton.
    """

    def __init__(self, device: str | torch.device, *, route: str = "auto", staging: StagingConfig | None = None,
                 verify: bool = True, ops: DeviceOps | None = None, codec: DeviceCodec | None = None,
                 inflater: FrameInflater | None = None):
        if route not in ROUTES:
            raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
        self.ops = ops if ops is not None else cuda_ops(device)
        self.route = "cpu" if route == "cpu" else "gpu"
        self.codec = (codec if codec is not None else triton_codec()) if self.route == "gpu" else None
        self.staging = staging if staging is not None else StagingConfig()
        self.verify = verify
        if inflater is None and ops is None and self.staging.device_inflate and self._may_inflate_on_device():
            inflater = nvcomp_inflater()  # else nvCOMP is never called
        self.inflater = inflater
        self.threads = self.staging.threads or default_threads()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="szformat-io")
        self._verify_pool: ThreadPoolExecutor | None = None
        self._sources: dict[Path, HostSource] = {}
        self._loop: TransferLoop | None = None
        self._route: DeviceDecodeRoute | HostDecodeRoute | None = None
        self._reading: threading.Event | None = getattr(_announced, "event", None)

    def __enter__(self) -> "DeviceLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def load(self, file: SztFile, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """Tensors ``names`` (all by default) of ``file``, on the device, ready to use on any stream."""
        entries = [file.entry(name) for name in (file.entries if names is None else names)]
        dtypes = [entry.torch_dtype(file.path) for entry in entries]
        pending: list[Future] = []
        inline: StoredCrcCheck | None = None
        checks: DeviceChecks | None = None
        route: DeviceDecodeRoute | HostDecodeRoute | None = None
        try:
            if self.route == "gpu":
                source = self._source(file)
                readers_inflate = isinstance(source, InflatingSource)
                # the route moves the in-memory form the readers make, or the stored bytes as they are
                moved = source.memory_entries(entries) if readers_inflate else entries
                # the reader threads check what they have just read; always what the device inflates
                if (self.verify or (file.at_rest and not readers_inflate)) and source.host_writes:
                    inline = StoredCrcCheck(entries, file.path)
                elif self.verify:
                    pending = self._start_verify(file, entries)
                route = self._route_for(moved, host=source.host_writes)
                flat, checks = route.load(moved, source, verify=inline)
            else:
                pending = self._start_verify(file, entries) if self.verify else []
                route = self._route_for(entries, host=True)
                flat = route.load(file, entries)
            route.loop.finish()
        except BaseException:
            for check in pending:
                check.cancel()
            raise
        finally:  # the device work has finished (a failed run waits for it): what at-rest payloads used may go
            if isinstance(route, DeviceDecodeRoute):
                route.release_scratch()
        if checks is not None:
            escapes, frames = checks.failed()
            if escapes:
                self._refuse_escapes(file, entries[min(escapes)])
            if frames:
                raise PayloadError("a zstd frame of the stored bytes did not inflate to its size on the device",
                                   path=file.path, tensor=entries[min(frames)].name)
        for check in pending:
            check.result()
        if inline is not None:
            inline.check()
        return {e.name: raw.view(dtype).reshape(e.shape) for raw, e, dtype in zip(flat, entries, dtypes)}

    def release(self, file: SztFile) -> None:
        """Drop what this loader holds for ``file`` (its registration or reader); a later load opens it again."""
        source = self._sources.pop(file.path, None)
        if source is not None:
            source.close()

    def load_shard(self, file: SztFile, names: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
        """``load`` then ``release``: one shard of a checkpoint read once (see :func:`load_checkpoint`)."""
        try:
            return self.load(file, names)
        finally:
            self.release(file)

    def close(self) -> None:
        """Release registrations, file handles, threads and staging memory."""
        if self._loop is not None:
            self._loop.finish()
        for source in self._sources.values():
            source.close()
        self._sources.clear()
        self._pool.shutdown()
        if self._verify_pool is not None:
            self._verify_pool.shutdown()
        self._loop = self._route = None

    # -- pieces ---------------------------------------------------------------------------------------------------

    def _route_for(self, entries: Sequence[TensorEntry], *, host: bool) -> DeviceDecodeRoute | HostDecodeRoute:
        """The route, with a ring whose slots are as large as this load can use (up to the configured size) and
        pinned host buffers when ``host`` (a registered file needs none)."""
        if self.route == "gpu":
            need = max((e.offset + e.length for e in entries), default=0) - min((e.offset for e in entries), default=0)
        else:
            need = sum(-(-e.raw_length // 64) * 64 for e in entries)
        slot_bytes = min(self.staging.slot_bytes, max(SLOT_GRANULE, -(-need // SLOT_GRANULE) * SLOT_GRANULE))
        slot_bytes -= slot_bytes % 64
        ring = self._loop.ring if self._loop is not None else None
        if ring is None or ring.slot_bytes < slot_bytes or (host and not ring.has_host):
            self._route = self._loop = None  # the previous load finished: its buffers may go
            ring = StagingRing(self.ops, self.staging.slots, slot_bytes, host=host, device=self.route == "gpu")
            self._loop = TransferLoop(self.ops, ring, reading=self._reading)
            self._route = (DeviceDecodeRoute(self._loop, self.codec, self.inflater) if self.route == "gpu"
                           else HostDecodeRoute(self._loop, self._pool))
        return self._route

    def _source(self, file: SztFile) -> HostSource:
        source = self._sources.get(file.path)
        if source is None:
            source = self._sources[file.path] = self._open_source(file)
        return source

    def _may_inflate_on_device(self) -> bool:
        """Whether a load may inflate the at-rest form on the device, given an inflater: the GPU route and staged
        reads (the CRC-32s that keep unchecked bytes from the inflater are taken as the readers read)."""
        return self.route == "gpu" and self.staging.transport == "staged"

    def _open_source(self, file: SztFile) -> HostSource:
        device_inflates = self.inflater is not None and self._may_inflate_on_device()
        if file.at_rest and not device_inflates:
            return InflatingSource(file, self._pool)  # the readers inflate: the device decodes the in-memory form
        if self.staging.transport == "registered":
            mapping = RegisteredMapping.open(file.path, self.ops.device)
            if mapping is None:
                raise DecodeRouteError("the CUDA driver refused to register the file's read-only mapping; use "
                                       "transport='staged'", path=file.path)
            return MappedSource(mapping, self._pool)
        return ReadSource(FileReader(file.path, self._pool, self.threads))

    def _start_verify(self, file: SztFile, entries: Sequence[TensorEntry]) -> list[Future]:
        if self._verify_pool is None:
            self._verify_pool = ThreadPoolExecutor(os.cpu_count() or 1, thread_name_prefix="szformat-verify")
        return [self._verify_pool.submit(check_crc, file.payload(e.name), e.crc32, what="stored bytes",
                                         path=file.path, tensor=e.name) for e in entries]

    @staticmethod
    def _refuse_escapes(file: SztFile, entry: TensorEntry) -> None:
        """Raise PayloadError for a tensor whose escape streams the device found breaking a rule: the host check
        of the file's bytes says which rule; if those bytes pass it, they are not the bytes the device decoded."""
        file.check_escapes(entry.name)
        raise PayloadError("escape streams changed while the file was read: the bytes decoded break a rule of the "
                           "spec", path=file.path, tensor=entry.name)


_announced = threading.local()


@contextlib.contextmanager
def announcing_reads(event: threading.Event) -> Iterator[None]:
    """Set ``event`` once the reads of the first device load this thread starts inside the block are under way,
    or when the block ends. A thread that builds a model beside a load (:class:`..model_folder.Prefetch`) waits for
    it, so the load's setup, Python work before its first read, does not compete with the build for the GIL: on the
    H200 host that setup took its first read from 15 to 33 ms after the call, and waiting for it made a 2.28 GB
    LM's ``from_pretrained`` 7 % faster (``bench/RESULTS.md``, run 40)."""
    _announced.event = event
    try:
        yield
    finally:
        _announced.event = None
        event.set()


def load_to_device(path: str | os.PathLike, device: str | torch.device, *, route: str = "auto",
                   staging: StagingConfig | None = None, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (file, sharded index or folder) on ``device``; see :class:`DeviceLoader`."""
    with DeviceLoader(device, route=route, staging=staging, verify=verify) as loader:
        return load_checkpoint(loader.load_shard, path)
