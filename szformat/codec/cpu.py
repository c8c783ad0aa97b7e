"""SplitZip on the CPU in pure PyTorch: the reference every other path is tested against, bit for bit.

It runs wherever PyTorch runs (Windows included). Decoding works in cache-sized slices through a 16x256 lookup
table from (code, sm byte) to the 16-bit result, so one gather produces each output element.
"""

from __future__ import annotations

import torch

from .codebook import Codebook, codebook_from_histogram, exponent_histogram
from .layout import CHUNK_SIZE, ESCAPE_CODE, PayloadLayout

DECODE_SLICE = 1 << 18
"""Elements decoded per step: the working set of one step stays inside the L2 cache."""


def split_bf16(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Split BF16 values into (exponent byte, sign+mantissa byte), both uint8 and flat.

    BF16 bits are ``s eeeeeeee mmmmmmm``; little-endian storage puts ``e0 mmmmmmm`` in the low byte and
    ``s eeeeeee`` in the high byte.
    """
    if x.dtype != torch.bfloat16:
        raise TypeError(f"SplitZip encodes bfloat16 tensors only, got {x.dtype}")
    pairs = x.detach().contiguous().reshape(-1).view(torch.uint8).view(-1, 2)
    lo, hi = pairs[:, 0], pairs[:, 1]
    exponent = (hi << 1) | (lo >> 7)
    sm = (hi & 0x80) | (lo & 0x7F)
    return exponent, sm


def calibrate(x: torch.Tensor) -> Codebook:
    """The Top-16 codebook of a BF16 tensor."""
    exponent, _ = split_bf16(x)
    return codebook_from_histogram(exponent_histogram(exponent))


def encode(x: torch.Tensor, codebook: Codebook | None = None) -> tuple[torch.Tensor, PayloadLayout, Codebook]:
    """Encode a BF16 tensor to its SplitZip payload (uint8 tensor of ``layout.comp_bytes``)."""
    exponent, sm = split_bf16(x)
    if codebook is None:
        codebook = codebook_from_histogram(exponent_histogram(exponent))
    n = exponent.numel()
    codes = codebook.encode_lut()[exponent.long()] if n else exponent
    escape_pos = torch.nonzero(codes == ESCAPE_CODE).reshape(-1)
    layout = PayloadLayout(n=n, n_esc=escape_pos.numel())

    payload = torch.zeros(layout.comp_bytes, dtype=torch.uint8)
    nibbles = codes & 0xF
    if n % 2:
        nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
    nibbles = nibbles.view(-1, 2)
    payload[layout.off_pk: layout.off_pk + layout.n_pairs] = (nibbles[:, 0] << 4) | nibbles[:, 1]
    payload[layout.off_sm: layout.off_sm + n] = sm
    if layout.n_esc:
        chunk_id = (escape_pos // CHUNK_SIZE).to(torch.int32)
        local_pos = (escape_pos % CHUNK_SIZE).to(torch.int16)  # < 1024: same bytes as u16
        payload[layout.off_cid: layout.off_lpos] = chunk_id.view(torch.uint8)
        payload[layout.off_lpos: layout.off_lpos + 2 * layout.n_esc] = local_pos.view(torch.uint8)
        payload[layout.off_ev: layout.off_ev + layout.n_esc] = exponent[escape_pos]
    return payload, layout, codebook


def escape_positions(payload: torch.Tensor, layout: PayloadLayout) -> torch.Tensor:
    """Global element index (int64) of each escape, validated: in range and strictly ascending.

    Raises:
        ValueError: the escape stream is inconsistent; callers wrap it with the file and tensor name.
    """
    if layout.n_esc == 0:
        return torch.zeros(0, dtype=torch.int64)
    chunk_id = payload[layout.off_cid: layout.off_lpos].view(torch.int32).long()
    local_pos = payload[layout.off_lpos: layout.off_lpos + 2 * layout.n_esc].view(torch.int16).long() & 0xFFFF
    if int(local_pos.max()) >= layout.chunk_size:
        raise ValueError(f"escape local position {int(local_pos.max())} is outside its chunk of {layout.chunk_size}")
    if int(chunk_id.min()) < 0 or int(chunk_id.max()) >= layout.n_chunks:
        raise ValueError(f"escape chunk id out of range 0..{layout.n_chunks - 1}")
    position = chunk_id * layout.chunk_size + local_pos
    if int(position.max()) >= layout.n:
        raise ValueError(f"escape position {int(position.max())} is past the tensor's {layout.n} elements")
    if layout.n_esc > 1 and not bool((position[1:] > position[:-1]).all()):
        raise ValueError("escape positions are not strictly ascending")
    return position


def _decode_table(codebook: Codebook) -> torch.Tensor:
    """``table[code * 256 + sm]`` = the BF16 bits (as int16) of that code and sign+mantissa byte."""
    exponent = codebook.decode_lut().to(torch.int32).view(16, 1)
    sm = torch.arange(256, dtype=torch.int32).view(1, 256)
    bits = ((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)
    return bits.reshape(-1).to(torch.int16)  # wraps 0x8000.. into negative int16: same bits


def decode(
    payload: torch.Tensor,
    layout: PayloadLayout,
    codebook: Codebook,
    *,
    start: int = 0,
    stop: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode elements ``[start, stop)`` of a SplitZip payload into a flat bfloat16 tensor.

    ``payload`` is a uint8 CPU tensor of at least ``layout.comp_bytes`` (a zero-copy view of an mmap is fine).
    ``out``, when given, is a contiguous bfloat16 tensor of ``stop - start`` elements written in place.
    """
    stop = layout.n if stop is None else stop
    if not 0 <= start <= stop <= layout.n:
        raise ValueError(f"element range [{start}, {stop}) is outside 0..{layout.n}")
    if payload.numel() < layout.comp_bytes:
        raise ValueError(f"payload holds {payload.numel()} bytes, its layout needs {layout.comp_bytes}")
    count = stop - start
    if out is None:
        out = torch.empty(count, dtype=torch.bfloat16)
    elif out.dtype != torch.bfloat16 or out.numel() != count or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bfloat16 tensor of {count} elements")
    bits = out.view(torch.int16).reshape(-1)
    table = _decode_table(codebook)
    pk = payload[layout.off_pk: layout.off_pk + layout.n_pairs]
    sm = payload[layout.off_sm: layout.off_sm + layout.n]

    for a in range(start, stop, DECODE_SLICE):
        b = min(a + DECODE_SLICE, stop)
        first_pair, last_pair = a // 2, (b + 1) // 2
        packed = pk[first_pair:last_pair]
        codes = torch.stack((packed >> 4, packed & 0xF), dim=1).reshape(-1)
        codes = codes[a - 2 * first_pair: a - 2 * first_pair + (b - a)]
        index = (codes.to(torch.int32) << 8) | sm[a:b].to(torch.int32)
        torch.index_select(table, 0, index, out=bits[a - start: b - start])

    position = escape_positions(payload, layout)
    if position.numel():
        lo, hi = torch.searchsorted(position, torch.tensor([start, stop])).tolist()
        position = position[lo:hi]
        if position.numel():
            ev = payload[layout.off_ev + lo: layout.off_ev + hi].to(torch.int32)
            s = sm[position].to(torch.int32)
            bits[position - start] = (((s & 0x80) << 8) | (ev << 7) | (s & 0x7F)).to(torch.int16)
    return out
