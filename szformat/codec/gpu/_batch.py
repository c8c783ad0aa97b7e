"""Batched SplitZip decode: any number of tensors in two kernel launches, driven by a device-side table.

A checkpoint holds hundreds of tensors, many of them small; one or two launches each would cost more than the
decode. Instead, all payloads sit in one uint8 buffer and all outputs in one BF16 buffer, and a
:class:`BatchTable` (built once on the host with :func:`build_batch_table`, then copied to the device) says where each
tensor's payload and output are. The dense launch has one program per tile of any tensor; a tile-owner array maps the
program to its tensor. The escape launch has one program per block of escapes, mapped the same way. Both run the
per-tile functions of :mod:`._decode`, so single and batched decoding cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np
import torch

from ..codebook import Codebook
from ..layout import PayloadLayout
from ._common import check_aligned, check_device, codebook_words, on_stream, tl, triton
from ._decode import ESCAPE_BLOCK, ROWS, _decode_tile, _fix_escapes, check_errors

__all__ = ["BatchTable", "build_batch_table", "decode_batch", "decode_batch_at"]

PAYLOAD_ALIGNMENT = 16
"""Payload offsets into the batch buffer are multiples of this (bytes): the kernels load whole 16-byte vectors."""
OUTPUT_ALIGNMENT = 8
"""Output offsets are multiples of this many elements (16 bytes), for the same reason."""
BATCH_WARPS = 8
"""Warps per dense program of the batch launch: the batch kernel holds more registers than the single-tensor one,
and with 4 warps it ran 13% slower on the H200 (``bench/gpu.py``)."""

# Columns of the descriptor table (int64, one row per tensor).
_PAY, _N, _NESC, _OUT, _SM, _CID, _LUT01, _LUT23, _CHUNK, _TILE0, _ESC0 = (tl.constexpr(i) for i in range(11))
_WIDTH = tl.constexpr(12)


@dataclass(frozen=True)
class BatchTable:
    """Where each tensor of a batch lives, on the device, plus the host-side sizes launches and checks need.

    ``descriptors`` is int64 ``[count, 12]``: payload offset (bytes), n, n_esc, output offset (elements), sm and
    chunk-id stream offsets, the codebook as two int64 (16 exponent bytes, little-endian), chunk size, first tile,
    first escape block. ``tile_owner`` and ``escape_owner`` (int32) map each program of the two launches to a row.
    """

    descriptors: torch.Tensor
    tile_owner: torch.Tensor
    escape_owner: torch.Tensor
    payload_bytes: int
    """The batch payload buffer must hold at least this many bytes."""
    output_elements: int
    """The batch output buffer must hold at least this many elements."""

    @property
    def count(self) -> int:
        return self.descriptors.shape[0]

    @property
    def launches(self) -> int:
        """Kernel launches one :func:`decode_batch` call makes: at most two, whatever the tensor count."""
        return int(self.tile_owner.numel() > 0) + int(self.escape_owner.numel() > 0)


def _packed_codebook(codebook: Codebook) -> tuple[int, int]:
    """The four int32 codebook words as two int64 (low word first), the way the kernel unpacks them."""
    w0, w1, w2, w3 = ((w + (1 << 32)) % (1 << 32) for w in codebook_words(codebook))
    signed = lambda v: v - (1 << 64) if v >= 1 << 63 else v  # noqa: E731
    return signed(w0 | (w1 << 32)), signed(w2 | (w3 << 32))


def build_batch_table(
    entries: Iterable[tuple[PayloadLayout, Codebook, int, int]],
    *,
    device: torch.device | str,
) -> BatchTable:
    """Describe a batch: one ``(layout, codebook, payload_offset, output_offset)`` per tensor.

    Args:
        entries: ``payload_offset`` is in bytes into the batch payload buffer (a multiple of 16);
            ``output_offset`` in elements into the batch output buffer (a multiple of 8). Outputs must not overlap.
        device (`torch.device` or `str`): where the table goes (the device of the buffers it will decode). The
            copy is enqueued on the current stream; the host does not wait for it.

    Returns:
        `BatchTable`: reusable for every decode of the same batch layout.

    Raises:
        ValueError: an offset is misaligned or negative, or two outputs overlap.
    """
    rows: list[list[int]] = []
    tiles: list[int] = []
    escape_blocks: list[int] = []
    first_tile = first_escape_block = 0
    payload_end = output_end = 0
    for index, (layout, codebook, pay_off, out_off) in enumerate(entries):
        if pay_off < 0 or pay_off % PAYLOAD_ALIGNMENT:
            raise ValueError(f"entry {index}: payload offset {pay_off} is not a non-negative multiple of "
                             f"{PAYLOAD_ALIGNMENT}")
        if out_off < 0 or out_off % OUTPUT_ALIGNMENT:
            raise ValueError(f"entry {index}: output offset {out_off} is not a non-negative multiple of "
                             f"{OUTPUT_ALIGNMENT} elements")
        tiles.append(triton.cdiv(layout.n_pairs, ROWS * 4))
        escape_blocks.append(triton.cdiv(layout.n_esc, ESCAPE_BLOCK))
        lut01, lut23 = _packed_codebook(codebook)
        rows.append([pay_off, layout.n, layout.n_esc, out_off, layout.off_sm, layout.off_cid, lut01, lut23,
                     layout.chunk_size, first_tile, first_escape_block, 0])
        first_tile += tiles[-1]
        first_escape_block += escape_blocks[-1]
        payload_end = max(payload_end, pay_off + layout.comp_bytes)
        output_end = max(output_end, out_off + layout.n)
    spans = sorted((row[_OUT.value], row[_OUT.value] + row[_N.value]) for row in rows if row[_N.value])
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start < end:
            raise ValueError(f"outputs overlap: one ends at element {end}, the next starts at {start}")
    device = torch.device(device)
    return BatchTable(
        descriptors=_to_device(torch.tensor(rows, dtype=torch.int64).reshape(-1, _WIDTH.value), device),
        tile_owner=_to_device(_owners(tiles), device),
        escape_owner=_to_device(_owners(escape_blocks), device),
        payload_bytes=payload_end,
        output_elements=output_end,
    )


def _owners(programs: list[int]) -> torch.Tensor:
    """Row ``i`` repeated ``programs[i]`` times (int32): a large tensor owns thousands of programs, which NumPy
    lists in microseconds where a Python list takes milliseconds."""
    return torch.from_numpy(np.repeat(np.arange(len(programs), dtype=np.int32), programs))


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy through pinned memory so the copy is only enqueued on the current stream: the host does not wait."""
    if device.type != "cuda":
        return table.to(device)
    return table.pin_memory().to(device, non_blocking=True)


