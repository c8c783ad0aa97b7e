"""The frozen SplitZip payload layout: where each stream of a tensor's payload starts.

For a BF16 tensor of ``n`` elements with ``n_esc`` escapes::

    off_pk   = 0                          pk[ceil(n/2)]  u8   two 4-bit codes per byte, high nibble first
    off_sm   = align4(off_pk + n_pairs)   sm[n]          u8   (sign << 7) | mantissa7
    off_cid  = align4(off_sm + n)         chunk_id[n_esc] i32 LE
    off_lpos = off_cid + 4 * n_esc        local_pos[n_esc] u16 LE
    off_ev   = align4(off_lpos + 2*n_esc) esc_val[n_esc] u8   raw exponent byte
    comp_bytes = off_ev + n_esc

This module is the single owner of that arithmetic; encoders, decoders, kernels and the file format import it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

ENCODING_SPLITZIP = "splitzip"
ENCODING_RAW = "raw"
"""The names a tensor's encoding goes by: SplitZip's payload, or the tensor's own bytes."""

CHUNK_SIZE = 1024
"""Escape positions are stored as (chunk index, position inside the chunk) with this chunk size."""

N_CODES = 16
"""Codebook size: 4-bit codes."""

ESCAPE_CODE = 16
"""Code given to exponents outside the codebook; its nibble in ``pk`` is ``ESCAPE_CODE & 0xF == 0``."""

MAX_CHUNKS = 1 << 31
"""Chunk ids are stored as int32, so a payload has at most 2^31 chunks: ``n <= 2^31 * chunk_size`` (2^41 elements,
4 TiB of BF16, with the chunk size of 1024). Larger tensors are stored raw."""


def align4(x: int) -> int:
    """Round ``x`` up to a multiple of 4."""
    return (x + 3) & ~3


@dataclass(frozen=True)
class PayloadLayout:
    """Byte offsets of the five streams of one SplitZip payload, computed once when it is made: every header entry
    and every decode asks for them."""

    n: int
    n_esc: int
    chunk_size: int = CHUNK_SIZE

    def __post_init__(self) -> None:
        if self.n < 0 or self.n_esc < 0 or self.n_esc > self.n:
            raise ValueError(f"invalid SplitZip sizes n={self.n}, n_esc={self.n_esc}")
        if self.chunk_size <= 0 or self.chunk_size > 65536:
            raise ValueError(f"chunk size {self.chunk_size} does not fit a u16 local position")
        if self.n > self.max_elements(self.chunk_size):
            raise ValueError(f"n={self.n} elements need chunk ids past the int32 range: a SplitZip payload holds at "
                             f"most 2^31 chunks of {self.chunk_size} ({self.max_elements(self.chunk_size)} elements)")
        off_sm = align4(self.n_pairs)
        off_cid = align4(off_sm + self.n)
        off_lpos = off_cid + 4 * self.n_esc
        off_ev = align4(off_lpos + 2 * self.n_esc)
        object.__setattr__(self, "_offsets", (off_sm, off_cid, off_lpos, off_ev, off_ev + self.n_esc))

    @staticmethod
    def max_elements(chunk_size: int = CHUNK_SIZE) -> int:
        """The most elements a payload can hold: every escape's chunk id must fit an int32."""
        return MAX_CHUNKS * chunk_size

    @property
    def n_pairs(self) -> int:
        return (self.n + 1) // 2

    @property
    def off_pk(self) -> int:
        return 0

    @property
    def off_sm(self) -> int:
        return self._offsets[0]

    @property
    def off_cid(self) -> int:
        return self._offsets[1]

    @property
    def off_lpos(self) -> int:
        return self._offsets[2]

    @property
    def off_ev(self) -> int:
        return self._offsets[3]

    @property
    def comp_bytes(self) -> int:
        return self._offsets[4]

    @property
    def raw_bytes(self) -> int:
        return 2 * self.n

    @property
    def n_chunks(self) -> int:
        return -(-self.n // self.chunk_size)

    def byte_ranges(self, start: int, stop: int) -> list[tuple[int, int]]:
        """The ``[begin, end)`` byte ranges of the payload that decoding elements ``[start, stop)`` reads: their
        ``pk`` and ``sm`` bytes, and the escape streams whole (they are checked whole)."""
        return [(self.off_pk + start // 2, self.off_pk + (stop + 1) // 2), (self.off_sm + start, self.off_sm + stop),
                (self.off_cid, self.comp_bytes)]

    def stream_offsets(self) -> dict[str, int]:
        """The offsets as stored in a .szt header (redundant with n and n_esc, checked on read)."""
        off_sm, off_cid, off_lpos, off_ev, _ = self._offsets
        return {"pk": 0, "sm": off_sm, "chunk_id": off_cid, "local_pos": off_lpos, "esc_val": off_ev}


@functools.lru_cache(maxsize=4096)
def payload_layout(n: int, n_esc: int) -> PayloadLayout:
    """The layout of ``n`` elements with ``n_esc`` escapes in chunks of :data:`CHUNK_SIZE`, made once per size: a
    header's tensors share a few shapes (a layer's repeat), and a layout costs 2 us to make."""
    return PayloadLayout(n=n, n_esc=n_esc)
