"""Heavy modules imported on first use, for the modules that ``szconvert info``, ``verify`` of checksums and
``repack`` go through: reading a header needs msgpack and zstandard, not torch (about 2 s and 200 MB to import), so
those modules name torch through :class:`LazyModule` and pay for it only when they touch a tensor.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

__all__ = ["LazyModule", "torch", "cpu_codec", "byte_planes"]


class LazyModule:
    """Stands for the module ``name``, imported at the first attribute looked up through it."""

    __slots__ = ("_name", "_module")

    def __init__(self, name: str):
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attribute: str) -> Any:
        module = self._module
        if module is None:
            module = self._module = importlib.import_module(self._name)
        return getattr(module, attribute)

    def __repr__(self) -> str:
        return f"<lazy module {self._name!r}{' (imported)' if self._module is not None else ''}>"


torch = LazyModule("torch")
cpu_codec = LazyModule("szformat.codec.cpu")
"""The CPU codec (it imports torch and NumPy), for the modules of the file format that decode or encode a tensor
only when asked to."""
byte_planes = LazyModule("szformat.codec.planes")
"""Byte-plane moves (NumPy, or the C extension), for the at-rest stage of raw tensors."""
