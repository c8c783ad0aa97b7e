"""Heavy modules imported on first use, for the modules that ``szconvert info``, ``verify`` of checksums and
``repack`` go through: reading a header needs msgpack and zstandard, not torch (about 2 s and 200 MB to import), so
those modules name torch through :class:`LazyModule` and pay for it only when they touch a tensor.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any, Callable, Mapping

__all__ = ["LazyModule", "at_rest", "atomic", "attributes_on_first_use", "byte_planes", "cpu_codec", "torch",
           "zstandard"]


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
zstandard = LazyModule("zstandard")
"""zstd, for the at-rest stage: a file in the in-memory form is read without it."""
atomic = LazyModule("szformat.format.atomic")
"""Atomic outputs, for the index writer: a load, which reads indexes only, imports none of it (nor its direct I/O)."""
at_rest = LazyModule("szformat.format.at_rest")
"""The at-rest stage (its parse, plans and inflaters), for the readers: a file in the in-memory form is read without
it (a tenth of what a fresh process's CPU load imports)."""


def attributes_on_first_use(package: str, names: Mapping[str, str]
                            ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's ``__getattr__`` and ``__dir__`` (PEP 562) for ``names`` (attribute: the module defining it,
    relative to ``package``): each is imported the first time it is looked up, then bound in the package, so later
    lookups skip the hook and importing the package costs none of those modules."""
    namespace = sys.modules[package].__dict__

    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(importlib.import_module(names[name], package), name)
        return value

    def __dir__() -> list[str]:
        return sorted(set(namespace) | set(names))

    return __getattr__, __dir__
