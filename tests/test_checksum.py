"""The CRC-32 every header, payload and raw tensor carries: the values zlib gives, faster."""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

from szformat.checksum import crc32, crc32_combine, tensor_crc32


def test_crc32_matches_zlib_from_any_starting_value():
    rng = random.Random()
    for size in [0, 1, 3, 15, 16, 17, 63, 64, 65, 4095, 4096, 4097, rng.randrange(1 << 20)]:
        data, start = os.urandom(size), rng.getrandbits(32)
        assert crc32(data) == zlib.crc32(data)
        assert crc32(data, start) == zlib.crc32(data, start)
        assert crc32(memoryview(data)[1:]) == zlib.crc32(data[1:])  # an unaligned view


def test_tensor_crc32_reads_the_bytes_of_a_view():
    data = torch.randint(0, 256, (10_001,), dtype=torch.uint8)
    piece = data[3:9_999]
    assert tensor_crc32(piece) == zlib.crc32(piece.numpy().tobytes())
    assert tensor_crc32(data[:0]) == 0 == zlib.crc32(b"")


def test_crc32_combine_matches_zlib_on_joined_bytes():
    rng = random.Random()
    for _ in range(200):
        a, b = os.urandom(rng.choice([0, 1, 7, 4096, rng.randrange(70_000)])), os.urandom(rng.randrange(70_000))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    for _ in range(20):  # lengths far past what can be materialised: joining must not depend on grouping
        x, y, z = (rng.getrandbits(32) for _ in range(3))
        ly, lz = rng.randrange(1 << 40), rng.randrange(1 << 40)
        assert crc32_combine(crc32_combine(x, y, ly), z, lz) == crc32_combine(x, crc32_combine(y, z, lz), ly + lz)
    with pytest.raises(ValueError, match="negative"):
        crc32_combine(0, 0, -1)
