"""What ``load_into_offloader`` returns: the module, the route that feeds it, its transfer counters, and ``close``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .shards import Checkpoint
from .routes import Route

__all__ = ["OffloadedModel"]


class OffloadedModel:
    """A module an offloading engine now runs, fed compressed from a .szt checkpoint.

    Use the module as usual (``offloaded.module(inputs)``); :meth:`close` (or leaving a ``with`` block) removes the
    engine's hooks and releases the checkpoint, after which the module must not be called again.

    Attributes:
        module (`torch.nn.Module`): the module, as passed in.
        route (`Route`): the route, its decoder and why it was chosen.
        engine (`Any`): the engine's own handle (DDO's apply result; ``None`` for the hook-based engines).
        setup_bytes (`int`): bytes copied to the device once, at install, for tensors the engine keeps resident.
    """

    def __init__(self, module: torch.nn.Module, route: Route, checkpoint: Checkpoint, *, engine: Any = None,
                 setup_bytes: int = 0, counters: Callable[[], dict[str, int]] = dict,
                 release: Callable[[], None] = lambda: None):
        self.module = module
        self.route = route
        self.engine = engine
        self.setup_bytes = setup_bytes
        self._checkpoint = checkpoint
        self._counters = counters
        self._release = release
        self._closed = False

    @property
    def checkpoint(self) -> Checkpoint:
        return self._checkpoint

    def counters(self) -> dict[str, int]:
        """Transfer counters since install: ``h2d_bytes`` (bytes the engine copied host to device while running,
        as it counts them) and route-specific details."""
        return dict(self._counters())

    def close(self) -> None:
        """Remove the engine from the module and release the checkpoint (idempotent)."""
        if self._closed:
            return
        self._closed = True
        try:
            self._release()
        finally:
            self._checkpoint.close()

    def __enter__(self) -> "OffloadedModel":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"OffloadedModel(route={self.route.name!r}, decoder={self.route.decoder!r}, "
                f"path={self._checkpoint.path})")
