"""SplitZip decode on the GPU: one payload into a BF16 tensor, out of place or over the payload's own slot.

Two kernels per tensor, enqueued back to back on one stream:

* the dense pass reads ``pk`` and ``sm`` and writes every element as if it were coded (an escaped element, whose
  nibble is 0, gets code 0's exponent for now). A program owns ``4 * ROWS`` element pairs: per pair it reads one pk
  byte (two codes) and one 16-bit ``sm`` word and writes one 32-bit word holding both BF16 values. The exponent bits
  of both elements come from one look-up in a 256-entry table indexed by the pk byte, built by each program from
  the 16 codebook bytes (four int32 arguments) and kept in shared memory;
* the escape pass, one lane per escape, overwrites the escaped elements from the escape stream. Escapes are few, so
  it costs next to nothing; it never writes outside ``[0, n)`` whatever the stream says (the file layer validates
  payloads against their checksums before they reach a decoder).

The batched decoder (:mod:`._batch`) runs the same two per-tile functions, fed from a descriptor table.
"""

from __future__ import annotations

import torch

from ..codebook import Codebook
from ..layout import PayloadLayout
from ._common import check_aligned, check_device, codebook_words, on_stream, tl, triton

__all__ = ["DecodeScratch", "decode", "decode_in_place"]

ROWS = 512
"""Rows of four element pairs per dense program: 4096 elements."""

DECODE_WARPS = 4
"""Warps per dense program of :func:`decode` (four rows each thread): the fastest shape measured on the H200 for one
large tensor, within 1% of the others tried (``bench/gpu.py``)."""
ESCAPE_BLOCK = 1024
"""Escapes fixed per program of the escape pass."""


@triton.jit
def _exponent_of(code, l0, l1, l2, l3):
    """The exponent byte of 4-bit ``code``: byte ``code % 4`` of word ``code // 4`` of the packed codebook."""
    word = tl.where(code < 8, tl.where(code < 4, l0, l1), tl.where(code < 12, l2, l3))
    return (word >> ((code & 3) * 8)) & 0xFF


@triton.jit
def _pair_table(l0, l1, l2, l3):
    """``table[b]``: the exponent bits of the two elements coded by pk byte ``b``, where an int32 pair holds them.

    The first element (high nibble) is the low half-word, its exponent at bits 7..14; the second at bits 23..30.
    """
    b = tl.arange(0, 256)
    return (_exponent_of(b >> 4, l0, l1, l2, l3) << 7) | (_exponent_of(b & 15, l0, l1, l2, l3) << 23)


@triton.jit
def _merge_pairs(code2, sm, table, ROWS: tl.constexpr):
    """Two BF16 values per int32 from a pk byte and an ``sm`` half-word: ``sign | exponent | mantissa`` twice."""
    exponent_bits = tl.reshape(tl.gather(table, tl.reshape(code2, [ROWS * 4]), 0), [ROWS, 4])
    s0 = sm & 0xFF
    s1 = (sm >> 8) & 0xFF
    spread = s0 | (s0 << 8) | (s1 << 16) | (s1 << 24)  # bytes s0 s0 s1 s1: sign bits land on bits 15 and 31
    return (spread & -2139127681) | exponent_bits  # mask 0x807F807F: keep mantissas and signs, room for exponents


