"""SplitZip on the CPU in pure PyTorch: the reference every other path is tested against, bit for bit.

It runs wherever PyTorch runs (Windows included) and needs no compiled extension. Its speed comes from a few
choices, each measured with ``bench/cpu.py`` and PyTorch's profiler:

- **Pairs, not elements.** Two BF16 elements are one little-endian int32 word, and the payload keeps their two
  exponent codes in one ``pk`` byte. Decoding a pair is one gather from a 256-entry int32 table (``pk`` byte -> both
  exponent fields in place) OR-ed with both sign+mantissa fields; those come from the ``sm`` bytes read as int8 and
  widened to int16 (which copies each sign into bit 15) and masked. Encoding a pair gathers its ``pk`` byte from a
  65,536-entry table indexed by the pair's two exponent bytes.
- **Few, cache-sized ops.** Every eager PyTorch call costs a few microseconds and streams its operands through
  memory, so the work runs in slices of :data:`SLICE_PAIRS` pairs whose temporaries stay in the L2 cache, with as
  few calls per slice as the arithmetic allows (5 to decode, 8 to encode and 5 + 2 to check, 4 to count
  exponents). Only input and output touch DRAM. Ops whose output dtype differs from their inputs' are avoided
  where a separate narrowing copy is faster.
- **The encoder checks itself.** Each slice it writes is decoded again, by the decoder's own arithmetic, while
  source and payload are still in cache, and compared with the source; the elements that do not come back are
  exactly the escapes (an escape's nibble decodes to a code of the codebook, never to the escape's exponent), so
  the check also finds them, and their streams are read back through the decoder's validation. Decoding the
  finished payload in a pass of its own read the tensor and its payload from DRAM once more, and cost 1.6 s of a
  2.2 GB conversion's 8 against about 0.8 s this way (timed apart on ``bench/convert.py``'s
  checkpoint).
- **int32 indices.** ``torch.index_select`` with an int32 index is the fastest gather PyTorch offers on the CPU
  (several times faster than ``Tensor.__getitem__``, ``torch.take`` or NumPy's ``take``).
- **Escapes aside.** The decoder decodes every element as if it had no escape and then patches the escaped ones.
  The escape streams are small, so they are read, checked and written with NumPy, whose calls cost a fraction of
  PyTorch's on small arrays, through explicitly little-endian views.

- **One intra-op thread.** A decode runs its ops on one PyTorch thread (:func:`one_intra_op_thread`): they are
  short, and forking and joining a team around each of them stalls on any descheduled thread when other processes
  share the cores. Several cores decode ranges of one :class:`PayloadDecoder` from threads of their own
  (``szformat.loading.host_decode``), which also checksum what they read and write while it is in cache
  (:meth:`PayloadDecoder.decode_checked`).
- **Small tensors in NumPy.** A tensor under half a slice (LayerNorm weights, biases) is counted and encoded with
  a few NumPy calls over single elements: there the fixed cost of each call, not the work, sets the speed.

Where the package was built with a C compiler, the pair loops run in its C extension instead
(:data:`cpu_kernel.KERNEL` says which one a process uses; ``_native.c``: one pass per range, AVX2 where the CPU
has it, the GIL released): the same arithmetic, tested bit for bit against the PyTorch loops, which stay the
reference and the fallback (``SZFORMAT_CPU_CODEC=reference`` selects them).

Odd elements at the ends of a range are done one at a time, so every range of every input decodes exactly. Byte
views assume a little-endian host, as PyTorch's ``Tensor.view(dtype)`` does.
"""

from __future__ import annotations

import functools
import threading
from contextlib import contextmanager
from typing import Iterator, NamedTuple, Sequence, Tuple, Union

import numpy as np
import torch

from .._reused import ReusedBuffer
from ..checksum import crc32, crc32_combine, crc32_join
from ..errors import RoundTripMismatch
from . import cpu_kernel
from .codebook import Codebook, codebook_from_histogram
from .layout import ESCAPE_CODE, PayloadLayout

_native = cpu_kernel.native
"""The C kernels, or None: the PyTorch loops below run (:data:`cpu_kernel.KERNEL` says which)."""

SLICE_PAIRS = 1 << 16
"""Pairs processed per step (a multiple of 8): each temporary of a step (64 to 256 KiB) stays in a core's L2 cache,
and the fixed cost of a PyTorch call stays small next to its work."""

DECODE_SLICES = 8
"""A decode's slices are this many :data:`SLICE_PAIRS` long. Each PyTorch call releases the GIL only while it
runs, so threads decoding side by side wait on each other between calls: with slices of 64 Ki pairs two threads
decoded no faster than one (the GIL handed back and forth every few microseconds), with 512 Ki pairs 1.77x faster,
and one thread as fast as before."""

WHOLE_ENCODE_ELEMENTS = 1 << 20
"""Tensors up to this many elements (2 MiB of BF16; all but the embeddings of a small model) are encoded by one C
call and checked by one decode of the whole payload (:func:`_encode_whole`), which stays in the cache at this size;
larger ones are encoded slice by slice, each checked while it is in cache."""

_SIGN_AND_MANTISSA = -0x7F81
"""``0x807F`` as int16: the sign and mantissa bits of one BF16 element."""

_SMALL_FRACTION = 2
"""Tensors of fewer than ``SLICE_PAIRS // _SMALL_FRACTION`` elements take the NumPy path (:func:`_is_small`): on
one thread here, NumPy encodes 1,024 elements in 78 us against 158 us sliced, 32,768 in 254 against 327 us, and
loses from about 64 Ki elements (416 against 404 us)."""

_LE_INT32, _LE_UINT16 = np.dtype("<i4"), np.dtype("<u2")
"""The byte order of the escape streams, whatever the host's."""


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
# Slices and views
# ---------------------------------------------------------------------------------------------------------------


