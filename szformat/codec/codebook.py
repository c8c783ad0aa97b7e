"""Per-tensor Top-16 exponent codebook: deterministic calibration and the coverage gate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .._lazy import torch
from .layout import ESCAPE_CODE, N_CODES

COVERAGE_GATE = 0.99
"""A BF16 tensor whose Top-16 coverage is below this is stored raw."""


@dataclass(frozen=True)
class Codebook:
    """``dec_lut[code]`` is the exponent byte a 4-bit code stands for; ``coverage`` the share of elements it covers.

    ``n_used`` codes are real; the rest (tensors with fewer than 16 distinct exponents) decode to 0 and are never
    emitted by the encoder.
    """

    dec_lut: tuple[int, ...]
    n_used: int
    coverage: float

    def __post_init__(self) -> None:
        if len(self.dec_lut) != N_CODES or not 0 <= min(self.dec_lut) <= max(self.dec_lut) <= 255:
            raise ValueError(f"a codebook holds {N_CODES} exponent bytes in 0..255, got {self.dec_lut!r}")
        if not 0 <= self.n_used <= N_CODES:
            raise ValueError(f"n_used must be in 0..{N_CODES}, got {self.n_used}")
        used = self.dec_lut[: self.n_used]
        if len(set(used)) != len(used):
            raise ValueError(f"codebook exponents must be distinct, got {used!r}")

    def encode_lut(self) -> torch.Tensor:
        """``enc[exponent] -> code`` (uint8, 256 entries); exponents outside the codebook map to ``ESCAPE_CODE``."""
        enc = torch.full((256,), ESCAPE_CODE, dtype=torch.uint8)
        for code, exponent in enumerate(self.dec_lut[: self.n_used]):
            enc[exponent] = code
        return enc


def codebook_from_histogram(histogram: Sequence[int] | torch.Tensor) -> Codebook:
    """The 16 most frequent exponents, most frequent first, ties broken by the smaller exponent.

    The tie rule makes conversion deterministic: the same tensor always gives the same bytes, on any device.
    """
    import numpy as np  # here: `szconvert info` reads headers without NumPy

    counts = np.asarray(histogram.cpu().numpy() if isinstance(histogram, torch.Tensor) else histogram, dtype=np.int64)
    if counts.shape != (256,):
        raise ValueError(f"an exponent histogram has 256 bins, got {counts.size}")
    # A stable sort of the negated counts keeps equal counts in exponent order: the tie rule.
    ranked = tuple(int(e) for e in np.argsort(-counts, kind="stable")[:N_CODES] if counts[e] > 0)
    total = int(counts.sum())
    coverage = int(counts[list(ranked)].sum()) / total if total else 1.0
    return Codebook(dec_lut=ranked + (0,) * (N_CODES - len(ranked)), n_used=len(ranked), coverage=coverage)