@triton.jit
def _decode_tile(pay_ptr, off_sm, out_ptr, n, tile, l0, l1, l2, l3, ROWS: tl.constexpr):
    """Dense pass over tile ``tile`` of the tensor whose payload starts at ``pay_ptr`` (u8) and output at
    ``out_ptr`` (i16, element 0). Full tiles take the unmasked path, which the compiler vectorizes."""
    PAIRS: tl.constexpr = ROWS * 4
    table = _pair_table(l0, l1, l2, l3)
    n_full = n // 2  # pairs holding two elements
    first = tile * PAIRS
    pair = first + (tl.arange(0, ROWS)[:, None] * 4 + tl.arange(0, 4)[None, :])
    off_sm = off_sm // 4 * 4  # a no-op that tells the compiler sm starts on a word: 4-byte loads at least
    sm16 = (pay_ptr + off_sm).to(tl.pointer_type(tl.int16))
    out32 = out_ptr.to(tl.pointer_type(tl.int32))
    if first + PAIRS <= n_full:
        code2 = tl.load(pay_ptr + pair).to(tl.int32)
        sm = tl.load(sm16 + pair).to(tl.int32)
        tl.store(out32 + pair, _merge_pairs(code2, sm, table, ROWS))
    else:
        full = pair < n_full
        code2 = tl.load(pay_ptr + pair, mask=full, other=0).to(tl.int32)
        sm = tl.load(sm16 + pair, mask=full, other=0).to(tl.int32)
        tl.store(out32 + pair, _merge_pairs(code2, sm, table, ROWS), mask=full)
        if n % 2 == 1:  # the last element sits alone in the high nibble of the last pk byte
            code = tl.load(pay_ptr + n_full).to(tl.int32) >> 4
            s = tl.load(pay_ptr + off_sm + n - 1).to(tl.int32)
            bits = ((s & 0x80) << 8) | (_exponent_of(code, l0, l1, l2, l3) << 7) | (s & 0x7F)
            tl.store(out_ptr + n - 1, bits.to(tl.int16))


@triton.jit
def _fix_escapes(pay_ptr, off_sm, off_cid, out_ptr, n, n_esc, chunk_size, first, err_ptr, BLOCK: tl.constexpr,
                 CHECK: tl.constexpr):
    """Escape pass over escapes ``[first, first + BLOCK)``: each writes ``sign | esc_val | mantissa`` at its
    position. Positions outside ``[0, n)`` are skipped, so a corrupt stream cannot write out of bounds.

    With ``CHECK``, the rules of the spec are checked on the device too, on the bytes this pass decodes: a local
    position outside its chunk, a chunk id outside the tensor's chunks, a position past the tensor, or one not
    above the escape before it sets ``*err_ptr`` to 1 (then the tensor is not to be used)."""
    index = first + tl.arange(0, BLOCK)
    live = index < n_esc
    off_lpos = off_cid + 4 * n_esc
    off_ev = (off_lpos + 2 * n_esc + 3) // 4 * 4
    chunk_ids = (pay_ptr + off_cid).to(tl.pointer_type(tl.int32))
    local_ptr = (pay_ptr + off_lpos).to(tl.pointer_type(tl.int16))
    chunk = tl.load(chunk_ids + index, mask=live, other=-1)
    local = tl.load(local_ptr + index, mask=live, other=0).to(tl.int32) & 0xFFFF
    exponent = tl.load(pay_ptr + off_ev + index, mask=live, other=0).to(tl.int32)
    position = chunk.to(tl.int64) * chunk_size + local
    ok = live & (chunk >= 0) & (local < chunk_size) & (position < n)
    s = tl.load(pay_ptr + off_sm + position, mask=ok, other=0).to(tl.int32)
    bits = ((s & 0x80) << 8) | (exponent << 7) | (s & 0x7F)
    tl.store(out_ptr + position, bits.to(tl.int16), mask=ok)
    if CHECK:
        has_previous = live & (index > 0)
        previous = (tl.load(chunk_ids + index - 1, mask=has_previous, other=0).to(tl.int64) * chunk_size
                    + (tl.load(local_ptr + index - 1, mask=has_previous, other=0).to(tl.int32) & 0xFFFF))
        n_chunks = (n + chunk_size - 1) // chunk_size
        bad = live & ((chunk < 0) | (chunk >= n_chunks) | (local >= chunk_size) | (position >= n)
                      | (has_previous & (position <= previous)))
        tl.store(err_ptr, 1, mask=tl.max(bad.to(tl.int32), axis=0) > 0)