def _bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """The 16 bits of each element of a BF16 tensor as a flat int16 tensor (a view when ``x`` is contiguous)."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"SplitZip encodes bfloat16 tensors only, got {x.dtype}")
    return x.detach().contiguous().reshape(-1).view(torch.int16)


def _slice_length(n_pairs: int, target: int | None = None) -> int:
    """Pairs per slice for a range of ``n_pairs``: about equal slices of 2/3 to 3/2 ``target`` (default
    :data:`SLICE_PAIRS`), a multiple of 8. (A tensor a little over one slice is not cut into a full slice and a tiny
    one: each call costs.)"""
    count = max(1, round(n_pairs / (target or SLICE_PAIRS)))
    return max(8, -(-n_pairs // (8 * count)) * 8)


def _is_small(n: int) -> bool:
    """Whether a tensor of ``n`` elements is encoded with NumPy in one go rather than in PyTorch slices.

    Below half a slice, the fixed cost of PyTorch's calls (a few microseconds each, a dozen per tensor, plus the
    65,536-entry pair tables) outweighs the work; NumPy's calls cost a fraction of that. Tied to :data:`SLICE_PAIRS`,
    so tests that shrink the slices exercise the sliced path on small tensors too.
    """
    return n < SLICE_PAIRS // _SMALL_FRACTION


def _scratch(like: torch.Tensor, size: int) -> torch.Tensor:
    """The first ``size`` entries of a scratch buffer: the buffer itself when it fits (one call fewer)."""
    return like if like.numel() == size else like[:size]


# ---------------------------------------------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------------------------------------------


def _exponents(bits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The exponent byte of each BF16 element in ``bits`` (int16), written to ``out`` (uint8, at least as long).

    ``bits >> 7`` has the exponent in its low byte; writing it to uint8 keeps that byte.
    """
    return torch.bitwise_right_shift(bits, 7, out=_scratch(out, bits.numel()))


