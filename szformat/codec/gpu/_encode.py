"""SplitZip encode on the GPU, byte for byte the payload of :func:`..cpu.encode`.

Four steps, all on one stream:

1. histogram: a persistent kernel counts the 256 exponent bytes, tile by tile in a narrow window below each tile's
   largest exponent (all 256 values only where a tile spills out of it), then adds its counts to a global int64
   histogram;
2. calibration: one program picks the Top-16 with the reference's tie rule (most frequent first, then smaller
   exponent) by ranking ``count * 256 + (255 - exponent)``, and writes the encode table and ``n_esc``. The host
   reads these 19 numbers back: this is the one synchronisation, needed to size the payload;
3. pack: one program per tile of 2048 elements writes ``pk`` and ``sm`` and adds up the escapes of each
   1024-element chunk (program 0 also zeroes the alignment gaps, as the reference leaves them);
4. escapes: after an exclusive prefix sum of the chunk counts, only chunks that hold escapes are read again, and
   each writes its escapes (chunk id, local position, exponent) at its offset, in ascending element order.
"""

from __future__ import annotations

import torch

from ..codebook import Codebook
from ..layout import CHUNK_SIZE, ESCAPE_CODE, PayloadLayout
from ._common import check_device, interpreting, on_stream, program_slots, tl, triton

__all__ = ["encode", "encode_to_host"]

PACK_ROWS = 256
"""Rows of four element pairs per pack program: 2048 elements, two chunks (a multiple of 128 rows)."""
PACK_WARPS = 4
HISTOGRAM_ROWS = 512
"""Rows of four element pairs per step of a histogram program."""
HISTOGRAM_WINDOW = 32
"""Bins of the first count of each tile: the 30 exponents at and below its largest, zeros, and the rest."""
HISTOGRAM_PROGRAMS_PER_SM = 8

_ESCAPE = tl.constexpr(ESCAPE_CODE)


@triton.jit
def _load_pairs(x_ptr, n, first, ROWS: tl.constexpr, MASKED: tl.constexpr):
    """Element pairs ``[first, first + 4 * ROWS)`` as int32 words (first element in the low half); elements past
    ``n`` read as 0 on the masked path."""
    pair = first + (tl.arange(0, ROWS)[:, None] * 4 + tl.arange(0, 4)[None, :])
    x32 = x_ptr.to(tl.pointer_type(tl.int32))
    if MASKED:
        n_full = n // 2
        words = tl.load(x32 + pair, mask=pair < n_full, other=0)
        if n % 2 == 1:  # the last element has no partner: read it alone, never the 2 bytes past the tensor
            last = tl.load(x_ptr + n - 1).to(tl.int32) & 0xFFFF
            words = tl.where(pair == n_full, last, words)
    else:
        words = tl.load(x32 + pair)
    return pair, words


@triton.jit
def _window_bin(exponent, top, WINDOW: tl.constexpr):
    """Bin of ``exponent`` in a tile's window: ``top - exponent`` for the ``WINDOW - 2`` exponents at and below the
    tile's largest, ``WINDOW - 2`` for exponent 0 (zeros and subnormals), ``WINDOW - 1`` for anything else."""
    below = top - exponent
    return tl.where(exponent == 0, WINDOW - 2, tl.where(below < WINDOW - 2, below, WINDOW - 1))


@triton.jit
def _tile_histogram(words, ROWS: tl.constexpr, WINDOW: tl.constexpr):
    """Counts of the 256 exponent values over both elements of every word of a tile.

    ``tl.histogram`` costs more the more bins it has (Triton 3.6 counts each bin with warp votes), and a tile of
    weights spans a few dozen exponents, so the tile is counted in ``WINDOW`` bins below its largest exponent
    first; only a tile with an exponent outside that window (rare) is counted again over all 256 bins.
    """
    TILE: tl.constexpr = ROWS * 4
    first = tl.reshape((words >> 7) & 0xFF, [TILE])
    second = tl.reshape((words >> 23) & 0xFF, [TILE])
    top = tl.maximum(tl.max(first, axis=0), tl.max(second, axis=0))
    window = tl.histogram(_window_bin(first, top, WINDOW), WINDOW) + \
        tl.histogram(_window_bin(second, top, WINDOW), WINDOW)
    exponent = tl.arange(0, 256)
    below = top - exponent
    kept = (below >= 0) & (below < WINDOW - 2)
    counts = tl.where(kept, tl.gather(window, tl.where(kept, below, 0), 0), 0)
    slot = tl.arange(0, WINDOW)
    counts += tl.where(exponent == 0, tl.sum(tl.where(slot == WINDOW - 2, window, 0), axis=0), 0)
    outside = tl.sum(tl.where(slot == WINDOW - 1, window, 0), axis=0)
    if outside > 0:
        out_first = _window_bin(first, top, WINDOW) == WINDOW - 1
        out_second = _window_bin(second, top, WINDOW) == WINDOW - 1
        counts += tl.histogram(tl.where(out_first, first, 0), 256) + tl.histogram(tl.where(out_second, second, 0), 256)
        counts -= tl.where(exponent == 0, 2 * TILE - outside, 0)  # the elements counted already went to bin 0
    return counts


