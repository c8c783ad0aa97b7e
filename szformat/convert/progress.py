"""The progress bar of a long pass over a checkpoint: bytes done of the raw total, on stderr."""

from __future__ import annotations

import sys

from tqdm import tqdm


def progress_bar(total: int, *, enabled: bool, description: str) -> tqdm:
    """A byte-counting bar; with ``enabled=False`` every call on it is a no-op."""
    return tqdm(total=total, disable=not enabled, desc=description, unit="B", unit_scale=True, unit_divisor=1000,
                file=sys.stderr, dynamic_ncols=True, leave=False)