def _exponent_pair_index(bits: torch.Tensor, exponents: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``e0 | e1 << 8`` for each pair of BF16 elements in ``bits`` (int16, even length), written to ``out`` (int32).

    The exponent bytes read in pairs are one int16 per pair; the mask makes it a non-negative int32 index.
    """
    index = _scratch(out, bits.numel() // 2)
    index.copy_(_exponents(bits, exponents).view(torch.int16))
    return index.bitwise_and_(0xFFFF)


def exponent_counts(x: torch.Tensor) -> torch.Tensor:
    """How many elements of a BF16 tensor have each exponent byte (int64, 256 entries).

    The same counts as ``torch.bincount(split_bf16(x)[0], minlength=256)``, computed slice by slice so the exponent
    bytes never leave the cache. ``bincount`` is serial, and on weights, where a few exponents dominate, each
    increment waits on the last one to the same counter; so the sign is counted too (``bits >> 7`` masked to 9
    bits, 512 counters), which splits each exponent's increments between two counters, and the two halves are
    added at the end: 1.5 against 1.2 G elements per second on one core of the build VM, on a TinyLlama-shaped
    weight. (Counting exponent pairs into 65,536 bins is no faster once the larger histogram is zeroed and summed.)
    """
    bits = _bf16_bits(x)
    if _native is not None:
        counts = np.zeros(256, dtype=np.int64)
        _native.exponent_histogram(bits.numpy(), counts)
        return torch.from_numpy(counts)
    if _is_small(bits.numel()):
        return torch.from_numpy(np.bincount(_small_exponents(bits.numpy()), minlength=256))
    step = 2 * _slice_length((bits.numel() + 1) // 2)
    signed_exponents = torch.empty(min(step, bits.numel()), dtype=torch.int16)
    counts = torch.zeros(512, dtype=torch.int64)
    for bits_slice in bits.split(step):
        sign_and_exponent = torch.bitwise_right_shift(bits_slice, 7, out=_scratch(signed_exponents, bits_slice.numel()))
        counts += torch.bincount(sign_and_exponent.bitwise_and_(0x1FF), minlength=512)
    return counts.view(2, 256).sum(0)


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


@functools.lru_cache(maxsize=16)
def _exponent_codes(dec_lut: tuple[int, ...], n_used: int) -> np.ndarray:
    """``codes[exponent byte]`` = its 4-bit code, or ``ESCAPE_CODE`` outside the codebook (uint8, 256 entries)."""
    code = np.full(256, ESCAPE_CODE, dtype=np.uint8)
    code[list(dec_lut[:n_used])] = np.arange(n_used, dtype=np.uint8)
    return code


@functools.lru_cache(maxsize=16)
def _pair_code_table(dec_lut: tuple[int, ...], n_used: int) -> torch.Tensor:
    """``table[e0 | e1 << 8]`` = the ``pk`` byte of a pair with exponent bytes ``e0``, ``e1`` (uint8, 65,536
    entries). An escaped exponent gets nibble ``ESCAPE_CODE & 0xF`` (0). Built with NumPy: a few microseconds."""
    nibble = _exponent_codes(dec_lut, n_used) & 0xF
    pk = (nibble[None, :] << 4) | nibble[:, None]  # rows e1, columns e0; e0 in the high nibble
    return torch.from_numpy(pk.reshape(-1))


def _write_padding(data: np.ndarray, layout: PayloadLayout) -> None:
    """Zero the alignment gaps between streams of a payload (as NumPy), so equal tensors always give equal bytes."""
    for gap_start, gap_stop in (
        (layout.off_pk + layout.n_pairs, layout.off_sm),
        (layout.off_sm + layout.n, layout.off_cid),
        (layout.off_lpos + 2 * layout.n_esc, layout.off_ev),
    ):
        data[gap_start:gap_stop] = 0


def encode_into(x: torch.Tensor, codebook: Codebook, layout: PayloadLayout, payload: torch.Tensor) -> None:
    """Write the SplitZip payload of a BF16 tensor into ``payload[:layout.comp_bytes]``, every byte (padding too),
    and check that it decodes bit for bit to ``x``.

    The check is the decoder's own arithmetic on the bytes written: each slice of pairs is decoded again while it
    is in cache and compared with its source, the escape streams are read back through the decoder's validation,
    and whatever the slices leave (a small tensor, an odd last element) is decoded from the finished payload. With
    the C kernels a tensor of up to :data:`WHOLE_ENCODE_ELEMENTS` is written by one call and checked by one decode
    of the whole payload (:func:`_encode_whole`).

    Args:
        x (`torch.Tensor`): the bfloat16 tensor (any shape; encoded in row-major order).
        codebook (`Codebook`): the exponent codebook, usually ``calibrate(x)``.
        layout (`PayloadLayout`): ``payload_layout(exponent_counts(x), codebook)``.
        payload (`torch.Tensor`): a flat contiguous uint8 CPU tensor of at least ``layout.comp_bytes`` (a view of a
            writable mmap is fine).

    Raises:
        ValueError: ``layout`` does not describe ``x`` encoded with ``codebook``, or ``payload`` cannot hold it.
        RoundTripMismatch: the payload does not decode to ``x`` (a codec bug).
    """
    bits = _bf16_bits(x)
    n = bits.numel()
    if layout.n != n:
        raise ValueError(f"layout is for {layout.n} elements, the tensor has {n}")
    _check_payload(payload, layout)
    data = payload.numpy()
    if _native is not None and n <= WHOLE_ENCODE_ELEMENTS:
        _encode_whole(bits.numpy(), codebook, layout, data)
        return
    pk = data[layout.off_pk: layout.off_pk + layout.n_pairs]
    sm = data[layout.off_sm: layout.off_sm + n]
    source = bits.numpy()
    # Elements [0, checked) are checked as they are encoded; their escapes decoded to `unpatched` before the patch.
    checked = 0 if (_is_small(n) and _native is None) or not codebook.n_used else n - n % 2
    position, unpatched = _encode_slices(bits[:checked], codebook, torch.from_numpy(pk[: checked // 2]),
                                         torch.from_numpy(sm[:checked]))
    if checked < n:
        rest = _encode_small(source[checked:], codebook, pk[checked // 2:], sm[checked:])
        position = np.concatenate((position, rest + checked))
    if position.size != layout.n_esc:
        raise ValueError(f"the codebook leaves {position.size} escapes, the layout expects {layout.n_esc}")
    _write_padding(data, layout)
    if layout.n_esc:
        chunk_id, local_pos, esc_val = _escape_streams(data, layout)
        chunk_id[:] = position // layout.chunk_size
        local_pos[:] = position % layout.chunk_size
        esc_val[:] = _small_exponents(source[position])
    _check_stored(payload, layout, codebook, source, checked, position, unpatched)


def _encode_whole(source: np.ndarray, codebook: Codebook, layout: PayloadLayout, data: np.ndarray) -> None:
    """:func:`encode_into` of a small tensor where the C kernels are built: the payload written by one call, then
    decoded whole by the decoder's own call (escape streams checked as a reader checks them) and compared with the
    source. Per small tensor the Python around the slice loop's calls cost more than the encode itself."""
    found = _native.encode_payload(source, _exponent_codes(codebook.dec_lut, codebook.n_used), data, layout.n_esc,
                                   layout.chunk_size)
    if found != layout.n_esc:
        raise ValueError(f"the codebook leaves {found} escapes, the layout expects {layout.n_esc}")
    decoded = _whole_scratch(layout.n)
    try:
        _native.decode_payload(data[: layout.comp_bytes], bytes(codebook.dec_lut), decoded, layout.n_esc,
                               layout.chunk_size)
    except ValueError as e:
        raise _round_trip_mismatch(f"escape streams: {e}") from None
    if not np.array_equal(decoded, source):
        raise _round_trip_mismatch(f"element {int(np.flatnonzero(decoded != source)[0])}")


def _round_trip_mismatch(what: str) -> RoundTripMismatch:
    """The encoder's error when the payload it wrote does not decode to its source; ``what`` says where."""
    return RoundTripMismatch(f"SplitZip payload does not decode bit for bit to the source tensor ({what})")


_whole_scratches = threading.local()


def _whole_scratch(n: int) -> np.ndarray:
    """This thread's int16 buffer of :data:`WHOLE_ENCODE_ELEMENTS` that :func:`_encode_whole` decodes into (made
    once: fresh pages cost more than the decode into them)."""
    buffer = getattr(_whole_scratches, "buffer", None)
    if buffer is None or buffer.size < n:
        buffer = _whole_scratches.buffer = np.empty(max(n, WHOLE_ENCODE_ELEMENTS), dtype=np.int16)
    return buffer[:n]


def _small_exponents(bits: np.ndarray) -> np.ndarray:
    """The exponent byte of each BF16 element in ``bits`` (an int16 NumPy array) as uint8 (the cast keeps the low
    byte of ``bits >> 7``)."""
    return (bits >> 7).astype(np.uint8)


def _encode_small(bits: np.ndarray, codebook: Codebook, pk: np.ndarray, sm: np.ndarray) -> np.ndarray:
    """Encode the elements ``bits`` (int16) into the ``pk`` and ``sm`` streams (uint8) with a few NumPy calls, one
    element at a time; returns the ascending positions of the escapes (int64). An odd last element gets the
    high nibble of its ``pk`` byte, the low one is padding."""
    code = _exponent_codes(codebook.dec_lut, codebook.n_used)[_small_exponents(bits)]
    nibble = code & 0xF
    pair_code = nibble[0::2] << 4
    pair_code[: bits.size // 2] |= nibble[1::2]
    pk[:] = pair_code
    sm[:] = (bits & 0x7F) | ((bits >> 8) & 0x80)
    return np.flatnonzero(code == ESCAPE_CODE)


class _SliceScratch:
    """The temporaries of encoding and checking one slice of up to ``size`` pairs, allocated once per tensor: they
    stay in the L2 cache from one slice to the next."""

    def __init__(self, size: int):
        self.exponents = torch.empty(2 * size, dtype=torch.uint8)
        self.index = torch.empty(size, dtype=torch.int32)
        self.fields = torch.empty(2 * size, dtype=torch.int16)
        self.decoded = torch.empty(2 * size, dtype=torch.int16)
        self.differs = np.empty(2 * size, dtype=bool)
        self.positions = np.empty(2 * size if _native is not None else 0, dtype=np.int64)


def _encode_slices(bits: torch.Tensor, codebook: Codebook, pk: torch.Tensor, sm: torch.Tensor
                   ) -> tuple[np.ndarray, np.ndarray]:
    """Encode whole pairs ``bits`` (int16) into the ``pk`` and ``sm`` streams (uint8) in cache-sized slices, each
    decoded again and compared with its source while it is in cache. Returns the ascending positions (int64) of
    the elements that did not decode to their source, and what they decoded to (int16).

    Those are the escapes: an escape's nibble decodes to ``dec_lut[0]``, a code of the codebook and so never the
    escape's own exponent, while every other element decodes exactly unless the codec is wrong, which
    :func:`_check_escapes` tells apart. (So no escape flags are gathered: the check finds the escapes.)
    """
    n_pairs = pk.numel()
    if not n_pairs:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int16)
    exponent_table, lut = _pair_exponent_table(codebook.dec_lut), bytes(codebook.dec_lut)
    length = _slice_length(n_pairs)
    scratch = _SliceScratch(min(length, n_pairs))
    source = bits.numpy()
    positions, decoded_as = [], []
    slices = zip(bits.split(2 * length), pk.split(length), sm.view(torch.int8).split(2 * length))
    for first, (bits_slice, pk_slice, sm_slice) in zip(range(0, 2 * n_pairs, 2 * length), slices):
        m = pk_slice.numel()
        decoded = _scratch(scratch.decoded, 2 * m)
        _encode_pairs(bits_slice, codebook, pk_slice, sm_slice, scratch)
        _decode_pairs(pk_slice, sm_slice, lut, exponent_table, decoded)
        decoded = decoded.numpy()
        wrong = _mismatches(decoded, source[first: first + 2 * m], scratch)
        if wrong.size:
            positions.append(wrong + first)
            decoded_as.append(decoded[wrong])
    if not positions:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int16)
    position = np.concatenate(positions)
    _check_escapes(source, position, codebook)
    return position, np.concatenate(decoded_as)