@triton.jit(do_not_specialize=["n", "l0", "l1", "l2", "l3"])
def _decode_kernel(pay_ptr, off_sm, out_ptr, n, l0, l1, l2, l3, ROWS: tl.constexpr):
    _decode_tile(pay_ptr, tl.cast(off_sm, tl.int64), out_ptr, tl.cast(n, tl.int64), tl.program_id(0).to(tl.int64),
                 l0, l1, l2, l3, ROWS)


@triton.jit(do_not_specialize=["off_sm", "off_cid", "n", "n_esc", "chunk_size"])
def _escape_kernel(pay_ptr, off_sm, off_cid, out_ptr, n, n_esc, chunk_size, err_ptr, BLOCK: tl.constexpr,
                   CHECK: tl.constexpr):
    first = tl.program_id(0).to(tl.int64) * BLOCK
    _fix_escapes(pay_ptr, tl.cast(off_sm, tl.int64), tl.cast(off_cid, tl.int64), out_ptr, tl.cast(n, tl.int64),
                 tl.cast(n_esc, tl.int64), chunk_size, first, err_ptr, BLOCK, CHECK)


def _launch(payload: torch.Tensor, layout: PayloadLayout, codebook: Codebook, out_bits: torch.Tensor,
            errors: torch.Tensor | None) -> None:
    """Enqueue both passes on the current stream: ``payload`` (u8) into ``out_bits`` (i16, ``layout.n`` elements);
    the escape pass checks its streams into ``errors`` when given."""
    if layout.n == 0:
        return
    tiles = triton.cdiv(layout.n_pairs, ROWS * 4)
    _decode_kernel[(tiles,)](payload, layout.off_sm, out_bits, layout.n, *codebook_words(codebook),
                             ROWS=ROWS, num_warps=DECODE_WARPS)
    if layout.n_esc:
        _escape_kernel[(triton.cdiv(layout.n_esc, ESCAPE_BLOCK),)](
            payload, layout.off_sm, layout.off_cid, out_bits, layout.n, layout.n_esc, layout.chunk_size,
            out_bits if errors is None else errors, BLOCK=ESCAPE_BLOCK, CHECK=errors is not None, num_warps=4)


def check_errors(errors: torch.Tensor | None, count: int, device: torch.device) -> None:
    """Raise ValueError unless ``errors`` is ``None`` or a contiguous int32 tensor of ``count`` elements on
    ``device`` (the escape checks' flags: one per tensor decoded)."""
    if errors is not None and (errors.dtype != torch.int32 or errors.numel() != count or not errors.is_contiguous()
                               or errors.device != device):
        raise ValueError(f"errors must be a contiguous int32 tensor of {count} element(s) on {device}")


def _check_payload(payload: torch.Tensor, layout: PayloadLayout) -> None:
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise ValueError(f"payload must be a flat contiguous uint8 tensor, got {payload.dtype} {tuple(payload.shape)}")
    if payload.numel() < layout.comp_bytes:
        raise ValueError(f"payload holds {payload.numel()} bytes, its layout needs {layout.comp_bytes}")


def decode(
    payload: torch.Tensor,
    layout: PayloadLayout,
    codebook: Codebook,
    *,
    out: torch.Tensor | None = None,
    errors: torch.Tensor | None = None,
    stream: "torch.cuda.Stream | None" = None,
) -> torch.Tensor:
    """Decode one SplitZip payload on the GPU into a flat bfloat16 tensor, bit for bit as :func:`..cpu.decode`.

    Args:
        payload (`torch.Tensor`): flat uint8 CUDA tensor holding at least ``layout.comp_bytes`` bytes, starting on a
            4-byte boundary.
        layout (`PayloadLayout`), codebook (`Codebook`): as returned by the encoder or stored in the header.
        out (`torch.Tensor`, *optional*): contiguous bfloat16 tensor of ``layout.n`` elements, 4-byte aligned,
            written in place (any shape; it is returned as given).
        errors (`torch.Tensor`, *optional*): int32 tensor of one element on the device; the escape pass sets it to
            1 if the escape streams break a rule :func:`..cpu.escape_positions` checks (then the tensor is not to be
            used), and leaves it as it is otherwise. Without it nothing is checked.
        stream (`torch.cuda.Stream`, *optional*): where to enqueue; the current stream by default. Nothing waits
            on the host.

    Returns:
        `torch.Tensor`: ``out``, or a new flat bfloat16 tensor on the payload's device.
    """
    device = check_device(payload)
    _check_payload(payload, layout)
    check_aligned(payload, 4, "payload")
    if out is None:
        with on_stream(stream, device):
            out = torch.empty(layout.n, dtype=torch.bfloat16, device=device)
    elif out.dtype != torch.bfloat16 or out.numel() != layout.n or not out.is_contiguous() or out.device != device:
        raise ValueError(f"out must be a contiguous bfloat16 tensor of {layout.n} elements on {device}")
    check_aligned(out, 4, "out")
    check_errors(errors, 1, device)
    with on_stream(stream, device):
        _launch(payload, layout, codebook, out.view(torch.int16).reshape(-1), errors)
    return out


