"""Byte moves of a GPU load of the at-rest form: byte planes joined into elements, and verbatim pieces copied.

Joining is the last step of loading a raw tensor stored at rest (.szt 1.2) on the device.
The device inflater lays each frame of a tensor out as its byte planes back to back (plane ``j`` of a frame of
``L`` bytes at ``[j * L / k, (j + 1) * L / k)`` of the frame, for ``k``-byte elements); this kernel writes the
elements, byte ``j`` of element ``e`` from plane ``j``, and undoes the writer's one-bit left rotation when the
frame was stored ``sign_last``: byte ``j`` of the element is then byte ``j`` of the rotated element shifted right
one bit, with bit 0 of byte ``j + 1`` (mod ``k``) as its top bit. It works byte by byte, so one compilation per
element size serves every dtype (FP16, FP32, FP64, the integers), and its reads of a plane are consecutive.

A program owns ``BLOCK`` output bytes of one frame (grid: frames x blocks per frame), so no lane divides by the
run-time frame size; offsets within a frame fit in 32 bits (a frame is at most 64 MiB), the frame's base is 64-bit.
"""

from __future__ import annotations

import torch

from ._common import check_device, on_stream, tl, triton

__all__ = ["join_planes", "copy_ranges"]

BLOCK = 4096
"""Output bytes per program (a frame of at most 64 MiB takes at most 16384 programs along the grid's second axis)."""


@triton.jit
def _join_planes_kernel(planes_ptr, out_ptr, nbytes, frame_size, ITEMSIZE: tl.constexpr, SIGN_LAST: tl.constexpr,
                        BLOCK: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * frame_size
    frame_bytes = tl.minimum(nbytes - base, frame_size).to(tl.int32)
    within = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = within < frame_bytes
    plane_bytes = frame_bytes // ITEMSIZE
    element = within // ITEMSIZE
    byte = within % ITEMSIZE
    x = tl.load(planes_ptr + base + byte * plane_bytes + element, mask=mask, other=0)
    if SIGN_LAST:
        above = tl.load(planes_ptr + base + ((byte + 1) % ITEMSIZE) * plane_bytes + element, mask=mask, other=0)
        x = (x >> 1) | ((above & 1) << 7)
    tl.store(out_ptr + base + within, x, mask=mask)


COPY_PROGRAMS = 256
"""Programs per range at most along the grid's second axis of :func:`copy_ranges` (each strides over its range)."""


@triton.jit
def _copy_ranges_kernel(source_ptr, out_ptr, sources_ptr, targets_ptr, lengths_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    source = tl.load(sources_ptr + i)
    target = tl.load(targets_ptr + i)
    length = tl.load(lengths_ptr + i)
    start = tl.program_id(1).to(tl.int64) * BLOCK
    step = tl.num_programs(1).to(tl.int64) * BLOCK
    lanes = tl.arange(0, BLOCK)
    while start < length:
        at = start + lanes
        mask = at < length
        tl.store(out_ptr + target + at, tl.load(source_ptr + source + at, mask=mask), mask=mask)
        start += step


def copy_ranges(source: torch.Tensor, out: torch.Tensor, sources: torch.Tensor, targets: torch.Tensor,
                lengths: torch.Tensor, max_length: int, *, stream: "torch.cuda.Stream | None" = None) -> None:
    """Copy ``source[sources[i]: sources[i] + lengths[i]]`` into ``out[targets[i]: ...]`` for every ``i``, in one
    launch (int64 tables on the device; ``max_length`` their longest length): the verbatim pieces of a transfer
    stored at rest, a launch each otherwise (thousands per checkpoint of byte planes). The caller keeps the ranges
    inside both buffers (they come from a header checked against the layout)."""
    if source.dtype != torch.uint8 or out.dtype != torch.uint8 or source.dim() != 1 or out.dim() != 1:
        raise ValueError("ranges are copied from and into flat uint8 tensors")
    device = check_device(source, out, sources, targets, lengths)
    count = sources.numel()
    if not count or max_length <= 0:
        return
    grid = (count, min(COPY_PROGRAMS, -(-max_length // BLOCK)))
    with on_stream(stream, device):
        _copy_ranges_kernel[grid](source, out, sources, targets, lengths, BLOCK=BLOCK)


def join_planes(planes: torch.Tensor, out: torch.Tensor, itemsize: int, frame_size: int, sign_last: bool,
                *, stream: "torch.cuda.Stream | None" = None) -> None:
    """Join the frames of byte planes in ``planes`` (flat uint8) into the elements ``out`` (flat uint8, as long),
    enqueued on ``stream`` (the current stream by default).

    Raises:
        ValueError: lengths that are not whole elements, or frames that are not.
    """
    if planes.dtype != torch.uint8 or out.dtype != torch.uint8 or planes.dim() != 1 or out.dim() != 1:
        raise ValueError("byte planes are joined from and into flat uint8 tensors")
    if itemsize not in (1, 2, 4, 8) or planes.numel() != out.numel() or out.numel() % itemsize \
            or frame_size <= 0 or frame_size % itemsize:
        raise ValueError(f"byte planes of {itemsize}-byte elements in frames of {frame_size}: {planes.numel()} "
                         f"and {out.numel()} bytes")
    device = check_device(planes, out)
    nbytes = out.numel()
    if not nbytes:
        return
    frames = -(-nbytes // frame_size)
    grid = (frames, -(-min(frame_size, nbytes) // BLOCK))
    with on_stream(stream, device):
        if itemsize == 1:
            out.copy_(planes)
        else:
            _join_planes_kernel[grid](planes, out, nbytes, frame_size, ITEMSIZE=itemsize, SIGN_LAST=sign_last,
                                      BLOCK=BLOCK)
