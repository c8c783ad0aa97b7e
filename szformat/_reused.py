"""One block of memory handed out again from step to step: what a conversion encodes each tensor into, what a
CPU load reads the bytes around each group's streams into."""

from __future__ import annotations

from ._lazy import torch

__all__ = ["ReusedBuffer"]


class ReusedBuffer:
    """Flat uint8 CPU memory that each :meth:`take` hands out again, grown when a step needs more.

    A conversion handles one tensor at a time. A new tensor per step makes the kernel hand out pages nobody wrote
    before, faulted in and zeroed one by one on first write: a 2.2 GB conversion faulted in 380 MB of new pages for
    its payloads, about a tenth of its CPU time (``bench/RESULTS.md``, "Conversion"). Here the pages are faulted in
    once, by the largest tensor.
    """

    def __init__(self) -> None:
        self._memory: torch.Tensor | None = None  # nothing allocated until a step asks: a failure names that step

    def take(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the buffer as a flat uint8 tensor, valid until the next call (which may write
        over it)."""
        if self._memory is None or self._memory.numel() < nbytes:
            self._memory = None  # the old memory goes before the new is made
            self._memory = torch.empty(nbytes, dtype=torch.uint8)
        return self._memory[:nbytes]
