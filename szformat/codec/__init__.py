"""SplitZip: lossless BF16 compression by exponent coding.

The CPU implementation (:mod:`.cpu`) is the reference; GPU kernels live in :mod:`.gpu` and are imported
only on demand, so this package imports without Triton or a GPU.
"""

from .codebook import COVERAGE_GATE, Codebook, codebook_from_histogram
from .cpu import calibrate, decode, encode, escape_positions, split_bf16
from .layout import CHUNK_SIZE, ESCAPE_CODE, N_CODES, PayloadLayout, align4

__all__ = [
    "CHUNK_SIZE", "COVERAGE_GATE", "ESCAPE_CODE", "N_CODES", "Codebook", "PayloadLayout", "align4",
    "calibrate", "codebook_from_histogram", "decode", "encode", "escape_positions", "split_bf16",
]
