"""The .szt container: constants, header schema, streaming writer, mmap reader."""

from .header import Header, TensorEntry
from .reader import PayloadDescriptor, SztFile
from .writer import SztWriter

__all__ = ["Header", "PayloadDescriptor", "SztFile", "SztWriter", "TensorEntry"]