def _mismatches(decoded: np.ndarray, source: np.ndarray, scratch: _SliceScratch) -> np.ndarray:
    """Where ``decoded`` and ``source`` (int16, one slice) differ, ascending: in C, 32 elements compared at once (the
    escapes are a per mille at most); else two NumPy passes."""
    if _native is not None:
        return scratch.positions[: _native.mismatches(decoded, source, scratch.positions)].copy()
    return np.flatnonzero(np.not_equal(decoded, source, out=scratch.differs[: decoded.size]))


def _encode_pairs(bits: torch.Tensor, codebook: Codebook, pk: torch.Tensor, sm: torch.Tensor,
                  scratch: _SliceScratch) -> None:
    """Encode one slice of whole pairs ``bits`` (int16) into its ``pk`` bytes (uint8) and ``sm`` bytes (int8): in
    C where it was built, else with a gather from the 65,536-entry pair table."""
    if _native is not None:
        _native.encode_pairs(bits.numpy(), _exponent_codes(codebook.dec_lut, codebook.n_used), pk.numpy(), sm.numpy())
        return
    pair_index = _exponent_pair_index(bits, scratch.exponents, scratch.index)
    torch.index_select(_pair_code_table(codebook.dec_lut, codebook.n_used), 0, pair_index, out=pk)
    # sm byte = sign << 7 | mantissa: keep sign and mantissa (in the index's memory, no longer needed); the
    # arithmetic shift copies the sign into bit 7; narrowing to a byte keeps the low one. (Ops whose output dtype
    # differs from their inputs' run slower than a separate narrowing copy.)
    kept = torch.bitwise_and(bits, _SIGN_AND_MANTISSA, out=pair_index.view(torch.int16))
    kept.bitwise_or_(torch.bitwise_right_shift(kept, 8, out=_scratch(scratch.fields, bits.numel())))
    sm.copy_(kept)


def _check_escapes(source: np.ndarray, position: np.ndarray, codebook: Codebook) -> None:
    """Every element that did not decode from its code must be an escape (its exponent outside the codebook):
    any other is a codec bug, told apart here from a layout that miscounts escapes."""
    code = _exponent_codes(codebook.dec_lut, codebook.n_used)[_small_exponents(source[position])]
    if (code != ESCAPE_CODE).any():
        raise _round_trip_mismatch(f"element {int(position[np.flatnonzero(code != ESCAPE_CODE)[0]])}")


def _check_stored(payload: torch.Tensor, layout: PayloadLayout, codebook: Codebook, source: np.ndarray,
                  checked: int, position: np.ndarray, unpatched: np.ndarray) -> None:
    """The rest of the round-trip check, on the finished payload: its escape streams pass the decoder's validation
    and list exactly ``position``; the escapes among the elements checked slice by slice (``[0, checked)``), which
    decoded to ``unpatched`` before their patch, come back to their source once patched; every element from
    ``checked`` on decodes to its source.

    Raises:
        RoundTripMismatch: any of it fails.
    """
    try:
        decoder = PayloadDecoder(payload, layout, codebook)
    except ValueError as e:
        raise _round_trip_mismatch(f"escape streams: {e}") from None
    if not np.array_equal(decoder.position, position):
        raise _round_trip_mismatch("the escape streams list other elements")
    patched = _with_exponents(unpatched, decoder.esc_val[: unpatched.size])
    if not np.array_equal(patched, source[position[: unpatched.size]]):
        raise _round_trip_mismatch("an escaped element")
    step = 2 * DECODE_SLICES * SLICE_PAIRS
    out = torch.empty(min(step, layout.n - checked), dtype=torch.bfloat16)
    for start in range(checked, layout.n, step):
        stop = min(start + step, layout.n)
        decoded = _scratch(out, stop - start)
        decoder.decode(start, stop, decoded)
        if not np.array_equal(decoded.view(torch.int16).numpy(), source[start:stop]):
            raise _round_trip_mismatch(f"elements {start} to {stop - 1}")


def encode(x: torch.Tensor, codebook: Codebook | None = None, *, buffer: ReusedBuffer | None = None
           ) -> tuple[torch.Tensor, PayloadLayout, Codebook]:
    """Encode a BF16 tensor to its SplitZip payload (uint8 tensor of ``layout.comp_bytes``).

    ``codebook`` defaults to ``calibrate(x)``; a given one may leave any number of escapes. With ``buffer`` the
    payload is written into it (valid until its next use) instead of new memory.
    """
    histogram = exponent_counts(x)
    if codebook is None:
        codebook = codebook_from_histogram(histogram)
    layout = payload_layout(histogram, codebook)
    payload = torch.empty(layout.comp_bytes, dtype=torch.uint8) if buffer is None else buffer.take(layout.comp_bytes)
    encode_into(x, codebook, layout, payload)
    return payload, layout, codebook


# ---------------------------------------------------------------------------------------------------------------
# Decoding
# ---------------------------------------------------------------------------------------------------------------


def _check_payload(payload: torch.Tensor, layout: PayloadLayout, needed: int | None = None) -> None:
    """Raise ValueError unless ``payload`` is flat contiguous uint8 of at least ``needed`` bytes (by default the
    layout's whole payload)."""
    needed = layout.comp_bytes if needed is None else needed
    if payload.dtype != torch.uint8 or payload.dim() != 1 or not payload.is_contiguous():
        raise ValueError(f"a payload is a flat contiguous uint8 tensor, got {payload.dtype} of shape "
                         f"{tuple(payload.shape)}")
    if payload.numel() < needed:
        raise ValueError(f"payload holds {payload.numel()} bytes, its layout needs {needed}")