@triton.jit
def _row(desc_ptr, owner_ptr):
    """The descriptor row of the tensor that owns this program."""
    return desc_ptr + tl.load(owner_ptr + tl.program_id(0)).to(tl.int64) * _WIDTH


@triton.jit
def _decode_batch_kernel(pay_ptr, out_ptr, desc_ptr, owner_ptr, ROWS: tl.constexpr):
    row = _row(desc_ptr, owner_ptr)
    lut01 = tl.load(row + _LUT01)
    lut23 = tl.load(row + _LUT23)
    _decode_tile(
        pay_ptr + tl.multiple_of(tl.load(row + _PAY), 16),
        tl.multiple_of(tl.load(row + _SM), 4),
        out_ptr + tl.multiple_of(tl.load(row + _OUT), 8),
        tl.load(row + _N),
        tl.program_id(0) - tl.load(row + _TILE0),
        lut01.to(tl.int32), (lut01 >> 32).to(tl.int32), lut23.to(tl.int32), (lut23 >> 32).to(tl.int32),
        ROWS,
    )


@triton.jit
def _escape_batch_kernel(pay_ptr, out_ptr, desc_ptr, owner_ptr, err_ptr, BLOCK: tl.constexpr, CHECK: tl.constexpr):
    owner = tl.load(owner_ptr + tl.program_id(0)).to(tl.int64)
    row = desc_ptr + owner * _WIDTH
    first = (tl.program_id(0) - tl.load(row + _ESC0)) * BLOCK
    _fix_escapes(pay_ptr + tl.load(row + _PAY), tl.load(row + _SM), tl.load(row + _CID), out_ptr + tl.load(row + _OUT),
                 tl.load(row + _N), tl.load(row + _NESC), tl.load(row + _CHUNK), first, err_ptr + owner, BLOCK, CHECK)


