"""Cut a sequence into consecutive runs within a size budget: the batches and groups the loaders work through."""

from __future__ import annotations

from typing import Callable, Iterable, TypeVar

__all__ = ["runs_within"]

T = TypeVar("T")


def runs_within(items: Iterable[T], size: Callable[[T], int], budget: int) -> list[list[T]]:
    """``items`` in order, cut into consecutive runs whose ``size``\\ s add up to at most ``budget``; an item larger
    than the budget makes a run of its own, so every run holds at least one item (and no items give no runs)."""
    runs: list[list[T]] = []
    total = 0
    for item in items:
        amount = size(item)
        if not runs or total + amount > budget:
            runs.append([])
            total = 0
        runs[-1].append(item)
        total += amount
    return runs
