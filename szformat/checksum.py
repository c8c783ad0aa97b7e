"""CRC-32 (IEEE 802.3, the checksum ``zlib.crc32`` computes) of the bytes a ``.szt`` file stores.

Every header, payload and raw tensor carries one: conversion computes them and loading checks them, so their speed
bounds both. zlib-ng's SIMD implementation gives the same values as the zlib CPython ships at about twelve times its
speed (25 against 2.2 GB/s on one core of the 2-core build VM) and releases the GIL, so reader threads check their
pieces in parallel; it also joins the CRCs of adjacent pieces (:func:`crc32_combine`), which ``zlib`` does not offer.
"""

from __future__ import annotations

import ctypes
from typing import Iterable

from zlib_ng import zlib_ng
from ._lazy import torch

__all__ = ["crc32", "crc32_combine", "crc32_join", "crc32_function_address", "tensor_crc32"]


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """The CRC-32 of ``data`` (any buffer), continuing from ``value`` (the CRC of the bytes before it)."""
    return zlib_ng.crc32(data, value)


def tensor_crc32(data: torch.Tensor) -> int:
    """The CRC-32 of a flat uint8 CPU tensor's bytes."""
    return zlib_ng.crc32(memoryview(data.numpy())) if data.numel() else 0


def crc32_combine(crc_a: int, crc_b: int, length_b: int) -> int:
    """``crc32(a + b)`` from ``crc_a = crc32(a)``, ``crc_b = crc32(b)`` and ``length_b = len(b)``."""
    if length_b < 0:  # zlib-ng would read it as a huge unsigned length and loop for a very long time
        raise ValueError(f"length must not be negative, got {length_b}")
    return zlib_ng.crc32_combine(crc_a, crc_b, length_b)


def crc32_join(parts: Iterable[tuple[int, int]]) -> int:
    """The CRC-32 of consecutive pieces of bytes from ``(crc, length)`` of each piece, in order."""
    crc = 0
    for part, length in parts:
        crc = crc32_combine(crc, part, length)
    return crc


def crc32_function_address(name: str = "zng_crc32") -> int | None:
    """The address of zlib-ng's C function ``name`` (``zng_crc32``, what :func:`crc32` runs, or
    ``zng_crc32_combine``), for the C kernels to checksum each block they decode while it is in cache; ``None``
    where zlib-ng's module does not export it."""
    try:
        return ctypes.cast(getattr(ctypes.CDLL(zlib_ng.__file__), name), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None
