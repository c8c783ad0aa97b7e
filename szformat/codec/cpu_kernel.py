"""Which CPU kernels the codec runs: the C extension (``_native``, built by ``pip install`` where a C compiler is at
hand) or the PyTorch reference. Imports neither torch nor NumPy, so ``szconvert --version`` can say it at once."""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["native", "KERNEL"]


def _load_native() -> ModuleType | None:
    """The C kernels, unless the package was built without them or ``SZFORMAT_CPU_CODEC=reference`` asks for the
    PyTorch loops."""
    if os.environ.get("SZFORMAT_CPU_CODEC", "") == "reference":
        return None
    try:
        from . import _native
    except ImportError:
        return None
    return _native


native = _load_native()
KERNEL = f"native ({native.isa()})" if native is not None else "reference (PyTorch)"
"""``native (avx2)``, ``native (scalar)`` (the C extension, by the instructions it uses on this CPU) or
``reference (PyTorch)``."""
