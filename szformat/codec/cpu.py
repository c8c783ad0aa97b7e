"""SplitZip on the CPU in pure PyTorch: the reference every other path is tested against, bit for bit.

It runs wherever PyTorch runs (Windows included) and needs no compiled extension. Its speed comes from a few
choices, each measured with ``tools/bench_cpu.py`` and PyTorch's profiler:

- **Pairs, not elements.** Two BF16 elements are one little-endian int32 word, and the payload keeps their two
  exponent codes in one ``pk`` byte. Decoding a pair is one gather from a 256-entry int32 table (``pk`` byte -> both
  exponent fields in place) OR-ed with both sign+mantissa fields; those come from the ``sm`` bytes read as int8 and
  widened to int16 (which copies each sign into bit 15) and masked. Encoding a pair gathers its ``pk`` byte from a
  65,536-entry table indexed by the pair's two exponent bytes.
- **Few, cache-sized ops.** Every eager PyTorch call costs a few microseconds and streams its operands through
  memory, so the work runs in slices of :data:`SLICE_PAIRS` pairs whose temporaries stay in the L2 cache, with as
  few calls per slice as the arithmetic allows (5 to decode, 7 to encode). Only input and output touch DRAM.
- **int32 indices.** ``torch.index_select`` with an int32 index is the fastest gather PyTorch offers on the CPU
  (several times faster than ``Tensor.__getitem__``, ``torch.take`` or NumPy's ``take``).
- **Escapes aside.** The encoder gathers escape flags only for tensors that have escapes and scans them with
  ``nonzero`` over int64 words, 8 pairs per step; the decoder decodes every element as if it had no escape and then
  patches the escaped ones.

Odd elements at the ends of a range are done one at a time, so every range of every input decodes exactly. Byte
views assume a little-endian host, as PyTorch's ``Tensor.view(dtype)`` does.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch

from .codebook import Codebook, codebook_from_histogram
from .layout import ESCAPE_CODE, PayloadLayout

SLICE_PAIRS = 1 << 16
"""Pairs processed per step (a multiple of 8): each temporary of a step (64 to 256 KiB) stays in a core's L2 cache,
and the fixed cost of a PyTorch call stays small next to its work."""

_SIGN_AND_MANTISSA = -0x7F81
"""``0x807F`` as int16: the sign and mantissa bits of one BF16 element."""


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


# ---------------------------------------------------------------------------------------------------------------
# Slices, views and scratch buffers
# ---------------------------------------------------------------------------------------------------------------


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """The 16 bits of each element of a BF16 tensor as a flat int16 tensor (a view when ``x`` is contiguous)."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"SplitZip encodes bfloat16 tensors only, got {x.dtype}")
    return x.detach().contiguous().reshape(-1).view(torch.int16)