@triton.jit(do_not_specialize=["n"])
def _histogram_kernel(x_ptr, hist_ptr, n, ROWS: tl.constexpr, WINDOW: tl.constexpr):
    PAIRS: tl.constexpr = ROWS * 4
    n = tl.cast(n, tl.int64)
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    full_tiles = (n // (2 * PAIRS)).to(tl.int32)
    counts = tl.zeros([256], dtype=tl.int32)
    tile = pid
    while tile < full_tiles:  # not ``range(pid, full_tiles, programs)``: Triton 3.6's interpreter cannot index with
        # the program id under NumPy >= 2.3; on the H200 both loops take 0.655 ms for 512 MiB (bench/RESULTS.md)
        _, words = _load_pairs(x_ptr, n, tl.cast(tile, tl.int64) * PAIRS, ROWS, False)
        counts += _tile_histogram(words, ROWS, WINDOW)
        tile += programs
    tail = full_tiles.to(tl.int64) * PAIRS  # first pair of the partial tile, if any
    owns_tail = (pid == programs - 1) & (2 * tail < n)
    if owns_tail:
        _, words = _load_pairs(x_ptr, n, tail, ROWS, True)
        counts += _tile_histogram(words, ROWS, WINDOW)
    exponent = tl.arange(0, 256)
    padding = 2 * (tail + PAIRS) - n  # elements past n in the partial tile: read as 0, counted as exponent 0
    histogram = counts.to(tl.int64) - tl.where((exponent == 0) & owns_tail, padding, 0)
    tl.atomic_add(hist_ptr + exponent, histogram, sem="relaxed")


@triton.jit(do_not_specialize=["n"])
def _calibrate_kernel(hist_ptr, n, info_ptr, enc_ptr):
    """Top-16 of the histogram: ``info = [n_used, covered, n_esc, dec_lut[0..15]]``, ``enc[exponent] -> code``."""
    n = tl.cast(n, tl.int64)
    exponent = tl.arange(0, 256)
    count = tl.load(hist_ptr + exponent)
    rank_key = tl.where(count > 0, count * 256 + (255 - exponent), -1)  # unique: ties go to the smaller exponent
    enc = tl.full([256], _ESCAPE, dtype=tl.int32)
    covered = tl.full([], 0, dtype=tl.int64)
    n_used = tl.full([], 0, dtype=tl.int64)
    for code in tl.static_range(16):
        best = tl.max(rank_key, axis=0)
        used = best >= 0
        chosen = 255 - (best & 255)
        hit = (exponent == chosen) & used
        enc = tl.where(hit, code, enc)
        covered += tl.sum(tl.where(hit, count, 0), axis=0)
        n_used += used.to(tl.int64)
        tl.store(info_ptr + 3 + code, tl.where(used, chosen, 0))
        rank_key = tl.where(hit, -1, rank_key)
    tl.store(info_ptr, n_used)
    tl.store(info_ptr + 1, covered)
    tl.store(info_ptr + 2, n - covered)
    tl.store(enc_ptr + exponent, enc)


@triton.jit
def _zero_gap(pay_ptr, start, end):
    """Zero the alignment padding ``[start, end)`` (under 4 bytes), as the reference payload has it."""
    offset = start + tl.arange(0, 4)
    tl.store(pay_ptr + offset, tl.zeros([4], dtype=tl.uint8), mask=offset < end)


@triton.jit
def _pack_tile(x_ptr, pay_ptr, enc, counts_ptr, n, off_sm, tile, ROWS: tl.constexpr, MASKED: tl.constexpr):
    """``pk`` and ``sm`` of one tile, and its number of escapes per 1024-element chunk."""
    pair, words = _load_pairs(x_ptr, n, tile * ROWS * 4, ROWS, MASKED)
    code0 = tl.reshape(tl.gather(enc, tl.reshape((words >> 7) & 0xFF, [ROWS * 4]), 0), [ROWS, 4])
    code1 = tl.reshape(tl.gather(enc, tl.reshape((words >> 23) & 0xFF, [ROWS * 4]), 0), [ROWS, 4])
    packed = ((code0 & 15) << 4) | (code1 & 15)
    sm = (words & 0x7F) | ((words >> 8) & 0x7F80) | ((words >> 16) & 0x8000)  # sign0 mantissa1 in one shift
    escaped0 = code0 == _ESCAPE
    escaped1 = code1 == _ESCAPE
    sm16 = (pay_ptr + off_sm).to(tl.pointer_type(tl.int16))
    if MASKED:
        has_first = 2 * pair < n
        has_second = 2 * pair + 1 < n
        escaped0 = escaped0 & has_first
        escaped1 = escaped1 & has_second
        packed = tl.where(has_second, packed, packed & 0xF0)  # odd n: the last low nibble is padding
        tl.store(pay_ptr + pair, packed.to(tl.uint8), mask=has_first)
        tl.store(sm16 + pair, sm.to(tl.int16), mask=has_second)
        tl.store(pay_ptr + off_sm + 2 * pair, sm.to(tl.uint8), mask=has_first & ~has_second)
    else:
        tl.store(pay_ptr + pair, packed.to(tl.uint8))
        tl.store(sm16 + pair, sm.to(tl.int16))
    # Escapes are rare: rows holding one add to their chunk's count (zeroed beforehand), the others do nothing.
    per_row = tl.sum(escaped0.to(tl.int32) + escaped1.to(tl.int32), axis=1)
    chunk = tile * (ROWS // 128) + tl.arange(0, ROWS) // 128  # 1024 elements = 128 rows of 4 pairs
    tl.atomic_add(counts_ptr + chunk, per_row, mask=per_row > 0, sem="relaxed")


@triton.jit(do_not_specialize=["n", "n_esc"])
def _pack_kernel(x_ptr, pay_ptr, enc_ptr, counts_ptr, n, n_esc, off_sm, ROWS: tl.constexpr):
    n = tl.cast(n, tl.int64)
    n_esc = tl.cast(n_esc, tl.int64)
    off_sm = tl.cast(off_sm, tl.int64) // 4 * 4  # a no-op that tells the compiler sm starts on a word
    tile = tl.program_id(0).to(tl.int64)
    enc = tl.load(enc_ptr + tl.arange(0, 256))
    if (tile + 1) * ROWS * 8 <= n:
        _pack_tile(x_ptr, pay_ptr, enc, counts_ptr, n, off_sm, tile, ROWS, False)
    else:
        _pack_tile(x_ptr, pay_ptr, enc, counts_ptr, n, off_sm, tile, ROWS, True)
    if tile == 0:
        off_cid = (off_sm + n + 3) // 4 * 4
        off_lpos_end = off_cid + 6 * n_esc
        _zero_gap(pay_ptr, (n + 1) // 2, off_sm)
        _zero_gap(pay_ptr, off_sm + n, off_cid)
        _zero_gap(pay_ptr, off_lpos_end, (off_lpos_end + 3) // 4 * 4)


@triton.jit(do_not_specialize=["n", "n_esc", "off_cid"])
def _escape_write_kernel(x_ptr, pay_ptr, enc_ptr, counts_ptr, starts_ptr, n, n_esc, off_cid, CHUNKS: tl.constexpr,
                         CHUNK: tl.constexpr):
    """Escapes of the chunks of one tile, each at its chunk's offset in the escape streams; chunks without escapes
    are not read."""
    n = tl.cast(n, tl.int64)
    n_esc = tl.cast(n_esc, tl.int64)
    off_cid = tl.cast(off_cid, tl.int64)
    cid = (pay_ptr + off_cid).to(tl.pointer_type(tl.int32))
    lpos = (pay_ptr + off_cid + 4 * n_esc).to(tl.pointer_type(tl.int16))
    ev = pay_ptr + (off_cid + 6 * n_esc + 3) // 4 * 4
    for k in tl.static_range(CHUNKS):
        chunk = tl.program_id(0).to(tl.int64) * CHUNKS + k
        if tl.load(counts_ptr + chunk) > 0:
            local = tl.arange(0, CHUNK)
            index = chunk * CHUNK + local
            live = index < n
            exponent = (tl.load(x_ptr + index, mask=live, other=0).to(tl.int32) >> 7) & 0xFF
            escaped = live & (tl.load(enc_ptr + exponent) == _ESCAPE)
            flag = escaped.to(tl.int32)
            slot = tl.load(starts_ptr + chunk) + tl.cumsum(flag, axis=0) - flag
            tl.store(cid + slot, tl.full([CHUNK], 0, tl.int32) + chunk.to(tl.int32), mask=escaped)
            tl.store(lpos + slot, local.to(tl.int16), mask=escaped)
            tl.store(ev + slot, exponent.to(tl.uint8), mask=escaped)


def _calibrated(hist: torch.Tensor, n: int, device: torch.device) -> tuple[Codebook, int, torch.Tensor]:
    """Top-16 on the device; the host reads back the codebook and ``n_esc`` (the encoder's one synchronisation)."""
    info = torch.empty(19, dtype=torch.int64, device=device)
    enc = torch.empty(256, dtype=torch.int32, device=device)
    _calibrate_kernel[(1,)](hist, n, info, enc)
    n_used, covered, n_esc, *dec_lut = info.tolist()
    codebook = Codebook(dec_lut=tuple(dec_lut), n_used=n_used, coverage=covered / n if n else 1.0)
    return codebook, n_esc, enc


def _with_codebook(hist: torch.Tensor, n: int, codebook: Codebook, device: torch.device) -> tuple[int, torch.Tensor]:
    """``n_esc`` and the encode table for a codebook chosen by the caller (one synchronisation too)."""
    used = torch.tensor(codebook.dec_lut[: codebook.n_used], dtype=torch.int64, device=device)
    n_esc = n - int(hist.index_select(0, used).sum()) if codebook.n_used else n
    return n_esc, codebook.encode_lut().to(device=device, dtype=torch.int32)


def encode(
    x: torch.Tensor,
    codebook: Codebook | None = None,
    *,
    stream: "torch.cuda.Stream | None" = None,
) -> tuple[torch.Tensor, PayloadLayout, Codebook]:
    """Encode a BF16 tensor on the GPU; the payload bytes equal those of :func:`..cpu.encode` on the same tensor.

    Args:
        x (`torch.Tensor`): bfloat16 CUDA tensor of any shape (a non-contiguous or misaligned one is copied first).
        codebook (`Codebook`, *optional*): use this codebook instead of calibrating one.
        stream (`torch.cuda.Stream`, *optional*): where to enqueue; the current stream by default. The host waits
            once, for the codebook and the escape count that size the payload.

    Returns:
        `tuple`: ``(payload, layout, codebook)``; ``payload`` is a uint8 tensor of ``layout.comp_bytes`` on ``x``'s
        device.
    """
    if x.dtype != torch.bfloat16:
        raise TypeError(f"SplitZip encodes bfloat16 tensors only, got {x.dtype}")
    device = check_device(x)
    with on_stream(stream, device):
        bits = x.detach().contiguous().reshape(-1).view(torch.int16)
        if bits.data_ptr() % 4:
            bits = bits.clone()
        n = bits.numel()
        hist = torch.zeros(256, dtype=torch.int64, device=device)
        if n:
            programs = min(program_slots(device, HISTOGRAM_PROGRAMS_PER_SM), triton.cdiv(n, HISTOGRAM_ROWS * 8))
            _histogram_kernel[(programs,)](bits, hist, n, ROWS=HISTOGRAM_ROWS, WINDOW=HISTOGRAM_WINDOW, num_warps=8)
        if codebook is None:
            codebook, n_esc, enc = _calibrated(hist, n, device)
        else:
            n_esc, enc = _with_codebook(hist, n, codebook, device)
        layout = PayloadLayout(n=n, n_esc=n_esc)
        payload = torch.empty(layout.comp_bytes, dtype=torch.uint8, device=device)
        if n:
            tiles = triton.cdiv(n, PACK_ROWS * 8)
            counts = torch.zeros(tiles * (PACK_ROWS // 128), dtype=torch.int32, device=device)
            _pack_kernel[(tiles,)](bits, payload, enc, counts, n, n_esc, layout.off_sm, ROWS=PACK_ROWS,
                                   num_warps=PACK_WARPS)
        if n_esc:
            starts = torch.cumsum(counts, 0) - counts
            _escape_write_kernel[(tiles,)](bits, payload, enc, counts, starts, n, n_esc, layout.off_cid,
                                           CHUNKS=PACK_ROWS // 128, CHUNK=CHUNK_SIZE, num_warps=4)
    return payload, layout, codebook


def encode_to_host(
    x: torch.Tensor,
    codebook: Codebook | None = None,
    *,
    device: torch.device | str | None = None,
) -> tuple[torch.Tensor, PayloadLayout, Codebook]:
    """Encode on a GPU, return the payload in host memory: what a converter writes to a file.

    Args:
        x (`torch.Tensor`): bfloat16 tensor on the CPU or a GPU; a CPU tensor is copied to ``device`` first.
        codebook (`Codebook`, *optional*): as for :func:`encode`.
        device (`torch.device` or `str`, *optional*): the GPU to encode on when ``x`` is on the CPU (``"cuda"``
            by default).

    Returns:
        `tuple`: ``(payload, layout, codebook)`` exactly as :func:`..cpu.encode` returns them, ``payload`` on the CPU.
    """
    if x.device.type == "cpu" and not interpreting():
        x = x.to(device or "cuda")
    payload, layout, codebook = encode(x, codebook)
    return payload.cpu(), layout, codebook