class DecodeScratch:
    """Reusable device memory that holds a payload while its tensor is expanded over the slot it arrived in.

    Keep one per stream and pass it to every :func:`decode_in_place` call on that stream: it grows to the largest
    payload seen and is then reused, so steady-state decoding allocates nothing.
    """

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def reserve(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A uint8 tensor of at least ``nbytes`` on ``device`` (grown by half again past the request)."""
        if self.buffer is None or self.buffer.device != device or self.buffer.numel() < nbytes:
            self.buffer = torch.empty(max(nbytes + nbytes // 2, 4096), dtype=torch.uint8, device=device)
        return self.buffer


def decode_in_place(
    buffer: torch.Tensor,
    layout: PayloadLayout,
    codebook: Codebook,
    *,
    scratch: DecodeScratch | None = None,
    errors: torch.Tensor | None = None,
    stream: "torch.cuda.Stream | None" = None,
) -> torch.Tensor:
    """Expand the payload held in the leading ``layout.comp_bytes`` of ``buffer`` into the BF16 tensor over ``buffer``.

    The payload is first copied to ``scratch`` (the expansion overwrites it), then decoded from there into
    ``buffer``; all of it is enqueued on ``stream`` with no host synchronisation, so a fence recorded after this
    call orders the tensor's consumers after its decode.

    Args:
        buffer (`torch.Tensor`): flat uint8 CUDA tensor of at least ``max(layout.raw_bytes, layout.comp_bytes)``
            bytes, 4-byte aligned (a slot sized for the raw tensor).
        layout (`PayloadLayout`), codebook (`Codebook`): the tensor's payload description.
        scratch (`DecodeScratch`, *optional*): reused across calls on one stream; a temporary one by default.
        errors (`torch.Tensor`, *optional*): as for :func:`decode`.
        stream (`torch.cuda.Stream`, *optional*): where to enqueue; the current stream by default.

    Returns:
        `torch.Tensor`: the flat bfloat16 view of ``buffer[:layout.raw_bytes]``.
    """
    device = check_device(buffer)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise ValueError(f"buffer must be a flat contiguous uint8 tensor, got {buffer.dtype} {tuple(buffer.shape)}")
    if buffer.numel() < max(layout.raw_bytes, layout.comp_bytes):
        raise ValueError(f"buffer holds {buffer.numel()} bytes; the tensor needs {layout.raw_bytes} "
                         f"and its payload {layout.comp_bytes}")
    check_aligned(buffer, 4, "buffer")
    check_errors(errors, 1, device)
    scratch = scratch if scratch is not None else DecodeScratch()
    out = buffer[: layout.raw_bytes].view(torch.bfloat16)
    with on_stream(stream, device):
        stash = scratch.reserve(layout.comp_bytes, device)
        if device.type == "cuda":
            stash.record_stream(torch.cuda.current_stream(device))  # freed only after this stream used it
        stash[: layout.comp_bytes].copy_(buffer[: layout.comp_bytes])
        _launch(stash, layout, codebook, out.view(torch.int16), errors)
    return out