def _view_as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Flat contiguous ``t`` viewed as a wider integer dtype; copied first when its storage offset forbids the view."""
    if t.storage_offset() % (dtype.itemsize // t.element_size()):
        t = t.clone()
    return t.view(dtype)


def _pair_slices(n_pairs: int) -> Iterator[tuple[int, int]]:
    """``(first, stop)`` pair ranges of at most :data:`SLICE_PAIRS` that cover ``0..n_pairs``."""
    return ((a, min(a + SLICE_PAIRS, n_pairs)) for a in range(0, n_pairs, SLICE_PAIRS))


class _SliceScratch:
    """Temporaries for one slice, allocated once per call and reused by every slice."""

    def __init__(self, n_pairs: int):
        size = max(1, min(SLICE_PAIRS, n_pairs))
        self.index = torch.empty(size, dtype=torch.int32)
        self.words = torch.empty(size, dtype=torch.int32)
        self.halves = torch.empty(2 * size, dtype=torch.int16)
        self.bytes = torch.empty(2 * size, dtype=torch.uint8)


# ---------------------------------------------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------------------------------------------


def _exponents(bits: torch.Tensor, scratch: _SliceScratch) -> torch.Tensor:
    """The exponent byte of each BF16 element in ``bits`` (int16), as uint8 in scratch.

    ``bits >> 7`` has the exponent in its low byte; writing it to uint8 keeps that byte.
    """
    return torch.bitwise_right_shift(bits, 7, out=scratch.bytes[: bits.numel()])


def _exponent_pair_index(bits: torch.Tensor, scratch: _SliceScratch) -> torch.Tensor:
    """``e0 | e1 << 8`` for each pair of BF16 elements in ``bits`` (int16, even length), as int32 in scratch.

    The exponent bytes read in pairs are one int16 per pair; the mask makes it a non-negative int32 index.
    """
    index = scratch.index[: bits.numel() // 2]
    index.copy_(_exponents(bits, scratch).view(torch.int16))
    return index.bitwise_and_(0xFFFF)


def exponent_counts(x: torch.Tensor) -> torch.Tensor:
    """How many elements of a BF16 tensor have each exponent byte (int64, 256 entries).

    The same counts as ``exponent_histogram(split_bf16(x)[0])``, computed slice by slice so the exponent bytes never
    leave the cache. (``bincount`` is serial; over uint8 into 256 bins it beats counting exponent pairs into 65,536
    bins once the larger histogram's zeroing and summing are paid.)
    """
    bits = _bf16_bits(x)
    scratch = _SliceScratch((bits.numel() + 1) // 2)
    counts = torch.zeros(256, dtype=torch.int64)
    for a in range(0, bits.numel(), 2 * SLICE_PAIRS):
        counts += torch.bincount(_exponents(bits[a: a + 2 * SLICE_PAIRS], scratch), minlength=256)
    return counts


def calibrate(x: torch.Tensor) -> Codebook:
    """The Top-16 codebook of a BF16 tensor."""
    return codebook_from_histogram(exponent_counts(x))


def payload_layout(histogram: torch.Tensor, codebook: Codebook) -> PayloadLayout:
    """The layout of the payload that :func:`encode_into` writes for a tensor with this exponent histogram.

    Lets a writer size and place a payload before encoding it: ``n`` is the histogram's total and ``n_esc`` the
    number of elements whose exponent is not in the codebook.
    """
    counts = histogram.tolist()
    n = sum(counts)
    return PayloadLayout(n=n, n_esc=n - sum(counts[e] for e in codebook.dec_lut[: codebook.n_used]))


# ---------------------------------------------------------------------------------------------------------------
# Encoding
# ---------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _pair_code_tables(dec_lut: tuple[int, ...], n_used: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two uint8 tables indexed by ``e0 | e1 << 8``: the pair's ``pk`` byte, and its escape flags (bit 0: e0, bit 1:
    e1). An escaped exponent gets nibble ``ESCAPE_CODE & 0xF`` (0)."""
    code = torch.full((256,), ESCAPE_CODE, dtype=torch.int32)
    code[list(dec_lut[:n_used])] = torch.arange(n_used, dtype=torch.int32)
    nibble = code & 0xF
    escaped = (code == ESCAPE_CODE).to(torch.int32)
    pk = (nibble.view(1, 256) << 4) | nibble.view(256, 1)  # rows e1, columns e0; e0 in the high nibble
    flags = escaped.view(1, 256) | (escaped.view(256, 1) << 1)
    return pk.reshape(-1).to(torch.uint8), flags.reshape(-1).to(torch.uint8)


class _EscapeFinder:
    """Collects the element positions of escapes while a tensor is encoded slice by slice.

    Each slice's escape flags (one byte per pair, from a table gather) go into a block buffer; a full block is
    scanned once with ``nonzero`` over its bytes read 8 at a time as int64, and only the flagged words are kept. A
    scan per slice would cost more than the gather: each PyTorch call has a fixed cost of a few microseconds.
    """

    def __init__(self, n_pairs: int):
        self.flags = torch.empty(min(4 * SLICE_PAIRS, -(-n_pairs // 8) * 8), dtype=torch.uint8)
        self.block_start = 0  # the pair the buffer starts at (a multiple of 8)
        self.filled = 0
        self.found: list[tuple[torch.Tensor, torch.Tensor]] = []  # (index of an 8-pair group, its flags word)

    def add(self, flag_table: torch.Tensor, pair_index: torch.Tensor, first_pair: int) -> None:
        """Record the flags of pairs ``first_pair, first_pair + 1, ...`` from their exponent pair index."""
        if self.filled + pair_index.numel() > self.flags.numel():
            self._scan()
            self.block_start = first_pair
        torch.index_select(flag_table, 0, pair_index, out=self.flags[self.filled: self.filled + pair_index.numel()])
        self.filled += pair_index.numel()

    def _scan(self) -> None:
        whole = -(-self.filled // 8) * 8
        self.flags[self.filled: whole] = 0
        words = self.flags[:whole].view(torch.int64)
        group = torch.nonzero(words).reshape(-1)
        if group.numel():
            self.found.append((group + self.block_start // 8, words[group]))
        self.filled = 0

    def positions(self) -> torch.Tensor:
        """Ascending element positions (int64) of all escapes recorded.

        Pair ``j`` of a group has its flags in byte ``j`` of the word: bit ``8 j`` for its first element and bit
        ``8 j + 1`` for its second.
        """
        self._scan()
        if not self.found:
            return torch.zeros(0, dtype=torch.int64)
        group = torch.cat([g for g, _ in self.found]).view(-1, 1)
        word = torch.cat([w for _, w in self.found]).view(-1, 1)
        element = torch.arange(16)  # element 2 j + e of the group's 16
        escaped = ((word >> (8 * (element // 2) + element % 2)) & 1).bool()
        return (16 * group + element)[escaped]


def _write_padding(payload: torch.Tensor, layout: PayloadLayout) -> None:
    """Zero the alignment gaps between streams, so equal tensors always give equal bytes."""
    for gap_start, gap_stop in (
        (layout.off_pk + layout.n_pairs, layout.off_sm),
        (layout.off_sm + layout.n, layout.off_cid),
        (layout.off_lpos + 2 * layout.n_esc, layout.off_ev),
    ):
        payload[gap_start:gap_stop] = 0


def encode_into(x: torch.Tensor, codebook: Codebook, layout: PayloadLayout, payload: torch.Tensor) -> None:
    """Write the SplitZip payload of a BF16 tensor into ``payload[:layout.comp_bytes]``, every byte (padding too).

    Args:
        x (`torch.Tensor`): the bfloat16 tensor (any shape; encoded in row-major order).
        codebook (`Codebook`): the exponent codebook, usually ``calibrate(x)``.
        layout (`PayloadLayout`): ``payload_layout(exponent_counts(x), codebook)``.
        payload (`torch.Tensor`): a flat contiguous uint8 CPU tensor of at least ``layout.comp_bytes`` (a view of a
            writable mmap is fine).

    Raises:
        ValueError: ``layout`` does not describe ``x`` encoded with ``codebook``, or ``payload`` cannot hold it.
    """
    bits = _bf16_bits(x)
    n = bits.numel()
    if layout.n != n:
        raise ValueError(f"layout is for {layout.n} elements, the tensor has {n}")
    _check_payload(payload, layout)
    pk_table, flag_table = _pair_code_tables(codebook.dec_lut, codebook.n_used)
    pk = payload[layout.off_pk: layout.off_pk + layout.n_pairs]
    sm = payload[layout.off_sm: layout.off_sm + n]
    scratch = _SliceScratch(n // 2)
    escapes = _EscapeFinder(n // 2) if layout.n_esc else None

    for a, b in _pair_slices(n // 2):
        m = b - a
        pair_index = _exponent_pair_index(bits[2 * a: 2 * b], scratch)
        torch.index_select(pk_table, 0, pair_index, out=pk[a:b])
        if escapes is not None:
            escapes.add(flag_table, pair_index, a)
        # sm byte = sign << 7 | mantissa: keep sign and mantissa; the arithmetic shift copies the sign into bit 7.
        kept = torch.bitwise_and(bits[2 * a: 2 * b], _SIGN_AND_MANTISSA, out=scratch.halves[: 2 * m])
        sign = torch.bitwise_right_shift(kept, 8, out=scratch.words.view(torch.int16)[: 2 * m])
        torch.bitwise_or(kept, sign, out=sm[2 * a: 2 * b])  # writing uint8 keeps the low byte

    position = escapes.positions() if escapes is not None else torch.zeros(0, dtype=torch.int64)
    if n % 2:
        last = int(bits[-1]) & 0xFFFF
        exponent = (last >> 7) & 0xFF  # as the first element of a pair (the table's column)
        pk[-1] = int(pk_table[exponent]) & 0xF0  # the low nibble is padding
        sm[-1] = ((last >> 8) & 0x80) | (last & 0x7F)
        if int(flag_table[exponent]) & 1:
            position = torch.cat((position, torch.tensor([n - 1])))

    if position.numel() != layout.n_esc:
        raise ValueError(f"the codebook leaves {position.numel()} escapes, the layout expects {layout.n_esc}")
    _write_padding(payload, layout)
    if layout.n_esc:
        chunk_id = (position // layout.chunk_size).to(torch.int32)
        local_pos = (position % layout.chunk_size).to(torch.int16)  # < 65536: the same bytes as u16
        payload[layout.off_cid: layout.off_lpos] = chunk_id.view(torch.uint8)
        payload[layout.off_lpos: layout.off_lpos + 2 * layout.n_esc] = local_pos.view(torch.uint8)
        payload[layout.off_ev: layout.off_ev + layout.n_esc] = ((bits[position] >> 7) & 0xFF).to(torch.uint8)


def encode(x: torch.Tensor, codebook: Codebook | None = None) -> tuple[torch.Tensor, PayloadLayout, Codebook]:
    """Encode a BF16 tensor to its SplitZip payload (uint8 tensor of ``layout.comp_bytes``).

    ``codebook`` defaults to ``calibrate(x)``; a given one may leave any number of escapes.
    """
    histogram = exponent_counts(x)
    if codebook is None:
        codebook = codebook_from_histogram(histogram)
    layout = payload_layout(histogram, codebook)
    payload = torch.empty(layout.comp_bytes, dtype=torch.uint8)
    encode_into(x, codebook, layout, payload)
    return payload, layout, codebook


# ---------------------------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------------------------


def _check_payload(payload: torch.Tensor, layout: PayloadLayout) -> None:
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise ValueError(f"a payload is a flat contiguous uint8 tensor, got {payload.dtype} of shape "
                         f"{tuple(payload.shape)}")
    if payload.numel() < layout.comp_bytes:
        raise ValueError(f"payload holds {payload.numel()} bytes, its layout needs {layout.comp_bytes}")


def escape_positions(payload: torch.Tensor, layout: PayloadLayout) -> torch.Tensor:
    """Global element index (int64) of each escape, validated: in range and strictly ascending.

    Raises:
        ValueError: the escape stream is inconsistent; callers wrap it with the file and tensor name.
    """
    if layout.n_esc == 0:
        return torch.zeros(0, dtype=torch.int64)
    chunk_id = _view_as(payload[layout.off_cid: layout.off_lpos], torch.int32).long()
    local_pos = _view_as(payload[layout.off_lpos: layout.off_lpos + 2 * layout.n_esc], torch.int16).long() & 0xFFFF
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


@functools.lru_cache(maxsize=64)
def _pair_exponent_table(dec_lut: tuple[int, ...]) -> torch.Tensor:
    """``table[pk byte]`` = both exponent fields of the pair, in place in its int32 word (int32, 256 entries)."""
    exponent = torch.tensor(dec_lut, dtype=torch.int32)
    first = (exponent << 7).view(16, 1)  # high nibble -> element 2i, the low half of the word
    second = (exponent << 23).view(1, 16)  # low nibble -> element 2i+1, the high half
    return (first | second).reshape(-1)


def _decode_pairs(pk: torch.Tensor, sm: torch.Tensor, table: torch.Tensor, out: torch.Tensor,
                  scratch: _SliceScratch) -> None:
    """Decode ``len(out)`` pairs from their ``pk`` bytes and ``sm`` bytes (as int8) into int32 words of two BF16s."""
    m = out.numel()
    index = scratch.index[:m]
    index.copy_(pk)
    torch.index_select(table, 0, index, out=out)  # both exponent fields
    fields = scratch.halves[: 2 * m]
    fields.copy_(sm)  # int8 -> int16 sign-extends: the sign lands in bit 15 (and bits 7..14)
    fields.bitwise_and_(_SIGN_AND_MANTISSA)
    out.bitwise_or_(fields.view(torch.int32))


def _decode_pair_range(pk: torch.Tensor, sm: torch.Tensor, codebook: Codebook, first: int, stop: int,
                       bits: torch.Tensor) -> None:
    """Decode the whole pairs of elements ``[first, stop)`` (both even) into ``bits`` (int16, ``stop - first``)."""
    table = _pair_exponent_table(codebook.dec_lut)
    pk = pk[first // 2: stop // 2]
    sm = sm[first:stop].view(torch.int8)
    scratch = _SliceScratch(pk.numel())
    aligned = bits.storage_offset() % 2 == 0  # else `out` starts at an odd element: decode to scratch, then copy
    for a, b in _pair_slices(pk.numel()):
        if aligned:
            _decode_pairs(pk[a:b], sm[2 * a: 2 * b], table, bits[2 * a: 2 * b].view(torch.int32), scratch)
        else:
            words = scratch.words[: b - a]
            _decode_pairs(pk[a:b], sm[2 * a: 2 * b], table, words, scratch)
            bits[2 * a: 2 * b].copy_(words.view(torch.int16))


def _decode_one(pk: torch.Tensor, sm: torch.Tensor, dec_lut: tuple[int, ...], i: int) -> int:
    """Element ``i`` (escapes aside) as an int16 value: for the odd element at either end of a range."""
    byte = int(pk[i // 2])
    exponent = dec_lut[byte & 0xF if i % 2 else byte >> 4]
    s = int(sm[i])
    bits = ((s & 0x80) << 8) | (exponent << 7) | (s & 0x7F)
    return bits - 0x10000 if bits & 0x8000 else bits


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

    ``payload`` is a flat uint8 CPU tensor of at least ``layout.comp_bytes`` (a zero-copy view of an mmap is fine).
    ``out``, when given, is a contiguous bfloat16 tensor of ``stop - start`` elements written in place. Runs on
    PyTorch's intra-op threads (``torch.set_num_threads``).

    Raises:
        ValueError: a bad range, a short payload, a wrong ``out`` or an inconsistent escape stream; nothing has been
            written to ``out`` then.
    """
    stop = layout.n if stop is None else stop
    if not 0 <= start <= stop <= layout.n:
        raise ValueError(f"element range [{start}, {stop}) is outside 0..{layout.n}")
    _check_payload(payload, layout)
    count = stop - start
    if out is None:
        out = torch.empty(count, dtype=torch.bfloat16)
    elif out.dtype != torch.bfloat16 or out.numel() != count or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bfloat16 tensor of {count} elements")
    position = escape_positions(payload, layout)
    bits = out.view(torch.int16).reshape(-1)
    pk = payload[layout.off_pk: layout.off_pk + layout.n_pairs]
    sm = payload[layout.off_sm: layout.off_sm + layout.n]

    first, last = start + start % 2, stop - stop % 2  # the whole pairs inside the range
    if start % 2 and start < stop:
        bits[0] = _decode_one(pk, sm, codebook.dec_lut, start)
    if stop % 2 and stop - 1 >= start:
        bits[stop - 1 - start] = _decode_one(pk, sm, codebook.dec_lut, stop - 1)
    if first < last:
        _decode_pair_range(pk, sm, codebook, first, last, bits[first - start: last - start])

    lo, hi = torch.searchsorted(position, torch.tensor([start, stop])).tolist()
    if hi > lo:  # escaped elements: keep the decoded sign and mantissa, put in the raw exponent
        target = position[lo:hi] - start
        exponent = payload[layout.off_ev + lo: layout.off_ev + hi].to(torch.int32)
        kept = bits[target].to(torch.int32) & 0x807F
        bits[target] = (kept | (exponent << 7)).to(torch.int16)
    return out
