"""The at-rest stage undone on the device: zstd frames inflated by nVIDIA nvCOMP, so the host only reads.

A GPU load of a file stored at rest (.szt 1.1) is bound by its reader threads when they inflate ``pk`` on the host
(about 1.5 GB/s of output per core, on top of the reads that already bound the in-memory form). With nvCOMP the
stored bytes cross to the device as they are (fewer of them) and its batched zstd decoder inflates every frame of
a transfer in one call: 14 GB/s for the ~128 frames of a 128 MiB slot on the H200, 71 GB/s for 1024 frames
(``bench/RESULTS.md``; the probe, ``tools/probe_gpu_zstd.py``, is in commit 98d3c4b).

Byte planes (.szt 1.2) take the same path: each compressed plane is a frame of its own, inflated to its place in its
frame, the verbatim planes are copied beside them (one launch per transfer), and the codec joins the planes into
elements (``codec.gpu.join_planes``).

nvCOMP validates little of what it inflates ("corrupt data leads to undefined behavior"), so a load inflates on
the device only bytes whose CRC-32 has already been checked, ``verify`` or not (:class:`FrameInflater` is called
by the route after that check). The frames' sizes come from the header, already checked against the
layout; each frame's status and inflated size are checked once the load has finished.

nvCOMP is optional: ``pip install "szformat[nvcomp-cu12]"`` (or ``nvcomp-cu13``, matching PyTorch's CUDA). Without it,
or with a release older than 6 (whose zstd calls have other names and arguments), :func:`nvcomp_inflater` returns
``None`` and the readers inflate on the host.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import sys
from dataclasses import dataclass
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from ..errors import DecodeRouteError
from ..format.at_rest import PlanesStage, Segment

logger = logging.getLogger(__name__)

__all__ = ["FramePlan", "FrameInflater", "NvcompInflater", "DecompressOptions", "nvcomp_library",
           "nvcomp_inflater", "plan_frames", "frames_of", "plane_frames_of"]


@dataclass(frozen=True)
class FramePlan:
    """The frames one call inflates: frame ``i`` is stored bytes ``[stored[i], stored[i] + stored_lengths[i])`` of
    the source buffer and becomes ``[memory[i], memory[i] + memory_lengths[i])`` of the output buffer.

    The four arrays are int64 on the device (sent ahead, in one copy each, while the plan is built).
    """

    count: int
    stored: torch.Tensor
    stored_lengths: torch.Tensor
    memory: torch.Tensor
    memory_lengths: torch.Tensor
    max_memory_length: int
    memory_bytes: int


def plan_frames(calls: Sequence[np.ndarray], device: torch.device) -> list[FramePlan]:
    """A :class:`FramePlan` for each call's frames, an int64 array of ``(stored, stored_length, memory,
    memory_length)`` rows. All of their arrays are views of one table sent to ``device`` in one copy through pinned
    memory (only enqueued on the current stream): a pinned allocation and a copy per transfer, before a load's first
    read, would cost the loading thread milliseconds each (as the batch tables did)."""
    rows = np.concatenate([np.asarray(call, dtype=np.int64).reshape(-1, 4) for call in calls]) if calls else \
        np.empty((0, 4), dtype=np.int64)
    table = torch.from_numpy(np.ascontiguousarray(rows.T))
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    plans, first = [], 0
    for call in calls:
        count = len(call)
        part = table[:, first: first + count]
        lengths = rows[first: first + count, 3]
        plans.append(FramePlan(count, part[0], part[1], part[2], part[3], int(lengths.max(initial=0)),
                               int(lengths.sum())))
        first += count
    return plans


def frames_of(segments: Sequence[Segment], stored_base: int, memory_base: int) -> tuple[np.ndarray, np.ndarray]:
    """The zstd frames of one payload stored at rest (1.1) as ``(stored, stored_length, memory, memory_length)``
    rows, and its verbatim pieces as ``(stored, memory, length)`` copies (adjacent ones merged: the streams after
    ``pk`` usually make one), offset by the two bases."""
    frames, copies = [], []
    for s in segments:
        if s.compressed:
            frames.append((stored_base + s.stored, s.stored_length, memory_base + s.memory, s.memory_length))
        elif copies and copies[-1][0] + copies[-1][2] == stored_base + s.stored \
                and copies[-1][1] + copies[-1][2] == memory_base + s.memory:
            copies[-1][2] += s.memory_length
        else:
            copies.append([stored_base + s.stored, memory_base + s.memory, s.memory_length])
    return np.array(frames, dtype=np.int64).reshape(-1, 4), np.array(copies, dtype=np.int64).reshape(-1, 3)


def plane_frames_of(stage: PlanesStage, size: int, stored_base: int, memory_base: int
                    ) -> tuple[np.ndarray, np.ndarray]:
    """:func:`frames_of` for a raw tensor of ``size`` bytes stored as byte planes (1.2): each frame's planes laid
    out back to back at the frame's place, each compressed plane (stored shorter than the plane) a zstd frame, the
    verbatim ones copies. Computed on whole arrays: a GB of FP32 has thousands of planes, and a loop over them cost
    a load about 6 ms before its first read. Every plane follows the one before it in the stored bytes and in
    memory alike (a frame's length is a multiple of the element size), so a run of verbatim planes is one copy."""
    k = stage.itemsize
    stored_lengths = np.asarray(stage.planes, dtype=np.int64)
    starts = np.arange(len(stored_lengths) // k, dtype=np.int64) * stage.frame_size
    plane = np.repeat(np.minimum(stage.frame_size, size - starts) // k, k)
    memory = np.repeat(starts, k) + np.tile(np.arange(k, dtype=np.int64), len(starts)) * plane
    stored = np.cumsum(stored_lengths) - stored_lengths
    compressed = stored_lengths < plane
    frames = np.stack([stored[compressed] + stored_base, stored_lengths[compressed], memory[compressed] + memory_base,
                       plane[compressed]], axis=1)
    verbatim = np.flatnonzero(~compressed)
    first = last = verbatim
    if len(verbatim):
        breaks = np.flatnonzero(np.diff(verbatim) != 1)
        first, last = verbatim[np.r_[0, breaks + 1]], verbatim[np.r_[breaks, len(verbatim) - 1]]
    copies = np.stack([stored[first] + stored_base, memory[first] + memory_base,
                       memory[last] + plane[last] - memory[first]], axis=1)
    return frames, copies


class FrameInflater(Protocol):
    """Inflates zstd frames on the device, enqueued on the current stream."""

    def inflate(self, source: torch.Tensor, plan: FramePlan, out: torch.Tensor, statuses: torch.Tensor) -> None:
        """Inflate every frame of ``plan`` from ``source`` (flat uint8) into ``out`` (flat uint8); ``statuses``
        (int32, ``plan.count``) gets a nonzero value for each frame that failed or did not fill its output."""

    def release(self) -> None:
        """Drop the scratch kept between calls; the device work of every call has finished."""


class DecompressOptions(ctypes.Structure):
    """``nvcompBatchedZstdDecompressOpts_t``: the backend (0: nvCOMP's choice), then 60 reserved zero bytes."""

    _fields_ = [("backend", ctypes.c_int), ("reserved", ctypes.c_char * 60)]


class NvcompInflater:
    """:class:`FrameInflater` over nvCOMP's batched zstd decoder (its C API, through ctypes)."""

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib
        self._options = DecompressOptions(0)
        self._temp: dict[Any, torch.Tensor] = {}  # per stream: reused in stream order

    def inflate(self, source: torch.Tensor, plan: FramePlan, out: torch.Tensor, statuses: torch.Tensor) -> None:
        if plan.count == 0:
            return
        stream = torch.cuda.current_stream(out.device)
        temp = self._temp_for(stream, plan, out.device)
        inputs = plan.stored + source.data_ptr()
        outputs = plan.memory + out.data_ptr()
        inflated = torch.empty(plan.count, dtype=torch.int64, device=out.device)
        status = self._lib.nvcompBatchedZstdDecompressAsync(
            inputs.data_ptr(), plan.stored_lengths.data_ptr(), plan.memory_lengths.data_ptr(), inflated.data_ptr(),
            plan.count, temp.data_ptr(), temp.numel(), outputs.data_ptr(), self._options, statuses.data_ptr(),
            stream.cuda_stream)
        if status:
            raise DecodeRouteError(f"nvCOMP refused to inflate {plan.count} zstd frames (status {status})")
        statuses.add_((inflated != plan.memory_lengths).to(torch.int32))

    def release(self) -> None:
        self._temp.clear()

    def _temp_for(self, stream: Any, plan: FramePlan, device: torch.device) -> torch.Tensor:
        size = ctypes.c_size_t()
        status = self._lib.nvcompBatchedZstdDecompressGetTempSize(
            plan.count, plan.max_memory_length, self._options, ctypes.byref(size), plan.memory_bytes, None)
        if status:
            raise DecodeRouteError(f"nvCOMP cannot size its scratch for {plan.count} zstd frames (status {status})")
        temp = self._temp.get(stream)
        if temp is None or temp.numel() < size.value:  # allocated on ``stream``: reused only after its work
            temp = self._temp[stream] = torch.empty(max(size.value, 1), dtype=torch.uint8, device=device)
        return temp


_NVCOMP: Any = False


def nvcomp_library() -> ctypes.CDLL | None:
    """nvCOMP's library (``nvidia-libnvcomp-cu12`` / ``-cu13``, release 6 or later), its batched zstd calls typed,
    or ``None`` when no such library is installed or loads (an older release is passed over with a warning)."""
    global _NVCOMP
    if _NVCOMP is False:
        _NVCOMP = None
        for path in _library_paths():
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            if not all(hasattr(lib, call) for call in _CALLS):
                logger.warning("%s lacks nvCOMP 6's batched zstd calls (an older release?): at-rest frames are "
                               "inflated on the host; nvCOMP >= 6 inflates them on the device", path)
                continue
            size, pointer = ctypes.c_size_t, ctypes.c_void_p
            lib.nvcompBatchedZstdDecompressGetTempSize.argtypes = [size, size, DecompressOptions,
                                                                   ctypes.POINTER(size), size, pointer]
            lib.nvcompBatchedZstdDecompressAsync.argtypes = [pointer, pointer, pointer, pointer, size, pointer, size,
                                                             pointer, DecompressOptions, pointer, pointer]
            lib.nvcompBatchedZstdDecompressGetTempSize.restype = ctypes.c_int
            lib.nvcompBatchedZstdDecompressAsync.restype = ctypes.c_int
            _NVCOMP = lib
            break
    return _NVCOMP


_CALLS = ("nvcompBatchedZstdDecompressGetTempSize", "nvcompBatchedZstdDecompressAsync")
"""The calls this module makes, as nvCOMP 6 names and types them (release 5 names the first ``...GetTempSizeAsync``
and takes other arguments)."""


def nvcomp_inflater() -> NvcompInflater | None:
    """An inflater over nvCOMP, or ``None`` without it (see :func:`nvcomp_library`)."""
    lib = nvcomp_library()
    return None if lib is None else NvcompInflater(lib)


def _library_paths() -> list[str]:
    """Where nvCOMP's library may be: the ``nvidia-libnvcomp`` wheel's folder on the import path (found without
    importing it: ``nvidia`` may be another package's), then the loader's search path."""
    paths: list[str] = []
    for folder in sys.path:
        paths += sorted(glob.glob(os.path.join(folder or ".", "nvidia", "libnvcomp", "lib*", "libnvcomp.so.*")))
    return paths + ["libnvcomp.so.6", "libnvcomp.so.5", "libnvcomp.so"]