def _check_out(out: torch.Tensor, count: int) -> None:
    if out.dtype != torch.bfloat16 or out.numel() != count or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous bfloat16 tensor of {count} elements")


def _escape_streams(data: np.ndarray, layout: PayloadLayout, base: int = 0
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """NumPy views of the escape streams of a payload: chunk_id (<i4), local_pos (<u2), esc_val (u1). ``data`` holds
    the payload's bytes from its byte ``base`` on (the whole payload, or the bytes after its ``sm`` stream).

    Explicit little-endian dtypes, and NumPy reads unaligned views, so any payload offset on any host works.
    """
    n_esc = layout.n_esc
    chunk_id = data[layout.off_cid - base: layout.off_lpos - base].view(_LE_INT32)
    local_pos = data[layout.off_lpos - base: layout.off_lpos - base + 2 * n_esc].view(_LE_UINT16)
    esc_val = data[layout.off_ev - base: layout.off_ev - base + n_esc]
    return chunk_id, local_pos, esc_val


def _validated_escapes(data: np.ndarray, layout: PayloadLayout, base: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Escape positions (int64, ascending) and raw exponents (uint8), after checking the streams (``data``: the
    payload's bytes from its byte ``base`` on, as :func:`_escape_streams` reads them).

    The checks run in a fixed order (local position, chunk id, position, order), so a stream that breaks several
    rules always gets the same message.
    """
    if layout.n_esc == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.uint8)
    chunk_id, local_pos, esc_val = _escape_streams(data, layout, base)
    if local_pos.max() >= layout.chunk_size:
        raise ValueError(f"escape local position {local_pos.max()} is outside its chunk of {layout.chunk_size}")
    if chunk_id.min() < 0 or chunk_id.max() >= layout.n_chunks:
        raise ValueError(f"escape chunk id out of range 0..{layout.n_chunks - 1}")
    position = chunk_id.astype(np.int64) * layout.chunk_size + local_pos
    if position.max() >= layout.n:
        raise ValueError(f"escape position {position.max()} is past the tensor's {layout.n} elements")
    if not (position[1:] > position[:-1]).all():
        raise ValueError("escape positions are not strictly ascending")
    return position, esc_val


def escape_positions(payload: torch.Tensor, layout: PayloadLayout) -> torch.Tensor:
    """Global element index (int64) of each escape, validated: in range and strictly ascending.

    Raises:
        ValueError: the escape stream is inconsistent; callers wrap it with the file and tensor name.
    """
    return torch.from_numpy(_validated_escapes(payload.cpu().numpy(), layout)[0])


@functools.lru_cache(maxsize=4096)
def _pair_exponent_table(dec_lut: tuple[int, ...]) -> torch.Tensor:
    """``table[pk byte]`` = both exponent fields of the pair, in place in its int32 word (int32, 256 entries).

    1 KiB each; the cache holds one per codebook of a large checkpoint (most tensors have their own codebook)."""
    exponent = np.array(dec_lut, dtype=np.int32)
    first = (exponent << 7)[:, None]  # high nibble -> element 2i, the low half of the word
    second = (exponent << 23)[None, :]  # low nibble -> element 2i+1, the high half
    return torch.from_numpy((first | second).reshape(-1))


_thread_scratch = threading.local()


def _decode_scratch(size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's index (int32) and sign+mantissa (int16) buffers for slices of up to ``size`` pairs.

    Kept between calls (at most 1.5 slices of :data:`DECODE_SLICES` x :data:`SLICE_PAIRS` pairs, 6 MiB), so
    decoding a tensor range by range allocates nothing per range: buffers this large are fresh pages from ``mmap``
    each time, and their page faults cost as much as the decode that uses them.
    """
    index = getattr(_thread_scratch, "index", None)
    if index is None or index.numel() < size:
        _thread_scratch.index = index = torch.empty(size, dtype=torch.int32)
        _thread_scratch.fields = torch.empty(2 * size, dtype=torch.int16)
    return index, _thread_scratch.fields


def _decode_pairs(pk: torch.Tensor, sm: torch.Tensor, dec_lut: bytes, table: torch.Tensor, bits: torch.Tensor
                  ) -> None:
    """Decode whole pairs into ``bits`` (int16, ``2 * len(pk)``) from their ``pk`` bytes and ``sm`` bytes (int8).

    In C where it was built: one call over the range. In PyTorch, per slice: one gather of both exponent fields of
    each pair into its int32 word (``table``), then the sign and mantissa fields OR-ed in from the ``sm`` bytes
    widened to int16, which copies each sign into bit 15 (and into the exponent bits, which the mask clears).
    """
    if _native is not None:
        _native.decode_pairs(pk.numpy(), sm.numpy(), dec_lut, bits.detach().numpy())
        return
    n_pairs = pk.numel()
    length = _slice_length(n_pairs, DECODE_SLICES * SLICE_PAIRS)
    index, fields = _decode_scratch(min(length, n_pairs))
    aligned = bits.storage_offset() % 2 == 0  # else `out` starts at an odd element: decode to scratch, then copy
    words = bits.view(torch.int32) if aligned else torch.empty(n_pairs, dtype=torch.int32)
    slices = ((pk, sm, words),) if n_pairs <= length else zip(pk.split(length), sm.split(2 * length),
                                                               words.split(length))
    for pk_slice, sm_slice, words_slice in slices:
        m = pk_slice.numel()
        _decode_slice(pk_slice, sm_slice, table, words_slice, _scratch(index, m), _scratch(fields, 2 * m))
    if not aligned:
        bits.copy_(words.view(torch.int16))


def _decode_slice(pk: torch.Tensor, sm: torch.Tensor, table: torch.Tensor, words: torch.Tensor, index: torch.Tensor,
                  fields: torch.Tensor) -> None:
    """Decode one slice of pairs into ``words`` (int32, one per pair) from their ``pk`` bytes and ``sm`` bytes
    (int8), escapes aside; ``index`` (int32, one per pair) and ``fields`` (int16, one per element) are scratch."""
    torch.index_select(table, 0, index.copy_(pk), out=words)
    words.bitwise_or_(fields.copy_(sm).bitwise_and_(_SIGN_AND_MANTISSA).view(torch.int32))


def _decode_one(pk_byte: int, s: int, dec_lut: tuple[int, ...], i: int) -> int:
    """Element ``i`` (escapes aside) from its ``pk`` byte and ``sm`` byte, as an int16 value: for the odd element at
    either end of a range."""
    exponent = dec_lut[pk_byte & 0xF if i % 2 else pk_byte >> 4]
    bits = ((s & 0x80) << 8) | (exponent << 7) | (s & 0x7F)
    return bits - 0x10000 if bits & 0x8000 else bits


def native_kernels() -> bool:
    """Whether this process decodes with the C kernels (``cpu_kernel.KERNEL`` names them), so a whole payload is one
    call: callers that can hand one over choose so."""
    return _native is not None


@contextmanager
def one_intra_op_thread() -> Iterator[None]:
    """Run PyTorch's CPU ops of the calling thread on one intra-op thread, and restore the setting after.

    The codec's ops are short and many; with intra-op threads each of them forks and joins a team, and when another
    process holds a core every join waits for a descheduled thread (decoding fell from 1 GB/s to 11 MB/s with two
    busy processes on 2 cores). One thread per op never waits; parallelism, where wanted, comes from independent
    threads each running whole ranges (``szformat.loading.host_decode``).

    ``torch.set_num_threads`` is process-wide with some backends and per thread with OpenMP (new threads start from
    the last value set). So a thread already at one thread changes nothing, and a thread that changes it puts back
    its own value: nested uses, and threads that enter while another is inside, never leave the setting at one.
    """
    threads = torch.get_num_threads()
    if threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


Buffer = Union[memoryview, np.ndarray]
"""Bytes a C call reads: a NumPy array, or a memoryview (of a file's mapping, say)."""

Streams = Tuple[Union[torch.Tensor, Buffer], Union[torch.Tensor, Buffer]]
"""A range's ``pk`` and ``sm`` bytes: uint8 tensors, or buffers (the C kernels only)."""


class RangeChecksums(NamedTuple):
    """CRC-32s of what decoding one range of elements read and wrote: its ``pk`` bytes, its ``sm`` bytes, and the
    decoded (raw) bytes. :meth:`PayloadDecoder.stored_crc` joins those of consecutive ranges into the CRC-32 of the
    whole payload, so the stored bytes are checked while each range is in cache, not in a pass of their own. A named
    tuple: one is made per range decoded, and the class costs a tenth of a frozen dataclass's to import."""

    pk: int
    sm: int
    raw: int


class PayloadDecoder:
    """A SplitZip payload whose escape streams are validated once, decoded range by range, from any thread.

    Args:
        payload (`torch.Tensor`): a flat contiguous uint8 CPU tensor of at least ``layout.comp_bytes`` (a zero-copy
            view of an mmap is fine).
        layout (`PayloadLayout`), codebook (`Codebook`): the tensor's layout and codebook.

    Raises:
        ValueError: a short payload or an inconsistent escape stream.
    """

    def __init__(self, payload: torch.Tensor, layout: PayloadLayout, codebook: Codebook):
        _check_payload(payload, layout)
        data = payload.numpy()
        self._take(payload, data[layout.off_pk + layout.n_pairs: layout.off_sm], data[layout.off_sm + layout.n:],
                   layout, codebook)

    @classmethod
    def around_streams(cls, around: torch.Tensor, layout: PayloadLayout, codebook: Codebook) -> PayloadDecoder:
        """A decoder given only the bytes of a payload around its ``pk`` and ``sm`` streams, for a caller that hands
        every call its range's streams (views of a file's mapping, a thread's scratch): ``around`` (flat uint8) holds
        the padding between the two streams, then every stored byte after ``sm`` (the escape streams). A load then
        holds a few kilobytes per tensor besides its outputs instead of a buffer of the stored size, whose allocation
        and release moved glibc's heap thresholds so that loads repeated in one process faulted their outputs in
        anew (``bench/RESULTS.md``, "CPU loading").

        Raises:
            ValueError: ``around`` is too short for the layout's escape streams, or they break a rule.
        """
        gap = layout.off_sm - layout.off_pk - layout.n_pairs
        _check_payload(around, layout, needed=layout.comp_bytes - layout.n_pairs - layout.n)  # all but the streams
        data = around.numpy()
        decoder = cls.__new__(cls)
        decoder._take(None, data[:gap], data[gap:], layout, codebook)
        return decoder

    def _take(self, payload: torch.Tensor | None, gap: np.ndarray, tail: np.ndarray, layout: PayloadLayout,
              codebook: Codebook) -> None:
        """Keep the payload (``None``: its streams come with every call), the bytes between its streams and after
        them, and the escapes validated from the latter."""
        self.payload, self.layout, self.codebook = payload, layout, codebook
        self._gap, self._tail = gap, tail
        self.position, self.esc_val = _validated_escapes(tail, layout, base=layout.off_sm + layout.n)
        self.table = _pair_exponent_table(codebook.dec_lut)
        self.lut = bytes(codebook.dec_lut)

    def streams(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``pk`` bytes (of pairs ``start // 2`` to ``(stop + 1) // 2``) and ``sm`` bytes that decoding elements
        ``[start, stop)`` reads, as views of the payload."""
        if self.payload is None:
            raise ValueError("this decoder holds only the bytes around the streams: each call is given its streams")
        layout = self.layout
        return (self.payload[layout.off_pk + start // 2: layout.off_pk + (stop + 1) // 2],
                self.payload[layout.off_sm + start: layout.off_sm + stop])

    def decode(self, start: int, stop: int, out: torch.Tensor, *, streams: Streams | None = None) -> None:
        """Decode elements ``[start, stop)`` into ``out``, a contiguous bfloat16 tensor of ``stop - start``.

        ``streams``: the range's ``pk`` and ``sm`` bytes (uint8 tensors or byte buffers, as :meth:`streams` cuts
        them) where the caller has them elsewhere than in the payload: read into a cache-sized buffer just before,
        or views of the file's mapping, read only by the C kernels' guarded call (:meth:`decode_range`), which a
        range starting at an even element takes wherever they are built. Escapes still come from the payload's
        escape streams.

        Raises:
            EOFError: a page of mapped streams could not be read (:meth:`decode_range`).
        """
        if _native is not None and start % 2 == 0:
            self.decode_range(start, stop, out, self._stream_buffers(start, stop, streams), checksums=False)
            return
        self._check_range(start, stop, out)
        pk, sm = self.streams(start, stop) if streams is None else streams
        if pk.numel() != (stop + 1) // 2 - start // 2 or sm.numel() != stop - start:
            raise ValueError(f"streams of {pk.numel()} pk and {sm.numel()} sm bytes do not cover [{start}, {stop})")
        lut, base = self.codebook.dec_lut, start // 2
        bits = out.view(-1).view(torch.int16)
        first, last = start + start % 2, stop - stop % 2  # the whole pairs inside the range
        with one_intra_op_thread():
            if start % 2 and start < stop:
                bits[0] = _decode_one(int(pk[0]), int(sm[0]), lut, start)
            if stop % 2 and stop - 1 >= start:
                bits[stop - 1 - start] = _decode_one(int(pk[-1]), int(sm[-1]), lut, stop - 1)
            if first < last:
                _decode_pairs(pk[first // 2 - base: last // 2 - base], sm[first - start: last - start].view(torch.int8),
                              self.lut, self.table,
                              bits if (first, last) == (start, stop) else bits[first - start: last - start])
        _patch_escapes(self.position, self.esc_val, start, stop, bits)

    def _stream_buffers(self, start: int, stop: int, streams: Streams | None) -> tuple[Buffer, Buffer]:
        """The ``pk`` and ``sm`` bytes of ``[start, stop)`` as buffers for a C call."""
        if streams is None:
            streams = self.streams(start, stop)
        return tuple(s.numpy() if isinstance(s, torch.Tensor) else s for s in streams)

    def _check_range(self, start: int, stop: int, out: torch.Tensor) -> None:
        """Raise ValueError unless ``[start, stop)`` lies in the tensor and ``out`` can hold it."""
        if not 0 <= start <= stop <= self.layout.n:
            raise ValueError(f"element range [{start}, {stop}) is outside 0..{self.layout.n}")
        _check_out(out, stop - start)

    def decode_columns(self, rows: tuple[int, int], width: int, cols: tuple[int, int], out: torch.Tensor, *,
                       streams: Streams | None = None) -> None:
        """Decode columns ``cols`` of rows ``rows`` of the elements seen as rows of ``width`` into ``out``, a
        contiguous bfloat16 tensor of ``rows x cols`` elements: a row-parallel shard of a matrix, without decoding
        the other columns. ``width`` and both column bounds are even, so every row's piece is whole pairs.

        ``streams``: the rows' ``pk`` and ``sm`` bytes where the caller has them elsewhere than in the payload
        (views of the file's mapping, read only by the C kernels' guarded call: :meth:`decode_range` says why).

        Raises:
            EOFError: a page of mapped streams could not be read.
        """
        (first_row, last_row), (first, last) = rows, cols
        if width % 2 or first % 2 or last % 2 or not 0 <= first <= last <= width:
            raise ValueError(f"columns [{first}, {last}) of rows of {width} need even bounds inside the row")
        if not 0 <= first_row <= last_row or last_row * width > self.layout.n:
            raise ValueError(f"rows [{first_row}, {last_row}) of {width} elements are outside 0..{self.layout.n}")
        _check_out(out, (last_row - first_row) * (last - first))
        if out.numel() == 0:
            return
        start, stop = first_row * width, last_row * width
        lo, hi = np.searchsorted(self.position, (start, stop))
        position, esc_val = self.position[lo:hi] - start, self.esc_val[lo:hi]
        bits = out.view(-1).view(torch.int16)
        if _native is not None:
            pk, sm = self._stream_buffers(start, stop, streams)
            _native.decode_columns(pk, sm, self.lut, bits.numpy(), position, esc_val, width, first, last)
            return
        if streams is not None:
            raise ValueError("streams outside the payload are decoded by the C kernels only")
        n_rows = last_row - first_row
        pk, sm = self.streams(start, stop)
        pk, sm = pk.view(n_rows, width // 2), sm.view(n_rows, width)
        with one_intra_op_thread():
            _decode_pairs(pk[:, first // 2: last // 2].contiguous().view(-1),
                          sm[:, first:last].contiguous().view(-1).view(torch.int8), self.lut, self.table, bits)
        column = position % width
        kept = (column >= first) & (column < last)
        index = (position[kept] // width) * (last - first) + column[kept] - first
        values = bits.detach().numpy()
        values[index] = _with_exponents(values[index], esc_val[kept])

    def decode_checked(self, start: int, stop: int, out: torch.Tensor, *,
                       streams: Streams | None = None) -> RangeChecksums:
        """:meth:`decode`, and the CRC-32s of the stored bytes it reads and of the bytes it writes.

        The stored bytes are checksummed just before they are decoded and the decoded ones just after, while each
        is in cache: with the C kernels, by one call that does so for every block of 8,192 pairs while it is in the
        L1 cache (zlib-ng's CRC-32 called from C); a range of 4 MiB checksummed after its decode has left the L2
        cache, which cost a load as much as the decode. ``start`` is even, so consecutive ranges read consecutive
        ``pk`` bytes. Streams that are views of a file's mapping are read by that call only (the C kernels with
        their CRC-32 function).

        Raises:
            EOFError: a page of mapped streams could not be read (:meth:`decode_range`).
        """
        if start % 2:
            raise ValueError(f"a checked range starts at an even element, not {start}")
        if _native is not None and cpu_kernel.checksums_in_kernel():
            return self.decode_range(start, stop, out, self._stream_buffers(start, stop, streams), checksums=True)
        pk, sm = self.streams(start, stop) if streams is None else streams
        pk_crc, sm_crc = crc32(pk.numpy()), crc32(sm.numpy())
        self.decode(start, stop, out, streams=(pk, sm))
        return RangeChecksums(pk_crc, sm_crc, crc32(out.view(torch.uint8).numpy()))

    def decode_range(self, start: int, stop: int, out: torch.Tensor, streams: tuple[Buffer, Buffer], *,
                     checksums: bool) -> RangeChecksums | None:
        """Decode elements ``[start, stop)`` (``start`` even) from ``streams``, their ``pk`` and ``sm`` bytes, by
        one C call (the C kernels only), with the CRC-32s of :meth:`decode_checked` when ``checksums``.

        The streams may be views of a file's mapping (:meth:`SztFile.mapped`): the call catches the fault of a page
        the file no longer holds, where reading it anywhere else would end the process with SIGBUS.

        Raises:
            EOFError: a page of the streams could not be read (the mapped file was truncated, or its disk failed).
        """
        if _native is None or (checksums and not cpu_kernel.checksums_in_kernel()):
            raise RuntimeError("decode_range needs the C kernels (and their CRC-32 function for checksums)")
        if start % 2:
            raise ValueError(f"a range decoded by one call starts at an even element, not {start}")
        self._check_range(start, stop, out)
        lo, hi = np.searchsorted(self.position, (start, stop))
        sums = _native.decode_range(streams[0], streams[1], self.lut, out.view(torch.int16).numpy(),
                                    self.position[lo:hi] - start, self.esc_val[lo:hi], checksums)
        return RangeChecksums(*sums) if checksums else None

    def stored_crc(self, ranges: Sequence[tuple[int, int, RangeChecksums]]) -> int:
        """The CRC-32 of the whole payload from the checksums of ranges ``(start, stop, checksums)`` that cover
        ``[0, n)`` in order, and the bytes between and after the streams (padding, escape streams)."""
        layout = self.layout
        cursor = 0
        for start, stop, _ in ranges:
            if start != cursor:
                raise ValueError(f"checked ranges leave a gap or overlap at element {cursor}")
            cursor = stop
        if cursor != layout.n:
            raise ValueError(f"checked ranges cover {cursor} of {layout.n} elements")
        crc = crc32_join((c.pk, (stop + 1) // 2 - start // 2) for start, stop, c in ranges)
        crc = crc32(self._gap, crc)
        crc = crc32_combine(crc, crc32_join((c.sm, stop - start) for start, stop, c in ranges), layout.n)
        return crc32(self._tail, crc)


def decode_payloads(payloads: Sequence[tuple[Buffer, PayloadLayout, Codebook, torch.Tensor]], *, checksums: bool,
                    populate: int = 0, threads: int = 1, release: bool = False) -> list[tuple[int, int, str | None]]:
    """Whole payloads ``(payload, layout, codebook, out)`` decoded by one C call (the C kernels only) on up to
    ``threads`` threads of its own, with no Python between them: what a checkpoint of many small tensors otherwise
    spends more on than on their decode, and a large tensor's ranges shared by every thread. Per payload ``(stored_crc,
    decoded_crc, error)``: the CRC-32s of its bytes and of its output (0 where ``checksums`` is false), and ``None``, or
    the message refusing its escape streams (its ``out`` then left unwritten, its decoded CRC-32 0). Outputs of at least
    ``populate`` bytes (0: none) whose pages are new are faulted in first, each by one call; with ``release``, payloads
    that are views of a file's read-only mapping only, the pages read are dropped from the page tables as they are
    decoded (``cpu_kernel.decode_payloads``).

    The payloads may be views of a file's mapping (:meth:`SztFile.mapped`): the call catches the fault of a page
    the file no longer holds.

    Raises:
        EOFError: a page of a payload could not be read; its ``item`` attribute says which payload.
    """
    if _native is None or (checksums and not cpu_kernel.checksums_in_kernel()):
        raise RuntimeError("decode_payloads needs the C kernels (and their CRC-32 function for checksums)")
    for _, layout, _, out in payloads:
        _check_out(out, layout.n)
    return cpu_kernel.decode_payloads(_native, [(payload, layout, codebook, out.view(torch.int16).numpy())
                                                for payload, layout, codebook, out in payloads],
                                      checksums=checksums, populate=populate, threads=threads, release=release)


def guarded_crc32(data: Buffer, crc: int = 0) -> int:
    """The CRC-32 of ``data`` continuing ``crc``, by the C kernels' guarded call (zlib-ng's function): ``data`` may
    be a view of a file's mapping (``SztFile.mapped``), and a page the file no longer holds is an EOFError, not
    SIGBUS. Where the kernels have it (``cpu_kernel.checksums_in_kernel()``).

    Raises:
        EOFError: a page of ``data`` could not be read.
    """
    if _native is None or not cpu_kernel.checksums_in_kernel():
        raise RuntimeError("guarded_crc32 needs the C kernels and their CRC-32 function")
    return _native.crc32(data, crc)


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
    ``out``, when given, is a contiguous bfloat16 tensor of ``stop - start`` elements written in place. Runs on the
    calling thread, with one PyTorch intra-op thread (:func:`one_intra_op_thread`); to use several cores, decode
    ranges of a :class:`PayloadDecoder` from several threads.

    Raises:
        ValueError: a bad range, a short payload, a wrong ``out`` or an inconsistent escape stream; nothing has been
            written to ``out`` then.
    """
    stop = layout.n if stop is None else stop
    if not 0 <= start <= stop <= layout.n:  # before allocating ``out`` (the decoder checks ``out`` and the payload)
        raise ValueError(f"element range [{start}, {stop}) is outside 0..{layout.n}")
    if _native is not None and (start, stop) == (0, layout.n):
        _check_payload(payload, layout)
        out = torch.empty(layout.n, dtype=torch.bfloat16) if out is None else out
        _check_out(out, layout.n)
        _native.decode_payload(payload.numpy(), bytes(codebook.dec_lut), out.detach().view(torch.int16).numpy(),
                               layout.n_esc, layout.chunk_size)
        return out
    decoder = PayloadDecoder(payload, layout, codebook)
    out = torch.empty(stop - start, dtype=torch.bfloat16) if out is None else out
    decoder.decode(start, stop, out)
    return out


def decode_with_crc(payload: torch.Tensor, layout: PayloadLayout, codebook: Codebook, out: torch.Tensor) -> int:
    """:func:`decode` of a whole payload into ``out``, and the CRC-32 of the decoded bytes: taken block by block as
    they are written where the C kernels checksum (:meth:`PayloadDecoder.decode_checked`), else by a pass after."""
    if _native is not None and cpu_kernel.checksums_in_kernel():
        return PayloadDecoder(payload, layout, codebook).decode_checked(0, layout.n, out).raw
    decode(payload, layout, codebook, out=out)
    return crc32(out.view(torch.uint8).numpy())


def _patch_escapes(position: np.ndarray, esc_val: np.ndarray, start: int, stop: int, bits: torch.Tensor) -> None:
    """Give the escaped elements among ``[start, stop)`` their raw exponent; sign and mantissa are already right."""
    if not position.size:
        return
    if start or stop <= position[-1]:
        lo, hi = np.searchsorted(position, (start, stop))
        position, esc_val = position[lo:hi] - start, esc_val[lo:hi]
    values = bits.detach().numpy()
    values[position] = _with_exponents(values[position], esc_val)


def _with_exponents(values: np.ndarray, esc_val: np.ndarray) -> np.ndarray:
    """Decoded elements ``values`` (int16) with their exponent fields replaced by ``esc_val`` (uint8): what escaped
    elements decode to."""
    return (values & np.int16(_SIGN_AND_MANTISSA)) | (esc_val.astype(np.int16) << 7)
