"""``--cast bf16``: turn an F16/F32/F64 checkpoint into a BF16 one while converting, on request only.

SplitZip compresses BF16 alone, so an F32 or F16 checkpoint converts to a file no smaller than its source. Casting
to BF16 first (what ``model.to(torch.bfloat16)`` does, and what most checkpoints on the Hub already are) halves an
F32 tensor, and the BF16 result then compresses like any other. It is lossy: the output holds the cast values, not
the source's, so it is never done silently. The file's ``__metadata__`` records which dtypes were cast
(``CAST_METADATA_KEY``), checksums and ``verify`` cover the cast values, and ``decompress`` gives back a BF16
checkpoint.
"""

from __future__ import annotations

from typing import Iterable

from .._lazy import torch
from ..format import constants as C
from .sources import SourceTensor

CAST_TARGETS = ("bf16",)
"""Values of ``--cast`` (``cast=`` in Python)."""
CAST_DTYPES = ("F16", "F32", "F64")
"""What a cast turns into BF16: the floating-point dtypes wider than or as wide as BF16. FP8 tensors would double
and integer tensors are not weights to round: they stay as they are."""
CAST_METADATA_KEY = "szformat.cast"
"""The ``__metadata__`` entry saying which source dtypes were cast, e.g. ``"F16,F32->BF16"``."""


def cast_to_bf16(raw: torch.Tensor, dtype: str) -> torch.Tensor:
    """The raw bytes (flat uint8) of a ``dtype`` tensor, cast to BF16 with round-to-nearest-even, exactly as
    ``tensor.to(torch.bfloat16)`` rounds; returns the BF16 tensor's bytes, flat uint8."""
    itemsize = C.itemsize(dtype)
    if raw.data_ptr() % itemsize or raw.storage_offset() % itemsize:
        raw = raw.clone()  # safetensors packs tensors back to back: one may start at any byte; a copy is aligned
    return raw.view(C.DTYPES[dtype][0]).to(torch.bfloat16).view(torch.uint8)


def cast_dtypes(tensors: Iterable[SourceTensor]) -> set[str]:
    """The dtypes among ``tensors`` that a cast turns into BF16."""
    return {t.dtype for t in tensors if t.dtype in CAST_DTYPES}


def cast_metadata(metadata: dict[str, str] | None, cast_from: list[str]) -> dict[str, str] | None:
    """``metadata`` with the record of a cast added (unchanged when nothing was cast)."""
    if not cast_from:
        return metadata
    return {**(metadata or {}), CAST_METADATA_KEY: f"{','.join(sorted(cast_from))}->BF16"}
