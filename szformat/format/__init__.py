"""The .szt container: constants, header schema, the at-rest stage (1.1), streaming writer, mmap reader."""

from .._lazy import attributes_on_first_use

_LAZY = {"Header": ".header", "TensorEntry": ".header", "PayloadDescriptor": ".reader", "SztFile": ".reader",
         "SztWriter": ".writer"}
"""Each name's module, imported on first use: a load imports the reader's modules, not the writer's."""

__all__ = sorted(_LAZY)
__getattr__, __dir__ = attributes_on_first_use(__name__, _LAZY)
