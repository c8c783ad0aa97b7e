"""The .szt container: constants, header schema, the at-rest stage (1.1), streaming writer, mmap reader."""

from .header import Header, TensorEntry
from .reader import PayloadDescriptor, SztFile
from .writer import SztWriter

__all__ = ["Header", "PayloadDescriptor", "SztFile", "SztWriter", "TensorEntry"]
