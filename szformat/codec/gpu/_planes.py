"""Byte planes joined on the GPU: the last step of loading a raw tensor stored at rest (.szt 1.2) on the device.

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

__all__ = ["join_planes"]

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
