"""One tensor's payload through the CPU codec or the at-rest stage, with every failure named by file and tensor.

Each read path (the lazy reader, the host decode of ``load_file``, the GPU loader's host route, the staging pool,
``decompress``/``verify``, the offload routes) decodes or inflates a tensor's payload and must report a payload the
codec refuses as :class:`~szformat.errors.PayloadError` naming the file and the tensor: this module is the one
place that does it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Sequence

from .._lazy import at_rest, cpu_codec, torch
from ..errors import PayloadError, SzformatError, TensorAllocationError
from .header import TensorEntry

__all__ = ["payload_errors", "allocation_errors", "decode_entry", "decode_entry_with_crc", "inflate_entry"]


@contextlib.contextmanager
def payload_errors(path: str | os.PathLike, tensor: str) -> Iterator[None]:
    """Turn the codec's refusal of a payload (``ValueError``, a corrupt zstd frame) into ``PayloadError``."""
    try:
        yield
    except SzformatError:  # already names its file and tensor (a file truncated while it is read, ...)
        raise
    except (ValueError, at_rest.AtRestError) as e:
        raise PayloadError(str(e), path=path, tensor=tensor) from None


@contextlib.contextmanager
def allocation_errors(path: str | os.PathLike, tensor: str) -> Iterator[None]:
    """Turn a failed allocation while a tensor is read (``MemoryError``, torch's ``RuntimeError`` from its CPU
    allocator, ``torch.OutOfMemoryError``) into :class:`TensorAllocationError` naming the file and the tensor."""
    try:
        yield
    except SzformatError:
        raise
    except MemoryError as e:
        raise TensorAllocationError(f"out of memory ({e})", path=path, tensor=tensor) from None
    except RuntimeError as e:
        if not isinstance(e, getattr(torch, "OutOfMemoryError", ())) and "allocate" not in str(e):
            raise
        raise TensorAllocationError(f"out of memory ({str(e).strip().splitlines()[-1]})", path=path,
                                    tensor=tensor) from None


def decode_entry(path: str | os.PathLike, entry: TensorEntry, payload: torch.Tensor, out: torch.Tensor, *,
                 start: int = 0, stop: int | None = None) -> torch.Tensor:
    """Decode elements ``[start, stop)`` of SplitZip tensor ``entry`` from its in-memory ``payload`` into ``out``
    (BF16, ``stop - start`` elements) with the CPU reference codec; returns ``out``."""
    with payload_errors(path, entry.name):
        return cpu_codec.decode(payload, entry.layout, entry.codebook, start=start,
                                stop=entry.numel if stop is None else stop, out=out)


def decode_entry_with_crc(path: str | os.PathLike, entry: TensorEntry, payload: torch.Tensor, out: torch.Tensor
                          ) -> int:
    """:func:`decode_entry` of the whole tensor, and the CRC-32 of its decoded bytes (taken as they are written
    where the C kernels checksum, not in a pass of its own)."""
    with payload_errors(path, entry.name):
        return cpu_codec.decode_with_crc(payload, entry.layout, entry.codebook, out)


def decode_entry_columns(path: str | os.PathLike, entry: TensorEntry, payload: torch.Tensor, out: torch.Tensor, *,
                         rows: tuple[int, int], cols: tuple[int, int]) -> torch.Tensor:
    """Decode columns ``cols`` of rows ``rows`` of SplitZip matrix ``entry`` (its width and both column bounds
    even) from its in-memory ``payload`` (at least those rows' bytes and the escape streams) into ``out``."""
    with payload_errors(path, entry.name):
        decoder = cpu_codec.PayloadDecoder(payload, entry.layout, entry.codebook)
        decoder.decode_columns(rows, entry.shape[1], cols, out.reshape(-1))
        return out


def inflate_entry(path: str | os.PathLike, entry: TensorEntry, stored: torch.Tensor, out: torch.Tensor | None = None,
                  *, ranges: Sequence[tuple[int, int]] | None = None) -> torch.Tensor:
    """The in-memory payload of ``entry`` (stored at rest; a raw tensor's own bytes) from its ``stored`` bytes:
    whole, or only the payload byte ``ranges`` given (the rest of ``out`` left unwritten)."""
    with payload_errors(path, entry.name):
        if ranges is None:
            return at_rest.inflate(stored, entry.segments(), entry.memory_length, out)
        return at_rest.inflate_ranges(stored, entry.segments(), entry.memory_length, ranges, out)
