"""Byte planes: a tensor's bytes regrouped so that plane ``j`` holds byte ``j`` (little-endian) of every element.

The at-rest stage of raw tensors (``format/at_rest.py``) stores each plane on its own: the byte that holds a float's
exponent is far from random and shrinks under zstd, the low mantissa bytes are close to random and stay verbatim.
With ``sign_last`` each element is first rotated left by one bit, so a float's sign moves to bit 0 and its exponent
fills the high byte whole (FP32, BF16; FP16's five exponent bits share it with mantissa bits either way): the high
plane then holds the exponent alone, which zstd stores in fewer bytes than exponent and sign together.

Moving bytes between the two orders runs in the C extension where it is built (4-6 GB/s per core), else in NumPy
(which takes a read-only source, as a mapped file is, and releases the GIL for its copies).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .cpu_kernel import native

__all__ = ["split_planes", "join_planes"]

_UNSIGNED = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def split_planes(data: memoryview, out: memoryview, itemsize: int, sign_last: bool = False) -> None:
    """Elements ``data`` (bytes, a multiple of ``itemsize``) into plane-major ``out`` of the same length."""
    if itemsize not in (1, 2, 4, 8) or len(data) != len(out) or len(data) % itemsize:
        raise ValueError(f"byte planes of {itemsize}-byte elements: {len(data)} and {len(out)} bytes")
    if itemsize == 1 or not len(data):
        _copy(data, out)
    elif native is not None:
        native.split_planes(data, out, itemsize, sign_last)
    else:
        elements = np.frombuffer(data, _UNSIGNED[itemsize])
        if sign_last:
            elements = _rotate(elements, 1)
        np.frombuffer(out, np.uint8).reshape(itemsize, -1)[...] = elements.view(np.uint8).reshape(-1, itemsize).T


def join_planes(planes: Sequence[memoryview], out: memoryview, itemsize: int, sign_last: bool = False) -> None:
    """Planes ``planes`` (``itemsize`` buffers of ``len(out) / itemsize`` bytes each, wherever they are: an inflated
    plane in a scratch, a verbatim one in the stored bytes) joined into elements ``out``: :func:`split_planes`
    undone, with no copy of a verbatim plane first."""
    n = len(out) // itemsize
    if itemsize not in (1, 2, 4, 8) or len(planes) != itemsize or len(out) % itemsize \
            or any(len(plane) != n for plane in planes):
        raise ValueError(f"byte planes of {itemsize}-byte elements: {[len(p) for p in planes]} for {len(out)} "
                         "bytes")
    if itemsize == 1 or not n:
        _copy(planes[0], out)
    elif native is not None:
        native.join_planes(planes, out, itemsize, sign_last)
    else:
        elements = np.frombuffer(out, np.uint8).reshape(-1, itemsize)
        for j, plane in enumerate(planes):
            elements[:, j] = np.frombuffer(plane, np.uint8)
        if sign_last:
            words = elements.reshape(-1).view(_UNSIGNED[itemsize])
            words[...] = _rotate(words, 8 * itemsize - 1)


def _copy(source: memoryview, out: memoryview) -> None:
    """``source`` into ``out``, through NumPy, which releases the GIL for a copy this large (a memoryview
    assignment holds it)."""
    np.copyto(np.frombuffer(out, np.uint8), np.frombuffer(source, np.uint8))


def _rotate(words: np.ndarray, bits: int) -> np.ndarray:
    """``words`` rotated left by ``bits`` (a new array)."""
    width = 8 * words.itemsize
    return (words << words.dtype.type(bits)) | (words >> words.dtype.type(width - bits))