def decode_batch(
    payloads: torch.Tensor,
    table: BatchTable,
    *,
    out: torch.Tensor | None = None,
    errors: torch.Tensor | None = None,
    stream: "torch.cuda.Stream | None" = None,
) -> torch.Tensor:
    """Decode every tensor a :class:`BatchTable` describes, in at most two launches.

    Args:
        payloads (`torch.Tensor`): flat uint8 CUDA tensor, 16-byte aligned, of at least ``table.payload_bytes``.
        table (`BatchTable`): from :func:`build_batch_table`, on the same device.
        out (`torch.Tensor`, *optional*): flat contiguous bfloat16 tensor, 16-byte aligned, of at least
            ``table.output_elements`` elements; elements no entry covers are left as they are.
        errors (`torch.Tensor`, *optional*): int32 tensor of ``table.count`` elements on the device; the escape
            pass sets element ``i`` to 1 if the escape streams of entry ``i`` break a rule
            :func:`..cpu.escape_positions` checks (then that tensor is not to be used). Without it nothing is
            checked.
        stream (`torch.cuda.Stream`, *optional*): where to enqueue; the current stream by default.

    Returns:
        `torch.Tensor`: ``out``, or a new flat bfloat16 tensor of ``table.output_elements`` elements.
    """
    device = check_device(payloads, table.descriptors)
    if payloads.dtype != torch.uint8 or payloads.dim() != 1 or not payloads.is_contiguous():
        raise ValueError("payloads must be a flat contiguous uint8 tensor")
    if payloads.numel() < table.payload_bytes:
        raise ValueError(f"payloads hold {payloads.numel()} bytes, the table reads up to {table.payload_bytes}")
    if out is None:
        with on_stream(stream, device):
            out = torch.empty(table.output_elements, dtype=torch.bfloat16, device=device)
    elif (out.dtype != torch.bfloat16 or out.dim() != 1 or not out.is_contiguous() or out.device != device
          or out.numel() < table.output_elements):
        raise ValueError(f"out must be a flat contiguous bfloat16 tensor of at least {table.output_elements} "
                         f"elements on {device}")
    check_aligned(payloads, 16, "payloads")
    check_aligned(out, 16, "out")
    check_errors(errors, table.count, device)
    _launch(payloads, table, out.view(torch.int16), stream, device, errors)
    return out


def decode_batch_at(
    payloads: torch.Tensor,
    table: BatchTable,
    base: torch.Tensor,
    *,
    stream: "torch.cuda.Stream | None" = None,
) -> None:
    """Decode every tensor of ``table`` to element offsets counted from ``base``, wherever they fall.

    For outputs that are separate tensors of one address range (the weights of an offloading arena, each its own
    tensor object) rather than one buffer: ``base`` is the bfloat16 tensor at the lowest output address and each
    output offset is ``(address - base.data_ptr()) // 2``. The outputs may lie outside ``base`` itself, so this
    call cannot bound them; the caller guarantees every output range is device memory it owns.

    Args:
        payloads (`torch.Tensor`): flat uint8 CUDA tensor, 16-byte aligned, of at least ``table.payload_bytes``.
        table (`BatchTable`): from :func:`build_batch_table`, on the same device.
        base (`torch.Tensor`): bfloat16 tensor on the same device, 16-byte aligned.
        stream (`torch.cuda.Stream`, *optional*): where to enqueue; the current stream by default.
    """
    device = check_device(payloads, table.descriptors, base)
    if payloads.dtype != torch.uint8 or payloads.dim() != 1 or not payloads.is_contiguous():
        raise ValueError("payloads must be a flat contiguous uint8 tensor")
    if payloads.numel() < table.payload_bytes:
        raise ValueError(f"payloads hold {payloads.numel()} bytes, the table reads up to {table.payload_bytes}")
    if base.dtype != torch.bfloat16:
        raise ValueError(f"base must be a bfloat16 tensor, got {base.dtype}")
    check_aligned(payloads, 16, "payloads")
    check_aligned(base, 16, "base")
    _launch(payloads, table, base.view(torch.int16), stream, device, None)


def _launch(payloads: torch.Tensor, table: BatchTable, bits: torch.Tensor, stream, device: torch.device,
            errors: torch.Tensor | None) -> None:
    """The two launches of a batch: dense tiles, then escapes (each only if the table has programs for it), which
    check their streams into ``errors`` when given."""
    with on_stream(stream, device):
        if table.tile_owner.numel():
            _decode_batch_kernel[(table.tile_owner.numel(),)](payloads, bits, table.descriptors, table.tile_owner,
                                                              ROWS=ROWS, num_warps=BATCH_WARPS)
        if table.escape_owner.numel():
            _escape_batch_kernel[(table.escape_owner.numel(),)](
                payloads, bits, table.descriptors, table.escape_owner, bits if errors is None else errors,
                BLOCK=ESCAPE_BLOCK, CHECK=errors is not None, num_warps=4)
