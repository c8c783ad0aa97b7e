"""Byte planes (``codec/planes.py``): the C loops and the NumPy fallback against a definition written with Python
integers, for every element size, both transforms, odd and empty lengths, and the argument checks."""

from __future__ import annotations

import random

import numpy as np
import pytest

from szformat.codec import cpu_kernel, planes

KERNELS = ["native", "numpy"]


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    if request.param == "native":
        if cpu_kernel.native is None:
            pytest.skip("the C extension is not built here")
    else:
        monkeypatch.setattr(planes, "native", None)
    return request.param


def defined_planes(data: bytes, itemsize: int, sign_last: bool) -> bytes:
    """The spec's definition, one element at a time: rotate left by one bit (``sign_last``), then byte ``j`` of
    each element into plane ``j``."""
    width = 8 * itemsize
    out = [bytearray() for _ in range(itemsize)]
    for i in range(0, len(data), itemsize):
        value = int.from_bytes(data[i: i + itemsize], "little")
        if sign_last:
            value = ((value << 1) | (value >> (width - 1))) & ((1 << width) - 1)
        for j, byte in enumerate(value.to_bytes(itemsize, "little")):
            out[j].append(byte)
    return b"".join(out)


@pytest.mark.parametrize("itemsize, sign_last", [(1, False), (2, False), (4, False), (8, False), (2, True),
                                                 (4, True), (8, True)])
@pytest.mark.parametrize("count", [0, 1, 7, 4095, 4096, 4097, 10001])
def test_split_matches_the_definition_and_join_undoes_it(kernel, itemsize, sign_last, count):
    seed = random.randrange(1 << 30)
    data = np.random.default_rng(seed).integers(0, 256, count * itemsize, dtype=np.uint8).tobytes()
    split = bytearray(len(data))
    planes.split_planes(memoryview(data), memoryview(split), itemsize, sign_last)
    assert bytes(split) == defined_planes(data, itemsize, sign_last), f"seed {seed}"
    joined = bytearray(len(data))
    count = len(data) // itemsize
    pieces = [memoryview(bytes(split[j * count: (j + 1) * count])) for j in range(itemsize)]  # read-only, apart
    planes.join_planes(pieces, memoryview(joined), itemsize, sign_last)
    assert bytes(joined) == data, f"seed {seed}"


def test_the_sign_moves_to_bit_zero_and_the_exponent_fills_the_high_byte(kernel):
    """-1.0 in FP32 is 0xBF800000: sign 1, exponent 127. Rotated: exponent byte 0x7F on top, sign in bit 0."""
    split = bytearray(4)
    planes.split_planes(memoryview(np.float32(-1.0).tobytes()), memoryview(split), 4, True)
    assert bytes(split) == bytes([0x01, 0x00, 0x00, 0x7F])


@pytest.mark.parametrize("itemsize, a, b", [(4, 8, 12), (2, 7, 7), (3, 6, 6), (16, 32, 32)])
def test_lengths_and_sizes_that_do_not_fit_are_refused(kernel, itemsize, a, b):
    with pytest.raises(ValueError, match="byte planes"):
        planes.split_planes(memoryview(bytes(a)), memoryview(bytearray(b)), itemsize)
    with pytest.raises(ValueError, match="byte planes"):
        planes.join_planes([memoryview(bytes(a // max(1, itemsize)))] * itemsize, memoryview(bytearray(b)), itemsize)


def test_join_refuses_the_wrong_number_or_size_of_planes(kernel):
    with pytest.raises(ValueError, match="byte planes"):
        planes.join_planes([memoryview(bytes(4))] * 3, memoryview(bytearray(16)), 4)
    with pytest.raises(ValueError, match="byte planes"):
        planes.join_planes([memoryview(bytes(4))] * 3 + [memoryview(bytes(5))], memoryview(bytearray(16)), 4)


@pytest.mark.skipif(cpu_kernel.native is None, reason="the C extension's own argument checks")
def test_the_c_loops_check_their_arguments():
    native = cpu_kernel.native
    with pytest.raises(ValueError, match="4 planes|planes for"):
        native.join_planes([bytes(4)] * 3, bytearray(16), 4, False)
    with pytest.raises(ValueError, match="each plane holds"):
        native.join_planes([bytes(4)] * 3 + [bytes(5)], bytearray(16), 4, False)
    with pytest.raises(ValueError, match="element size"):
        native.split_planes(bytes(6), bytearray(6), 3, False)
    with pytest.raises(TypeError, match="sequence"):
        native.join_planes(7, bytearray(16), 4, False)
    with pytest.raises(TypeError, match="writable"):
        native.split_planes(bytes(8), bytes(8), 4, False)
