"""SplitZip: lossless BF16 compression by exponent coding.

The CPU implementation (:mod:`.cpu`) is the reference; GPU kernels live in :mod:`.gpu` and are imported
only on demand, so this package imports without Triton or a GPU. The payload layout (:mod:`.layout`) imports
nothing heavy: reading a file's header needs it, not torch; the names below that need torch load on first use.
"""

from importlib import import_module
from typing import Any

from .layout import CHUNK_SIZE, ESCAPE_CODE, N_CODES, PayloadLayout, align4

_LAZY = {"COVERAGE_GATE": ".codebook", "Codebook": ".codebook", "codebook_from_histogram": ".codebook",
         "calibrate": ".cpu", "decode": ".cpu", "encode": ".cpu", "escape_positions": ".cpu", "split_bf16": ".cpu"}

__all__ = [
    "CHUNK_SIZE", "COVERAGE_GATE", "ESCAPE_CODE", "N_CODES", "Codebook", "PayloadLayout", "align4",
    "calibrate", "codebook_from_histogram", "decode", "encode", "escape_positions", "split_bf16",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name], __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
