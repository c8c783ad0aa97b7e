"""The CPU SplitZip codec: exact round trips, the frozen payload bytes, calibration, partial decodes, bad escapes.

Random cases draw a fresh seed each run and print it; a failure report shows ``seed=...`` to replay it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import random
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from szformat.checksum import crc32_function_address, crc32_join
from szformat.codec import CHUNK_SIZE, Codebook, PayloadLayout, codebook_from_histogram, cpu

from fakes import CorruptingKernels, flip_in_last_slice

pytestmark = pytest.mark.filterwarnings("error")  # e.g. PyTorch resizing an `out=` view: a slicing bug

ROOT = Path(__file__).resolve().parents[2]
MINILM_BF16 = (Path(os.environ.get("SZFORMAT_MINILM_DIR", "~/.cache/szformat/minilm")).expanduser()
               / "minilm-bf16" / "model.safetensors")


# ---------------------------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------------------------


BUILT = cpu._native


@pytest.fixture(autouse=True, params=["native", "reference"])
def kernel(request, monkeypatch) -> str:
    """Every test of this module runs with the C kernels (where the package was built with them) and with the
    PyTorch reference; both must give the same bytes as the expectations, so each other's."""
    if request.param == "native" and BUILT is None:
        pytest.skip("the C extension was not built here")
    monkeypatch.setattr(cpu, "_native", BUILT if request.param == "native" else None)
    return request.param


reference_only = pytest.mark.parametrize("kernel", ["reference"], indirect=True)
"""For a test of a path only the PyTorch reference has (its NumPy small-tensor encoder, its torch ops)."""


@pytest.fixture
def rng() -> random.Random:
    seed = random.SystemRandom().randrange(2**32)
    print(f"seed={seed}")
    return random.Random(seed)


@pytest.fixture(params=["default slices", "tiny slices"])
def slicing(request, monkeypatch) -> None:
    """Run each test with the default slice size and with 8-pair slices, so that small tensors cross many slice
    (and escape-scan block) boundaries."""
    if request.param == "tiny slices":
        monkeypatch.setattr(cpu, "SLICE_PAIRS", 8)


def from_bits(bits: list[int] | torch.Tensor) -> torch.Tensor:
    """A bfloat16 tensor with the given 16-bit patterns."""
    if not isinstance(bits, torch.Tensor):
        bits = torch.tensor([b - 0x10000 if b & 0x8000 else b for b in bits], dtype=torch.int16)
    return bits.to(torch.int16).view(torch.bfloat16)


def random_bits(rng: random.Random, n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(rng.randrange(2**63))
    return torch.randint(-32768, 32768, (n,), dtype=torch.int16, generator=gen).view(torch.bfloat16)


def weight_like(rng: random.Random, n: int, scale: float = 0.02) -> torch.Tensor:
    """Normal values: about 16 exponents cover them, with a thin tail of escapes."""
    gen = torch.Generator().manual_seed(rng.randrange(2**63))
    return (torch.randn(n, generator=gen) * scale).to(torch.bfloat16)


def assert_round_trip(x: torch.Tensor, codebook: Codebook | None = None):
    """Encode, decode the whole tensor, compare bits; returns what ``encode`` returned."""
    payload, layout, codebook = cpu.encode(x, codebook)
    assert payload.dtype == torch.uint8 and payload.numel() == layout.comp_bytes
    decoded = cpu.decode(payload, layout, codebook)
    assert torch.equal(decoded.view(torch.int16), x.reshape(-1).view(torch.int16))
    return payload, layout, codebook


def reference_payload(x: torch.Tensor, codebook: Codebook | None = None) -> tuple[bytes, Codebook]:
    """The payload written byte by byte in plain Python from the layout's definition, independent of the codec."""
    bits = [b & 0xFFFF for b in x.reshape(-1).view(torch.int16).tolist()]
    exponents = [(b >> 7) & 0xFF for b in bits]
    if codebook is None:
        counts = [0] * 256
        for e in exponents:
            counts[e] += 1
        ranked = sorted((e for e in range(256) if counts[e]), key=lambda e: (-counts[e], e))[:16]
        codebook = Codebook(tuple(ranked) + (0,) * (16 - len(ranked)), len(ranked),
                            sum(counts[e] for e in ranked) / len(bits) if bits else 1.0)
    code_of = {e: c for c, e in enumerate(codebook.dec_lut[: codebook.n_used])}
    codes = [code_of.get(e, 16) for e in exponents]
    escapes = [i for i, c in enumerate(codes) if c == 16]

    def pad4(data: bytes) -> bytes:
        return data + b"\0" * (-len(data) % 4)

    nibbles = [c & 0xF for c in codes] + [0] * (len(codes) % 2)
    pk = bytes((nibbles[i] << 4) | nibbles[i + 1] for i in range(0, len(nibbles), 2))
    sm = bytes(((b >> 8) & 0x80) | (b & 0x7F) for b in bits)
    chunk_id = b"".join(struct.pack("<i", i // 1024) for i in escapes)
    local_pos = b"".join(struct.pack("<H", i % 1024) for i in escapes)
    esc_val = bytes(exponents[i] for i in escapes)
    return pad4(pad4(pad4(pk) + sm) + chunk_id + local_pos) + esc_val, codebook


def special_values() -> list[int]:
    """+-0, +-Inf, NaNs with various payloads, subnormals, the extremes of the normal range."""
    return [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC0, 0x7F81, 0xFF81, 0x7FFF, 0xFFFF, 0x7FA5, 0xFFD3,
            0x0001, 0x8001, 0x007F, 0x807F, 0x0040, 0x0080, 0x8080, 0x7F7F, 0xFF7F, 0x3F80, 0xBF80]


# ---------------------------------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------------------------------


def test_every_bf16_bit_pattern_round_trips(slicing):
    x = from_bits(torch.arange(-32768, 32768, dtype=torch.int32))
    _, layout, codebook = assert_round_trip(x)
    assert codebook.n_used == 16 and layout.n_esc == 65536 - 16 * 256


def test_every_bit_pattern_shuffled_round_trips(rng):
    perm = torch.randperm(65536, generator=torch.Generator().manual_seed(rng.randrange(2**63)))
    assert_round_trip(from_bits(perm.to(torch.int32) - 32768))


def test_special_values_round_trip(slicing):
    specials = special_values()
    x = from_bits(specials * 37)  # odd length, repeated so some of them are in the codebook
    assert_round_trip(x)
    for value in specials:  # each alone: a single distinct exponent
        assert_round_trip(from_bits([value] * 5))


@pytest.mark.parametrize("n", [0, 1, 2, 3, 1023, 1024, 1025, 2049])
def test_sizes_round_trip(n, rng, slicing):
    payload, layout, _ = assert_round_trip(weight_like(rng, n))
    assert layout.n == n and layout.n_pairs == (n + 1) // 2
    assert_round_trip(random_bits(rng, n))


def test_random_odd_sizes_match_the_reference_bytes(rng, slicing):
    for _ in range(12):
        n = rng.randrange(1, 6000) | 1
        x = weight_like(rng, n, scale=rng.choice([1e-6, 0.02, 3.0, 1e5]))
        payload, _, codebook = assert_round_trip(x)
        expected, expected_codebook = reference_payload(x)
        assert codebook == expected_codebook
        assert bytes(payload.numpy()) == expected


def test_escape_heavy_tensor(rng, slicing):
    x = random_bits(rng, 4097)  # uniform bits: ~94% of the elements escape
    payload, layout, _ = assert_round_trip(x)
    assert layout.n_esc > 3500
    assert bytes(payload.numpy()) == reference_payload(x)[0]


def test_all_escape_tensor(rng, slicing):
    x = weight_like(rng, 3001)
    foreign = Codebook(dec_lut=(250,) + (0,) * 15, n_used=1, coverage=0.0)  # no element has exponent 250
    payload, layout, _ = assert_round_trip(x, foreign)
    assert layout.n_esc == 3001
    assert bytes(payload.numpy()) == reference_payload(x, foreign)[0]
    assert torch.equal(cpu.escape_positions(payload, layout), torch.arange(3001))


def test_empty_codebook_escapes_everything():
    x = from_bits([0x3F80, 0x4000, 0x0000])
    payload, layout, _ = assert_round_trip(x, Codebook(dec_lut=(0,) * 16, n_used=0, coverage=0.0))
    assert layout.n_esc == 3


def test_fewer_than_16_exponents(slicing):
    x = from_bits([0x3F80, 0x4000, 0x4080, 0xC000, 0x3F00] * 41)  # exponents 127, 128, 129, 128, 126
    payload, layout, codebook = assert_round_trip(x)
    assert codebook.n_used == 4 and codebook.dec_lut[4:] == (0,) * 12
    assert layout.n_esc == 0 and codebook.coverage == 1.0
    assert bytes(payload.numpy()) == reference_payload(x)[0]


def test_single_distinct_exponent(rng, slicing):
    mantissas = [rng.randrange(128) | (rng.randrange(2) << 15) for _ in range(777)]
    x = from_bits([(120 << 7) | m for m in mantissas])
    payload, layout, codebook = assert_round_trip(x)
    assert codebook.n_used == 1 and codebook.dec_lut[0] == 120 and layout.n_esc == 0
    assert bytes(payload[: layout.n_pairs].numpy()) == b"\0" * layout.n_pairs  # every code is 0


def test_non_contiguous_input_is_encoded_in_row_major_order(rng):
    x = weight_like(rng, 60 * 70).view(60, 70).t()
    payload, layout, codebook = cpu.encode(x)
    decoded = cpu.decode(payload, layout, codebook)
    assert torch.equal(decoded.view(torch.int16), x.contiguous().view(-1).view(torch.int16))


def test_encode_rejects_other_dtypes():
    with pytest.raises(TypeError, match="bfloat16"):
        cpu.encode(torch.zeros(4, dtype=torch.float16))


# ---------------------------------------------------------------------------------------------------------------
# The frozen layout
# ---------------------------------------------------------------------------------------------------------------


def test_golden_bytes_of_a_tiny_tensor():
    # 1.0, 2.0, 1.0, -1.0, the smallest subnormal: exponents 127, 128, 127, 127, 0.
    # Codebook by count, ties by smaller exponent: 127 (3), 0 (1), 128 (1). Codes 0, 2, 0, 0, 1.
    payload, layout, codebook = cpu.encode(from_bits([0x3F80, 0x4000, 0x3F80, 0xBF80, 0x0001]))
    assert codebook == Codebook(dec_lut=(127, 0, 128) + (0,) * 13, n_used=3, coverage=1.0)
    assert (layout.off_sm, layout.off_cid, layout.comp_bytes) == (4, 12, 12)
    assert bytes(payload.numpy()) == bytes([0x02, 0x00, 0x10, 0x00,  # pk: 0|2, 0|0, 1|pad, align
                                            0x00, 0x00, 0x00, 0x80, 0x01, 0x00, 0x00, 0x00])  # sm, align


def test_golden_bytes_with_escapes():
    x = from_bits([0x3F80] * 1030 + [0x4000])  # element 1030 (chunk 1, position 6) escapes
    payload, layout, _ = cpu.encode(x, Codebook(dec_lut=(127,) + (0,) * 15, n_used=1, coverage=1030 / 1031))
    assert layout.n_esc == 1 and layout.off_cid == 516 + 1032
    tail = bytes(payload[layout.off_cid:].numpy())
    assert tail == struct.pack("<i", 1) + struct.pack("<H", 6) + b"\0\0" + bytes([128])


def test_payload_padding_is_zero_even_in_a_dirty_buffer(rng):
    x = weight_like(rng, 1001)
    histogram = cpu.exponent_counts(x)
    codebook = codebook_from_histogram(histogram)
    layout = cpu.payload_layout(histogram, codebook)
    payload = torch.full((layout.comp_bytes + 5,), 0xAB, dtype=torch.uint8)
    cpu.encode_into(x, codebook, layout, payload)
    assert bytes(payload[: layout.comp_bytes].numpy()) == reference_payload(x)[0]
    assert bytes(payload[layout.comp_bytes:].numpy()) == b"\xab" * 5  # nothing written past the payload


def test_encode_into_a_buffer_at_an_odd_offset(rng):
    x = random_bits(rng, 2001)  # many escapes: the int32 and uint16 streams land at odd addresses
    histogram = cpu.exponent_counts(x)
    codebook = codebook_from_histogram(histogram)
    layout = cpu.payload_layout(histogram, codebook)
    buffer = torch.zeros(layout.comp_bytes + 1, dtype=torch.uint8)
    cpu.encode_into(x, codebook, layout, buffer[1:])
    assert bytes(buffer[1:].numpy()) == reference_payload(x)[0] and int(buffer[0]) == 0


def test_unused_codes_decode_to_exponent_zero():
    codebook = Codebook(dec_lut=(127,) + (0,) * 15, n_used=1, coverage=1.0)
    layout = PayloadLayout(n=2, n_esc=0)
    payload = torch.tensor([0x5F, 0, 0, 0, 0x01, 0x81, 0, 0], dtype=torch.uint8)  # codes 5 and 15
    assert cpu.decode(payload, layout, codebook).view(torch.int16).tolist() == [0x0001, 0x8001 - 0x10000]


# ---------------------------------------------------------------------------------------------------------------
# Calibration
# ---------------------------------------------------------------------------------------------------------------


def test_exponent_counts_match_the_plain_histogram(rng, slicing):
    for n in (0, 1, 2, 17, 4099):
        x = weight_like(rng, n, scale=rng.choice([1e-3, 1.0, 1e4]))
        assert torch.equal(cpu.exponent_counts(x), torch.bincount(cpu.split_bf16(x)[0].reshape(-1), minlength=256))


def test_tie_rule_prefers_smaller_exponents():
    histogram = [0] * 256
    for e in (200, 3, 90, 17):
        histogram[e] = 5  # a four-way tie
    histogram[100] = 9
    codebook = codebook_from_histogram(histogram)
    assert codebook.dec_lut[:5] == (100, 3, 17, 90, 200) and codebook.n_used == 5
    assert codebook_from_histogram(torch.tensor(histogram)) == codebook


def test_tie_at_the_16th_place_keeps_the_smaller_exponent():
    histogram = [0] * 256
    for e in range(15):
        histogram[e + 100] = 50 - e
    histogram[40], histogram[30], histogram[250] = 7, 7, 7  # three-way tie for the last code
    codebook = codebook_from_histogram(histogram)
    assert codebook.dec_lut == tuple(range(100, 115)) + (30,)
    assert codebook.coverage == pytest.approx((sum(range(36, 51)) + 7) / (sum(range(36, 51)) + 21))


def test_calibration_is_deterministic_under_permutation(rng):
    x = weight_like(rng, 50_000)
    perm = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(rng.randrange(2**63)))
    assert cpu.calibrate(x) == cpu.calibrate(x[perm])
    assert torch.equal(cpu.encode(x)[0], cpu.encode(x.clone())[0])


def test_coverage_values():
    x = from_bits([(e << 7) for e in range(20) for _ in range(e + 1)])  # exponent e appears e + 1 times
    codebook = cpu.calibrate(x)
    assert codebook.dec_lut == tuple(range(19, 3, -1)) and codebook.n_used == 16
    assert codebook.coverage == pytest.approx(sum(range(5, 21)) / sum(range(1, 21)))
    _, layout, _ = assert_round_trip(x)
    assert layout.n_esc == sum(range(1, 5))
    assert cpu.calibrate(from_bits([0x3F80] * 9)).coverage == 1.0
    assert cpu.calibrate(from_bits([])).coverage == 1.0


def test_payload_layout_counts_escapes_of_a_given_codebook(rng):
    x = weight_like(rng, 5000)
    other = cpu.calibrate(weight_like(rng, 5000, scale=50.0))
    histogram = cpu.exponent_counts(x)
    layout = cpu.payload_layout(histogram, other)
    payload, encoded_layout, _ = assert_round_trip(x, other)
    assert layout == encoded_layout and layout.n_esc > 0


def test_encode_into_refuses_a_layout_that_does_not_fit(rng):
    x = weight_like(rng, 100)
    codebook = cpu.calibrate(x)
    layout = cpu.payload_layout(cpu.exponent_counts(x), codebook)
    with pytest.raises(ValueError, match="elements"):
        cpu.encode_into(x[:99], codebook, layout, torch.empty(layout.comp_bytes, dtype=torch.uint8))
    with pytest.raises(ValueError, match="needs"):
        cpu.encode_into(x, codebook, layout, torch.empty(layout.comp_bytes - 1, dtype=torch.uint8))
    wrong = PayloadLayout(n=100, n_esc=layout.n_esc + 1)
    with pytest.raises(ValueError, match="escapes"):
        cpu.encode_into(x, codebook, wrong, torch.empty(wrong.comp_bytes, dtype=torch.uint8))
    x[[3, 50]] = from_bits([0x7F80, 0x7FC1])  # two escapes, a layout that counts one: nothing written past it
    fewer = PayloadLayout(n=100, n_esc=1)
    payload = torch.full((fewer.comp_bytes + 16,), 0xAB, dtype=torch.uint8)
    with pytest.raises(ValueError, match="leaves 2 escapes, the layout expects 1"):
        cpu.encode_into(x, codebook, fewer, payload)
    assert (payload[fewer.comp_bytes:] == 0xAB).all()


# ---------------------------------------------------------------------------------------------------------------
# The round-trip check inside the encoder
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stream, mask", [("sm", 0x80), ("sm", 0x01), ("pk", 0x01), ("pk", 0x10)])
def test_a_wrong_byte_written_by_the_sliced_encoder_is_caught(stream, mask, rng, monkeypatch):
    monkeypatch.setattr(cpu, "SLICE_PAIRS", 64)
    monkeypatch.setattr(cpu, "WHOLE_ENCODE_ELEMENTS", 0)  # the sliced path, which larger tensors take
    x = weight_like(rng, 5001)
    pairs_left = flip_in_last_slice(monkeypatch, 5001 // 2, stream, mask)
    with pytest.raises(cpu.RoundTripMismatch, match="does not decode bit for bit"):
        cpu.encode(x)
    assert pairs_left == [0]  # the wrong byte was in the last of 40 slices


def test_a_wrong_code_is_not_taken_for_an_escape(rng, monkeypatch, kernel):
    """An element of the codebook given a wrong code decodes wrong; the encoder finds escapes as the elements that
    do not decode, and must not count that one among them (the layout would then look miscounted)."""
    x = weight_like(rng, 100_000)
    codebook = cpu.calibrate(x)
    real_table, real_codes = cpu._pair_code_table, cpu._exponent_codes

    def wrong_table(dec_lut, n_used):  # the reference's pair table
        table = real_table(dec_lut, n_used).clone()
        table[codebook.dec_lut[0] | codebook.dec_lut[0] << 8] ^= 0x11  # the most frequent pair gets codes 1, 1
        return table

    def wrong_codes(dec_lut, n_used):  # the C kernel's exponent table
        codes = real_codes(dec_lut, n_used).copy()
        codes[codebook.dec_lut[0]] = 1  # the most frequent exponent gets code 1
        return codes

    if kernel == "native":
        monkeypatch.setattr(cpu, "_exponent_codes", wrong_codes)
    else:
        monkeypatch.setattr(cpu, "_pair_code_table", wrong_table)
    with pytest.raises(cpu.RoundTripMismatch, match="element"):
        cpu.encode(x, codebook)


@pytest.mark.parametrize("where", ["chunk_id", "local_pos", "esc_val", "odd last element"])
def test_a_wrong_byte_in_what_the_slices_leave_is_caught(where, rng, monkeypatch, slicing):
    """Bytes the slice-by-slice check does not cover (the escape streams, the odd last element) are checked on the
    finished payload."""
    monkeypatch.setattr(cpu, "WHOLE_ENCODE_ELEMENTS", 0)  # the sliced path, which larger tensors take
    x = weight_like(rng, 3 * CHUNK_SIZE + 1, scale=0.5)
    codebook = cpu.calibrate(x)
    x[[5, 700, 2 * CHUNK_SIZE + 9]] = from_bits([0x7F80, 0x7FC1, 0x4F00])  # escapes in three chunks
    real = cpu._check_stored

    def corrupt_then_check(payload, layout, *args):
        assert layout.n_esc >= 3
        offset = {"chunk_id": layout.off_cid + 4, "local_pos": layout.off_lpos + 2, "esc_val": layout.off_ev + 1,
                  "odd last element": layout.off_sm + layout.n - 1}[where]
        payload[offset] ^= 0x01
        real(payload, layout, *args)

    monkeypatch.setattr(cpu, "_check_stored", corrupt_then_check)
    with pytest.raises(cpu.RoundTripMismatch, match="does not decode bit for bit"):
        cpu.encode(x, codebook)


@pytest.mark.parametrize("where, mask", [("pk", 0x01), ("pk", 0x10), ("sm", 0x80), ("sm", 0x01), ("chunk_id", 0x01),
                                         ("local_pos", 0x01), ("esc_val", 0x01), ("odd last element", 0x20)])
def test_a_wrong_byte_written_by_the_whole_encoder_is_caught(where, mask, rng, monkeypatch, kernel):
    """A small tensor is encoded by one C call and checked by decoding the whole payload: a wrong byte in any stream
    is a RoundTripMismatch, never a payload handed on."""
    if kernel == "reference":
        pytest.skip("the C kernels' whole-payload encoder")
    x = weight_like(rng, 3 * CHUNK_SIZE + 1, scale=0.5)
    codebook = cpu.calibrate(x)
    x[[5, 700, 2 * CHUNK_SIZE + 9]] = from_bits([0x7F80, 0x7FC1, 0x4F00])  # escapes in three chunks
    offsets = {"pk": lambda o: o.off_pk + 100, "sm": lambda o: o.off_sm + 1000, "chunk_id": lambda o: o.off_cid + 4,
               "local_pos": lambda o: o.off_lpos + 2, "esc_val": lambda o: o.off_ev + 1,
               "odd last element": lambda o: o.off_pk + o.n // 2}
    monkeypatch.setattr(cpu, "_native", CorruptingKernels(offsets[where], mask))
    with pytest.raises(cpu.RoundTripMismatch, match="does not decode bit for bit"):
        cpu.encode(x, codebook)


def test_escape_streams_the_whole_encoder_broke_are_named(rng, monkeypatch, kernel):
    """A local position written past its chunk fails the decoder's own stream checks, and the error says so."""
    if kernel == "reference":
        pytest.skip("the C kernels' whole-payload encoder")
    x = weight_like(rng, 3 * CHUNK_SIZE + 1, scale=0.5)
    codebook = cpu.calibrate(x)
    x[[5, 700]] = from_bits([0x7F80, 0x7FC1])
    monkeypatch.setattr(cpu, "_native", CorruptingKernels(lambda o: o.off_lpos + 3, 0x80))  # local 700 + 32768
    with pytest.raises(cpu.RoundTripMismatch, match=r"\(escape streams: escape local position 33468 is outside"):
        cpu.encode(x, codebook)


@pytest.mark.parametrize("n", [0, 1, 2, 1023, 4097])
def test_the_whole_encoder_writes_the_slice_encoders_bytes(n, rng, monkeypatch, kernel):
    """Both paths of the C kernels give the same payload, padding and escape streams included."""
    if kernel == "reference":
        pytest.skip("compares two paths of the C kernels")
    x = weight_like(rng, n, scale=0.5)
    if n:
        x[torch.randint(0, n, (max(1, n // 40),))] = from_bits([0x7F80])
    codebook = cpu.calibrate(weight_like(rng, 1000))  # another tensor's: escapes in every chunk
    whole, layout, _ = cpu.encode(x, codebook)
    monkeypatch.setattr(cpu, "WHOLE_ENCODE_ELEMENTS", 0)
    sliced, sliced_layout, _ = cpu.encode(x, codebook)
    assert layout == sliced_layout and torch.equal(whole, sliced)


@reference_only
def test_a_wrong_byte_written_by_the_small_encoder_is_caught(rng, monkeypatch):
    real = cpu._encode_small

    def wrong(bits, codebook, pk, sm):
        position = real(bits, codebook, pk, sm)
        sm[len(sm) // 2] ^= 0x40
        return position

    monkeypatch.setattr(cpu, "_encode_small", wrong)
    with pytest.raises(cpu.RoundTripMismatch, match="elements 0 to 999"):
        cpu.encode(weight_like(rng, 1000))


# ---------------------------------------------------------------------------------------------------------------
# Partial decodes and the out= path
# ---------------------------------------------------------------------------------------------------------------


def test_partial_decodes_match_slices(rng, slicing):
    x = weight_like(rng, 3 * CHUNK_SIZE + 77, scale=0.5)
    codebook = cpu.calibrate(x)
    x[rng.sample(range(x.numel()), 40)] = from_bits([0x0001, 0x7FC1, 0xFF80, 0x4F00] * 10)  # escape with codebook
    payload, layout, codebook = assert_round_trip(x, codebook)
    escapes = cpu.escape_positions(payload, layout).tolist()
    assert len(escapes) >= 40
    bits = x.view(torch.int16)
    edges = [0, 1, 2, 3, CHUNK_SIZE - 1, CHUNK_SIZE, CHUNK_SIZE + 1, 2 * CHUNK_SIZE + 3, x.numel() - 1, x.numel()]
    ranges = [(a, b) for a in edges for b in edges if a <= b]
    ranges += [(e, e + 1) for e in escapes[:5]] + [(e - 3, e + 4) for e in escapes[5:10] if e >= 3]
    for _ in range(60):
        a = rng.randrange(x.numel() + 1)
        ranges.append((a, rng.randrange(a, x.numel() + 1)))
    for a, b in ranges:
        decoded = cpu.decode(payload, layout, codebook, start=a, stop=b)
        assert torch.equal(decoded.view(torch.int16), bits[a:b]), (a, b)


def test_decode_into_out_views_at_any_offset(rng, slicing):
    x = weight_like(rng, 2001)
    payload, layout, codebook = cpu.encode(x)
    bits = x.view(torch.int16)
    for offset in (0, 1, 2, 3):
        for a, b in ((0, 2001), (1, 2000), (2, 1999), (7, 8)):
            buffer = torch.full((b - a + 8,), 7, dtype=torch.int16)
            out = buffer[offset: offset + b - a].view(torch.bfloat16)
            returned = cpu.decode(payload, layout, codebook, start=a, stop=b, out=out)
            assert returned is out
            assert torch.equal(buffer[offset: offset + b - a], bits[a:b]), (offset, a, b)
            assert (buffer[:offset] == 7).all() and (buffer[offset + b - a:] == 7).all()


def test_decode_from_a_payload_at_an_odd_offset(rng):
    x = random_bits(rng, 3001)
    payload, layout, codebook = cpu.encode(x)
    assert layout.n_esc > 0
    shifted = torch.zeros(payload.numel() + 1, dtype=torch.uint8)
    shifted[1:] = payload
    decoded = cpu.decode(shifted[1:], layout, codebook)
    assert torch.equal(decoded.view(torch.int16), x.view(torch.int16))


@reference_only
def test_decode_runs_its_torch_ops_on_one_intra_op_thread_and_restores_the_setting(rng, monkeypatch):
    seen = []
    real = torch.index_select

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    x = weight_like(rng, 5000)
    payload, layout, codebook = cpu.encode(x)
    monkeypatch.setattr(torch, "index_select", spy)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        decoded = cpu.decode(payload, layout, codebook)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
    assert torch.equal(decoded.view(torch.int16), x.view(torch.int16))


def test_one_intra_op_thread_nests_and_leaves_a_single_thread_setting_alone():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with cpu.one_intra_op_thread():
            assert torch.get_num_threads() == 1
            with cpu.one_intra_op_thread():
                assert torch.get_num_threads() == 1
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 2
        torch.set_num_threads(1)
        with cpu.one_intra_op_thread():
            assert torch.get_num_threads() == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.fixture(params=["checksums in the kernel", "checksums apart"])
def checksums_in_kernel(request, kernel, monkeypatch) -> None:
    """Checked ranges decoded by the C call that checksums block by block (where it is built and has zlib-ng's
    CRC-32), and by the decode followed by the checksums of the whole range."""
    in_kernel = request.param == "checksums in the kernel"
    if in_kernel and not (kernel == "native" and cpu.cpu_kernel.checksums_in_kernel()):
        pytest.skip("the C kernels do not take checksums here")
    monkeypatch.setattr(cpu.cpu_kernel, "checksums_in_kernel", lambda: in_kernel)


@pytest.mark.parametrize("n", [0, 1, 2, 7, 2 * CHUNK_SIZE + 1, 9001, 4 * 8192 + 1, 70_002])
def test_checked_ranges_join_to_the_checksums_of_the_payload_and_of_the_tensor(n, rng, slicing, checksums_in_kernel):
    """Ranges cut at random even elements, across the C call's blocks of 8,192 pairs; escapes at the start and
    scattered, so blocks hold none, one or many."""
    x = weight_like(rng, n, scale=0.5)
    specials = from_bits(special_values())
    x[: min(n, specials.numel())] = specials[: n]  # subnormals, NaN, Inf: escapes, most of them
    for _ in range(n // 500):
        x[rng.randrange(n)] = specials[rng.randrange(specials.numel())]
    payload, layout, codebook = cpu.encode(x, cpu.calibrate(weight_like(rng, 1000)))
    decoder = cpu.PayloadDecoder(payload, layout, codebook)
    cuts = sorted({0, n} | {2 * rng.randrange(n // 2 + 1) for _ in range(5)})
    out = torch.empty(n, dtype=torch.bfloat16)
    ranges = [(a, b, decoder.decode_checked(a, b, out[a:b])) for a, b in zip(cuts, cuts[1:])] or \
        [(0, 0, decoder.decode_checked(0, 0, out))]
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))
    assert decoder.stored_crc(ranges) == zlib.crc32(payload.numpy().tobytes())
    assert crc32_join((c.raw, 2 * (b - a)) for a, b, c in ranges) == zlib.crc32(x.view(torch.uint8).numpy().tobytes())
    if len(ranges) > 1:
        with pytest.raises(ValueError, match="gap or overlap"):
            decoder.stored_crc(ranges[1:])
    with pytest.raises(ValueError, match="even element"):
        decoder.decode_checked(1, n, torch.empty(max(0, n - 1), dtype=torch.bfloat16))


@pytest.mark.parametrize("n", [0, 1, 2, 7, 2 * CHUNK_SIZE + 1, 9001, 70_002])
def test_a_decoder_of_the_bytes_around_the_streams_decodes_and_checks_as_one_of_the_whole_payload(
        n, rng, checksums_in_kernel):
    """What a load decodes a large tensor with: only the padding between the streams and the escape streams in a
    buffer of their own, each range handed its streams (copies here: the whole payload is never read)."""
    x = weight_like(rng, n, scale=0.5)
    specials = from_bits(special_values())
    for _ in range(n // 300 + 1):
        if n:
            x[rng.randrange(n)] = specials[rng.randrange(specials.numel())]
    payload, layout, codebook = cpu.encode(x, cpu.calibrate(weight_like(rng, 1000)))
    data = payload.numpy()
    around = torch.from_numpy(np.concatenate((data[layout.n_pairs: layout.off_sm], data[layout.off_sm + n:])))
    whole = cpu.PayloadDecoder(payload, layout, codebook)
    decoder = cpu.PayloadDecoder.around_streams(around.clone(), layout, codebook)
    assert np.array_equal(decoder.position, whole.position) and np.array_equal(decoder.esc_val, whole.esc_val)
    cuts = sorted({0, n} | {2 * rng.randrange(n // 2 + 1) for _ in range(4)})
    out = torch.full((n,), 7.0, dtype=torch.bfloat16)
    pieces = list(zip(cuts, cuts[1:])) or [(0, 0)]
    ranges = [(a, b, decoder.decode_checked(a, b, out[a:b], streams=tuple(s.clone() for s in whole.streams(a, b))))
              for a, b in pieces]
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))
    assert decoder.stored_crc(ranges) == zlib.crc32(data.tobytes())
    with pytest.raises(ValueError, match="given its streams"):
        decoder.decode(0, n, out)
    if layout.n_esc:
        with pytest.raises(ValueError, match=f"needs {around.numel()}"):
            cpu.PayloadDecoder.around_streams(around[:-1], layout, codebook)
        data[layout.off_lpos: layout.off_lpos + 2] = 0xFF  # a local position past its chunk, refused alike
        around[layout.off_lpos - n - layout.n_pairs:][:2] = 0xFF  # payload byte p past sm: around's p - n - n_pairs
        with pytest.raises(ValueError) as from_whole:
            cpu.PayloadDecoder(payload, layout, codebook)
        with pytest.raises(ValueError) as from_around:
            cpu.PayloadDecoder.around_streams(around, layout, codebook)
        assert str(from_around.value) == str(from_whole.value) and "local position" in str(from_whole.value)


@pytest.mark.parametrize("n", [0, 1, 9001, 4 * 8192 + 3])
def test_a_whole_payload_decoded_with_its_crc(n, rng, checksums_in_kernel):
    x = weight_like(rng, n, scale=0.5)
    for _ in range(n // 300):
        x[rng.randrange(n)] = from_bits([[0x0001, 0x7FC1, 0xFF80][rng.randrange(3)]])[0]  # subnormal, NaN, -Inf
    payload, layout, codebook = cpu.encode(x)
    out = torch.full((n,), 3.0, dtype=torch.bfloat16)
    crc = cpu.decode_with_crc(payload, layout, codebook, out)
    assert torch.equal(out.view(torch.int16), x.view(torch.int16))
    assert crc == zlib.crc32(x.view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize("kernel", ["native"], indirect=True)
@pytest.mark.parametrize("n", [1, 2, 9001, 4 * 8192 + 1, 70_003])
def test_ranges_decoded_by_one_call_from_a_mapping_give_the_reference_bits(n, rng, tmp_path):
    """What a load runs on the in-memory form: ranges cut at random even elements, their pk and sm bytes views of
    the file's mapping, decoded with and without checksums."""
    import mmap

    x = weight_like(rng, n, scale=0.5)
    specials = from_bits(special_values())
    for _ in range(n // 400 + 1):
        x[rng.randrange(n)] = specials[rng.randrange(specials.numel())]
    payload, layout, codebook = cpu.encode(x, cpu.calibrate(weight_like(rng, 1000)))
    assert layout.n_esc > 0
    path = tmp_path / "payload.bin"
    path.write_bytes(b"\0" * 4096 + payload.numpy().tobytes())
    decoder = cpu.PayloadDecoder(payload, layout, codebook)
    cuts = sorted({0, n} | {2 * rng.randrange(n // 2 + 1) for _ in range(4)})
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
        view = memoryview(mapping)[4096:]
        for checksums in [False] + [True] * cpu.cpu_kernel.checksums_in_kernel():
            out = torch.full((n,), 7.0, dtype=torch.bfloat16)
            ranges = []
            for a, b in zip(cuts, cuts[1:]):
                streams = (view[layout.off_pk + a // 2: layout.off_pk + (b + 1) // 2],
                           view[layout.off_sm + a: layout.off_sm + b])
                ranges.append((a, b, decoder.decode_range(a, b, out[a:b], streams, checksums=checksums)))
            assert torch.equal(out.view(torch.int16), x.view(torch.int16))
            if checksums:
                assert decoder.stored_crc(ranges) == zlib.crc32(payload.numpy().tobytes())
            else:
                assert all(sums is None for _, _, sums in ranges)
        del view, streams


@pytest.mark.parametrize("kernel", ["native"], indirect=True)
@pytest.mark.parametrize("threads", [1, 3])
def test_payloads_decoded_by_one_call_from_a_mapping_give_the_reference_bits_and_errors(rng, tmp_path, threads):
    """What a load runs: whole payloads, views of a file's mapping, decoded by one call with and without checksums,
    on one thread and on three (one payload larger than a unit, so its ranges are shared); a payload whose escape
    streams break a rule gets the reference's message and leaves the others decoded, a large one too."""
    import mmap

    specials = from_bits(special_values())
    unit = cpu._native.UNIT_ELEMENTS
    tensors = [weight_like(rng, n, scale=0.5)
               for n in (0, 1, 7, 2 * CHUNK_SIZE + 1, 9001, 4 * 8192 + 3, unit + 3, 2 * unit + 1)]
    for x in tensors[2:]:
        for _ in range(x.numel() // 300 + 1):
            x[rng.randrange(x.numel())] = specials[rng.randrange(specials.numel())]
    foreign = Codebook(dec_lut=(250,) + (0,) * 15, n_used=1, coverage=0.0)  # every element escapes
    encoded = [cpu.encode(x) for x in tensors] + [cpu.encode(weight_like(rng, 3001), foreign)]
    tensors.append(cpu.decode(*encoded[-1]))
    broken = bytearray(encoded[4][0].numpy().tobytes())  # its first escape's local position past its chunk
    assert encoded[4][1].n_esc > 0
    broken[encoded[4][1].off_cid + 4 * encoded[4][1].n_esc: encoded[4][1].off_cid + 4 * encoded[4][1].n_esc + 2] = \
        struct.pack("<H", CHUNK_SIZE)
    with pytest.raises(ValueError) as refused:
        cpu.decode(torch.frombuffer(bytearray(broken), dtype=torch.uint8), *encoded[4][1:])
    large, large_layout, _ = encoded[-2]  # escapes out of order in a payload cut into ranges
    broken_large = bytearray(large.numpy().tobytes())
    assert large_layout.n_esc > 1
    cid, lpos = large_layout.off_cid, large_layout.off_lpos  # its second escape where its first is
    broken_large[cid + 4: cid + 8], broken_large[lpos + 2: lpos + 4] = broken_large[cid: cid + 4], \
        broken_large[lpos: lpos + 2]
    with pytest.raises(ValueError) as refused_large:
        cpu.decode(torch.frombuffer(bytearray(broken_large), dtype=torch.uint8), *encoded[-2][1:])
    blobs = [payload.numpy().tobytes() for payload, _, _ in encoded] + [bytes(broken), bytes(broken_large)]
    offsets = [4096 * (1 + sum(-(-len(b) // 4096) for b in blobs[:k])) for k in range(len(blobs))]
    path = tmp_path / "payloads.bin"
    with open(path, "wb") as f:
        for offset, blob in zip(offsets, blobs):
            f.seek(offset)
            f.write(blob)
    layouts = [(layout, codebook) for _, layout, codebook in encoded] + [encoded[4][1:], encoded[-2][1:]]
    expected = tensors + [refused, refused_large]
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
        views = [memoryview(mapping)[o: o + len(b)] for o, b in zip(offsets, blobs)]
        for checksums in [False] + [True] * cpu.cpu_kernel.checksums_in_kernel():
            outs = [torch.full((layout.n,), 7.0, dtype=torch.bfloat16) for layout, _ in layouts]
            results = cpu.decode_payloads([(v, layout, codebook, out) for v, (layout, codebook), out
                                           in zip(views, layouts, outs)], checksums=checksums, threads=threads)
            for x, out, blob, (stored, decoded, error) in zip(expected, outs, blobs, results):
                assert stored == (zlib.crc32(blob) if checksums else 0)
                if not isinstance(x, torch.Tensor):
                    assert (decoded, error) == (0, str(x.value))
                    assert torch.equal(out, torch.full_like(out, 7.0))  # left unwritten
                    continue
                assert error is None
                assert torch.equal(out.view(torch.int16), x.view(torch.int16))
                assert decoded == (zlib.crc32(x.view(torch.uint8).numpy().tobytes()) if checksums else 0)
        del views


@pytest.mark.parametrize("kernel", ["native"], indirect=True)
def test_a_page_lost_under_payloads_decoded_together_names_the_payload_it_was_on(rng, tmp_path):
    """A file that shrinks under a call of several mapped payloads: an EOFError (never SIGBUS) whose ``item`` is the
    first payload the file no longer holds, through the tensor outputs' call, the torch-free one and the check
    ``verify`` uses."""
    if not cpu._native.guards_mapped_reads():
        pytest.skip("the C kernels do not guard mapped reads here")
    encoded = [cpu.encode(weight_like(rng, n)) for n in (5000, 7001, 3000)]
    blobs = [payload.numpy().tobytes() for payload, _, _ in encoded]
    path = tmp_path / "payloads.bin"
    with open(path, "wb") as f:
        for k, blob in enumerate(blobs):
            f.seek(4096 * 4 * k)
            f.write(blob)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
        views = [memoryview(mapping)[4096 * 4 * k: 4096 * 4 * k + len(b)] for k, b in enumerate(blobs)]
        os.truncate(path, 4096 * 4)  # the second and third payloads' pages are gone
        outs = [torch.empty(layout.n, dtype=torch.bfloat16) for _, layout, _ in encoded]
        with pytest.raises(EOFError) as lost:
            cpu.decode_payloads([(v, layout, codebook, out) for v, (_, layout, codebook), out
                                 in zip(views, encoded, outs)], checksums=False)
        assert lost.value.item == 1
        assert torch.equal(outs[0].view(torch.int16), cpu.decode(*encoded[0]).view(torch.int16))
        with pytest.raises(EOFError) as lost:  # on threads: whichever of the lost payloads a thread met first
            cpu.decode_payloads([(v, layout, codebook, out) for v, (_, layout, codebook), out
                                 in zip(views, encoded, outs)], checksums=False, threads=3)
        assert lost.value.item in (1, 2)
        buffers = [bytearray(2 * layout.n) for _, layout, _ in encoded]
        with pytest.raises(EOFError) as lost:
            cpu.cpu_kernel.decode_payloads(cpu._native, [(v, layout, codebook, out) for v, (_, layout, codebook), out
                                                         in zip(views, encoded, buffers)], checksums=False)
        assert lost.value.item == 1
        if cpu.cpu_kernel.checksums_in_kernel():
            with pytest.raises(EOFError) as lost:
                cpu.cpu_kernel.check_payloads(cpu._native, [(v, layout, codebook)
                                                            for v, (_, layout, codebook) in zip(views, encoded)])
            assert lost.value.item == 1
        del views, lost  # the error's frames hold views of the mapping too


@pytest.mark.parametrize("kernel", ["native"], indirect=True)
@pytest.mark.parametrize("lost_from", ["escape streams", "a middle range"])
def test_a_page_lost_under_a_payload_cut_into_ranges_names_it_on_every_thread(rng, tmp_path, lost_from):
    """A payload of more than a unit shrinks under the call: its escape streams (read before any range is taken) or
    the pages of one of its later ranges are gone; on one thread or four, an EOFError naming it, never SIGBUS."""
    if not cpu._native.guards_mapped_reads():
        pytest.skip("the C kernels do not guard mapped reads here")
    unit = cpu._native.UNIT_ELEMENTS
    escapes = lost_from == "escape streams"  # read before any range: without them, the ranges' pages are the first
    x = weight_like(rng, 3 * unit + 7) if escapes else (torch.rand(3 * unit + 7) + 1).to(torch.bfloat16)
    small, large = cpu.encode(weight_like(rng, 5000)), cpu.encode(x)
    assert (large[1].n_esc > 0) == escapes
    blobs = [small[0].numpy().tobytes(), large[0].numpy().tobytes()]
    path = tmp_path / "payloads.bin"
    path.write_bytes(blobs[0].ljust(4096 * 4, b"\0") + blobs[1])
    kept = large[1].off_cid if escapes else large[1].off_sm + 2 * unit
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapping:
        views = [memoryview(mapping)[: len(blobs[0])], memoryview(mapping)[4096 * 4:]]
        os.truncate(path, (4096 * 4 + kept) // 4096 * 4096)
        for threads in (1, 4):
            for checksums in [False] + [True] * cpu.cpu_kernel.checksums_in_kernel():
                outs = [torch.empty(layout.n, dtype=torch.bfloat16) for layout in (small[1], large[1])]
                with pytest.raises(EOFError) as lost:
                    cpu.decode_payloads([(v, layout, codebook, out) for v, (_, layout, codebook), out
                                         in zip(views, (small, large), outs)], checksums=checksums, threads=threads)
                assert lost.value.item == 1
                if checksums:
                    with pytest.raises(EOFError) as lost:
                        cpu.cpu_kernel.check_payloads(cpu._native, [(v, layout, codebook) for v, (_, layout, codebook)
                                                                    in zip(views, (small, large))])
                    assert lost.value.item == 1
        del views, lost


@pytest.mark.parametrize("kernel", ["native"], indirect=True)
def test_checked_decodes_refuse_to_run_before_the_crc32_functions_are_handed_over():
    """In a fresh process nothing has handed zlib-ng's functions to the kernels yet: a checked call says so instead of
    calling a null pointer; an unchecked one runs."""
    script = ("import numpy as np\n"
              "from szformat.codec import _native\n"
              "lut, progress = bytes(range(16)), np.zeros(1, dtype=np.int64)\n"
              "item = (bytes(8), lut, bytearray(8), 0, 1024)\n"
              "print(_native.decode_payloads([item], False, progress, 0, 1, False))\n"
              "for call in (lambda: _native.decode_payloads([item], True, progress, 0, 1, False),\n"
              "             lambda: _native.decode_range(bytes(2), bytes(4), lut, bytearray(8),\n"
              "                                          np.zeros(0, dtype=np.int64), b'', True)):\n"
              "    try:\n"
              "        call()\n"
              "    except RuntimeError as e:\n"
              "        print(e)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.stdout.splitlines() == ["[(0, 0, None)]", "decode_payloads(): no CRC-32 function (use_crc32)",
                                        "decode_range(): no CRC-32 function (use_crc32)"], done.stderr


@pytest.mark.parametrize("kernel", ["native"], indirect=True)
def test_the_payloads_kernel_refuses_bad_arguments():
    native = cpu._native
    lut, progress = bytes(range(16)), np.zeros(1, dtype=np.int64)
    item = (bytes(8), lut, bytearray(8), 0, 1024)  # 4 elements: 2 pk bytes, padded to 4, then 4 sm bytes
    assert native.decode_payloads([item, item], False, progress, 0, 2, False) == [(0, 0, None), (0, 0, None)]
    assert native.decode_payloads([], False, progress, 0, 1, False) == []
    assert native.decode_payloads([item], False, progress, 0, 1 << 40, False) == [(0, 0, None)]  # as many as it may
    with pytest.raises(TypeError, match="takes 6 arguments"):
        native.decode_payloads([item], False, progress, 0, 1)
    with pytest.raises(TypeError, match="item 1 must be a tuple of 5"):
        native.decode_payloads([item, item[:4]], False, progress, 0, 1, False)
    with pytest.raises(ValueError, match="decode_payloads"):
        native.decode_payloads([item, (bytes(7),) + item[1:]], False, progress, 0, 1, False)  # a payload too short
    with pytest.raises(ValueError, match="decode_payloads"):
        native.decode_payloads([(bytes(8), bytes(15)) + item[2:]], False, progress, 0, 1, False)  # a codebook of 15
    with pytest.raises(ValueError, match="progress must hold an int64"):
        native.decode_payloads([item], False, np.zeros(1, dtype=np.int32), 0, 1, False)
    with pytest.raises(ValueError, match="populate must be a byte count"):
        native.decode_payloads([item], False, progress, -1, 1, False)
    with pytest.raises(ValueError, match=r"decode_payloads\(\): threads must be >= 1"):
        native.decode_payloads([item], False, progress, 0, 0, False)
    with pytest.raises(TypeError, match=r"decode_payloads\(\): items must be a list or a tuple"):
        native.decode_payloads(5, False, progress, 0, 1, False)
    with pytest.raises(ValueError, match="contiguous bfloat16"):
        cpu.decode_payloads([(bytes(8), PayloadLayout(n=4, n_esc=0), Codebook(dec_lut=lut, n_used=16, coverage=1.0),
                              torch.empty(3, dtype=torch.bfloat16))], checksums=False)


def _resident_kb(address: int) -> int:
    """The kilobytes of the mapping that starts at ``address`` this process has in its page tables (``Rss`` in
    ``/proc/self/smaps``)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    start = next(k for k, line in enumerate(lines) if line.startswith(f"{address:x}-"))
    return next(int(line.split()[1]) for line in lines[start + 1:] if line.startswith("Rss:"))


def _address(mapping: mmap.mmap) -> int:
    view = np.frombuffer(mapping, dtype=np.uint8)
    try:
        return view.ctypes.data
    finally:
        del view  # the mapping cannot close while a view exports it


@pytest.mark.parametrize("kernel", ["native"], indirect=True)
@pytest.mark.parametrize("threads, checking", [(1, False), (2, False), (1, True)])
def test_payloads_decoded_with_release_leave_their_pages_of_the_mapping_unmapped(rng, threads, checking):
    """``release``: each unit's stored pages of a read-only file mapping are dropped from the process's page tables once
    decoded, so the close has next to nothing to unmap; the bytes stay the file's (read again, they are), the outputs
    the reference's; the same for ``verify``'s check. Anything but a view of a read-only mapping is refused before
    anything is written. The file is a memfd's, whose pages are 4 KiB (a file system's large folios, mapped 2 MiB at a
    time, come back whole when the next unit reads next to a dropped range)."""
    if sys.platform != "linux" or not hasattr(os, "memfd_create"):
        pytest.skip("page tables read through /proc/self/smaps, a memfd (Linux)")
    if checking and not cpu.cpu_kernel.checksums_in_kernel():  # also hands zlib-ng's CRC-32 over to the kernels
        pytest.skip("the kernels take no checksums here")
    unit = cpu._native.UNIT_ELEMENTS
    encoded = [cpu.encode(weight_like(rng, n)) for n in (300_000, 2 * unit + 7)]  # pages dropped 256 KiB or more
    blobs = [payload.numpy().tobytes() for payload, _, _ in encoded]
    starts = [0, -(-len(blobs[0]) // 4096) * 4096]
    fd = os.memfd_create("payloads")
    try:
        os.write(fd, blobs[0].ljust(starts[1], b"\0") + blobs[1])
        for release in (False, True):
            with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapping:
                address = _address(mapping)
                assert bytes(mapping) == blobs[0].ljust(starts[1], b"\0") + blobs[1]  # every page mapped
                before = _resident_kb(address)
                assert before >= len(mapping) // 1024 - 4
                views = [memoryview(mapping)[a: a + len(b)] for a, b in zip(starts, blobs)]
                outs = [torch.empty(layout.n, dtype=torch.bfloat16) for _, layout, _ in encoded]
                results = cpu.decode_payloads([(v, layout, codebook, out) for v, (_, layout, codebook), out
                                               in zip(views, encoded, outs)], checksums=False, threads=threads,
                                              release=release)
                assert [error for _, _, error in results] == [None, None]
                if checking:  # verify's call, on the views already released or not
                    assert bytes(mapping) and _resident_kb(address) == before
                    checked = cpu.cpu_kernel.check_payloads(cpu._native, [(v, layout, codebook) for v, (_, layout,
                                                            codebook) in zip(views, encoded)], release=release)
                    assert [stored for stored, _, _ in checked] == [zlib.crc32(b) for b in blobs]
                for (payload, layout, codebook), out in zip(encoded, outs):
                    assert torch.equal(out.view(torch.int16), cpu.decode(payload, layout, codebook).view(torch.int16))
                after = _resident_kb(address)
                if release:  # the pages at the units' edges and the escape streams' are left
                    assert after < before // 20, (before, after)
                else:
                    assert after == before
                assert bytes(views[1]) == blobs[1]  # mapped again, the file's bytes
                del views
        payload, layout, codebook = encoded[0]
        out = torch.full((layout.n,), 7.0, dtype=torch.bfloat16)
        with mmap.mmap(fd, 0, access=mmap.ACCESS_COPY) as private:
            for refused in (blobs[0], memoryview(bytearray(blobs[0])), memoryview(private)[: len(blobs[0])],
                            memoryview(private)[: len(blobs[0])].toreadonly()):
                with pytest.raises(ValueError, match="read-only file mappings only"):
                    cpu.decode_payloads([(refused, layout, codebook, out)], checksums=False, release=True)
                with pytest.raises(ValueError, match="read-only file mappings only"):
                    cpu.cpu_kernel.check_payloads(cpu._native, [(refused, layout, codebook)], release=True)
            del refused
        assert torch.equal(out, torch.full_like(out, 7.0))
    finally:
        os.close(fd)


@pytest.mark.parametrize("kernel", ["native"], indirect=True)
def test_the_range_kernel_refuses_bad_arguments_and_a_function_that_is_not_crc32():
    native = cpu._native
    pk, sm, lut, out = bytes(4), bytes(8), bytes(range(16)), bytearray(16)
    no_escapes = np.zeros(0, dtype=np.int64), b""
    assert native.decode_range(pk, sm, lut, out, *no_escapes, False) is None
    with pytest.raises(TypeError, match="takes 7 arguments"):
        native.decode_range(pk, sm, lut, out, *no_escapes)
    with pytest.raises(ValueError, match="need 4 pk bytes"):
        native.decode_range(bytes(3), sm, lut, out, *no_escapes, False)
    if cpu.cpu_kernel.checksums_in_kernel():
        assert native.crc32(sm, zlib.crc32(pk)) == cpu.guarded_crc32(sm, zlib.crc32(pk)) == zlib.crc32(pk + sm)
        with pytest.raises(ValueError, match=r"crc must be in \[0, 2\*\*32\)"):
            native.crc32(sm, 1 << 32)
        with pytest.raises(TypeError, match="takes 2 arguments"):
            native.crc32(sm)
        assert native.decode_range(pk, sm, lut, out, *no_escapes, True) == \
            (zlib.crc32(pk), zlib.crc32(sm), zlib.crc32(bytes(out)))
        with pytest.raises(ValueError, match="need 4 pk bytes"):
            native.decode_range(pk, sm, lut, bytearray(14), *no_escapes, True)
        for positions in ([3, 3], [5, 2], [-1, 2], [2, 8]):
            with pytest.raises(ValueError, match="ascend inside"):
                native.decode_range(pk, sm, lut, out, np.array(positions, dtype=np.int64), bytes(2), True)
    real = crc32_function_address("zng_crc32"), crc32_function_address("zng_crc32_combine")
    constant = ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32)(lambda c, b, n: 0)
    xor = ctypes.CFUNCTYPE(ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_int64)(lambda a, b, n: a ^ b)
    try:
        with pytest.raises(ValueError, match="does not compute CRC-32"):
            native.use_crc32(ctypes.cast(constant, ctypes.c_void_p).value, real[1])
        with pytest.raises(ValueError, match="does not join CRC-32s"):
            native.use_crc32(real[0], ctypes.cast(xor, ctypes.c_void_p).value)
        with pytest.raises(ValueError, match="null address"):
            native.use_crc32(0, real[1])
        with pytest.raises(TypeError, match="takes 2 arguments"):
            native.use_crc32(real[0])
    finally:
        if cpu.cpu_kernel.checksums_in_kernel():  # whatever happened, the real ones again
            native.use_crc32(*real)


@pytest.mark.parametrize("rows, width", [(1, 2), (7, 40), (33, 1030), (3, 2 * CHUNK_SIZE + 6), (0, 8)])
def test_columns_of_rows_decode_to_the_same_bits_as_the_whole_tensor(rows, width, rng, slicing):
    """A row-parallel shard decoded alone: escapes inside and outside the columns (subnormals, NaN and Inf
    payloads, all-escape rows), rows crossing chunks, blocks of rows starting anywhere."""
    x = weight_like(rng, rows * width, scale=0.5)
    specials = from_bits(special_values())
    for _ in range(min(rows * width, 40)):
        x[rng.randrange(rows * width)] = specials[rng.randrange(specials.numel())]
    if rows > 2:
        x[width: 2 * width] = from_bits([0x0001] * width)  # a row of escapes only
    payload, layout, codebook = cpu.encode(x, cpu.calibrate(weight_like(rng, 1000)))
    decoder = cpu.PayloadDecoder(payload, layout, codebook)
    matrix = x.view(rows, width)
    for _ in range(6):
        first_row = rng.randrange(rows + 1)
        last_row = rng.randrange(first_row, rows + 1)
        first = 2 * rng.randrange(width // 2 + 1)
        last = 2 * rng.randrange(first // 2, width // 2 + 1)
        out = torch.full((last_row - first_row, last - first), 7.0, dtype=torch.bfloat16)
        decoder.decode_columns((first_row, last_row), width, (first, last), out)
        want = matrix[first_row:last_row, first:last].contiguous()
        assert torch.equal(out.view(torch.int16), want.view(torch.int16)), (first_row, last_row, first, last)


def test_columns_with_odd_bounds_or_outside_the_rows_are_refused(rng):
    x = weight_like(rng, 6 * 10)
    decoder = cpu.PayloadDecoder(*cpu.encode(x))
    out = torch.empty(6 * 4, dtype=torch.bfloat16)
    for rows, width, cols in (((0, 6), 10, (1, 5)), ((0, 6), 10, (2, 12)), ((0, 12), 5, (0, 2)), ((0, 7), 10, (0, 4))):
        with pytest.raises(ValueError, match="even bounds|outside"):
            decoder.decode_columns(rows, width, cols, out)
    with pytest.raises(ValueError, match="contiguous bfloat16 tensor of 24"):
        decoder.decode_columns((0, 6), 10, (0, 4), torch.empty(20, dtype=torch.bfloat16))


@pytest.mark.parametrize("kernel", ["native"], indirect=True)
def test_columns_decode_from_streams_held_apart_from_the_payload(rng):
    """The rows' ``pk`` and ``sm`` bytes handed over apart (as views of a file's mapping are): the same bits as
    from the payload; the escapes still come from the payload's streams."""
    rows, width = 9, 2 * CHUNK_SIZE + 4
    x = weight_like(rng, rows * width)
    x[rng.randrange(rows * width)] = from_bits([0x0001])[0]
    payload, layout, codebook = cpu.encode(x, cpu.calibrate(weight_like(rng, 1000)))
    decoder = cpu.PayloadDecoder(payload, layout, codebook)
    first_row, last_row, first, last = 2, 8, 6, width - 2
    start, stop = first_row * width, last_row * width
    streams = tuple(bytes(s.numpy()) for s in decoder.streams(start, stop))  # copies, elsewhere than the payload
    out = torch.full((last_row - first_row, last - first), 7.0, dtype=torch.bfloat16)
    decoder.decode_columns((first_row, last_row), width, (first, last), out, streams=streams)
    assert torch.equal(out.view(torch.int16), x.view(rows, width)[first_row:last_row, first:last].view(torch.int16))


@pytest.mark.parametrize("kernel", ["reference"], indirect=True)
def test_the_reference_refuses_columns_from_streams_held_apart(rng):
    """Streams outside the payload (views of a file's mapping) are read only by the C kernels' guarded call: the
    reference, which would read them unguarded, refuses them."""
    x = weight_like(rng, 4 * 10)
    decoder = cpu.PayloadDecoder(*cpu.encode(x))
    streams = tuple(bytes(s.numpy()) for s in decoder.streams(0, 40))
    with pytest.raises(ValueError, match="decoded by the C kernels only"):
        decoder.decode_columns((0, 4), 10, (0, 4), torch.empty(16, dtype=torch.bfloat16), streams=streams)


@pytest.mark.parametrize("kernel", ["native"], indirect=True)
def test_the_columns_kernel_refuses_bad_arguments():
    native = cpu._native
    pk, sm, lut, out = bytes(6), bytes(12), bytes(range(16)), bytearray(12)  # 3 rows of 4, columns [0, 2)
    no_escapes = np.zeros(0, dtype=np.int64), b""
    assert native.decode_columns(pk, sm, lut, out, *no_escapes, 4, 0, 2) is None
    with pytest.raises(TypeError, match="takes 9 arguments"):
        native.decode_columns(pk, sm, lut, out, *no_escapes, 4, 0)
    for width, first, last in ((0, 0, 0), (3, 0, 2), (4, 1, 3), (4, 2, 6), (4, 2, 0), (-4, 0, 2)):
        with pytest.raises(ValueError, match="need even bounds"):
            native.decode_columns(pk, sm, lut, out, *no_escapes, width, first, last)
    for args in ((bytes(5), sm, lut, out), (pk, bytes(10), lut, out), (pk, sm, bytes(15), out),
                 (pk, sm, lut, bytearray(10))):
        with pytest.raises(ValueError, match="need whole rows"):
            native.decode_columns(*args, *no_escapes, 4, 0, 2)
    for positions in ([3, 3], [5, 2], [-1, 2], [2, 12]):
        with pytest.raises(ValueError, match="ascend inside"):
            native.decode_columns(pk, sm, lut, out, np.array(positions, dtype=np.int64), bytes(2), 4, 0, 2)
    with pytest.raises(TypeError, match="out must be a C-contiguous writable buffer"):
        native.decode_columns(pk, sm, lut, bytes(12), *no_escapes, 4, 0, 2)


def test_decode_rejects_bad_arguments(rng):
    x = weight_like(rng, 100)
    payload, layout, codebook = cpu.encode(x)
    with pytest.raises(ValueError, match="outside"):
        cpu.decode(payload, layout, codebook, start=5, stop=4)
    with pytest.raises(ValueError, match="outside"):
        cpu.decode(payload, layout, codebook, stop=101)
    with pytest.raises(ValueError, match="needs"):
        cpu.decode(payload[:-1], layout, codebook)
    with pytest.raises(ValueError, match="flat contiguous uint8"):
        cpu.decode(payload.view(torch.int8), layout, codebook)
    with pytest.raises(ValueError, match="out must be"):
        cpu.decode(payload, layout, codebook, out=torch.empty(99, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out must be"):
        cpu.decode(payload, layout, codebook, out=torch.empty(100, dtype=torch.float16))
    with pytest.raises(ValueError, match="out must be"):
        cpu.decode(payload, layout, codebook, out=torch.empty(200, dtype=torch.bfloat16)[::2])


# ---------------------------------------------------------------------------------------------------------------
# Escape stream validation
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture
def escaped_payload():
    """A 2,600-element payload with escapes at 5, 1030 and 2500 (chunks 0, 1, 2)."""
    values = [0x3F80] * 2600
    for i in (5, 1030, 2500):
        values[i] = 0x0001
    only_127 = Codebook(dec_lut=(127,) + (0,) * 15, n_used=1, coverage=2597 / 2600)
    payload, layout, codebook = cpu.encode(from_bits(values), only_127)
    assert cpu.escape_positions(payload, layout).tolist() == [5, 1030, 2500]
    return payload, layout, codebook


def _set_escape(payload: torch.Tensor, layout: PayloadLayout, k: int, chunk: int, local: int) -> None:
    payload[layout.off_cid + 4 * k: layout.off_cid + 4 * k + 4] = torch.tensor(list(struct.pack("<i", chunk)))
    payload[layout.off_lpos + 2 * k: layout.off_lpos + 2 * k + 2] = torch.tensor(list(struct.pack("<H", local)))


@pytest.mark.parametrize("k, chunk, local, message", [
    (2, 3, 0, "chunk id out of range"),
    (0, -1, 5, "chunk id out of range"),
    (1, 1, 1024, "outside its chunk"),
    (0, 0, 65535, "outside its chunk"),
    (2, 2, 600, "past the tensor"),
    (1, 0, 5, "not strictly ascending"),
    (1, 0, 4, "not strictly ascending"),
])
def test_bad_escape_streams_raise(escaped_payload, k, chunk, local, message):
    payload, layout, codebook = escaped_payload
    payload = payload.clone()
    _set_escape(payload, layout, k, chunk, local)
    with pytest.raises(ValueError, match=message):
        cpu.escape_positions(payload, layout)
    out = torch.full((layout.n,), 3.0, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=message):
        cpu.decode(payload, layout, codebook, out=out)
    assert (out == 3.0).all()  # nothing was written


# ---------------------------------------------------------------------------------------------------------------
# Real trained weights
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not MINILM_BF16.exists(),
                    reason=f"{MINILM_BF16} is absent; run `python tools/fetch_minilm.py` to fetch it")
def test_minilm_weights_round_trip_and_shrink():
    from safetensors.torch import load_file

    tensors = load_file(MINILM_BF16)
    bf16 = {name: t for name, t in tensors.items() if t.dtype == torch.bfloat16}
    assert len(bf16) == 103
    raw = stored = 0
    for name, tensor in bf16.items():
        payload, layout, codebook = assert_round_trip(tensor)
        if tensor.numel() <= 1536:  # LayerNorm weights and biases: small enough for the plain-Python encoder
            assert bytes(payload.numpy()) == reference_payload(tensor)[0], name
        if tensor.dim() == 2:  # trained weight matrices: 16 exponents cover almost everything
            assert codebook.coverage > 0.99, name
            assert layout.comp_bytes < layout.raw_bytes, name
        raw += layout.raw_bytes
        stored += layout.comp_bytes
    assert stored < 0.8 * raw


def test_a_payload_holds_at_most_2_to_the_41_elements():
    """Chunk ids are int32: 2^31 chunks of 1024 elements."""
    assert PayloadLayout(n=1 << 41, n_esc=0).n_chunks == 1 << 31
    with pytest.raises(ValueError, match="int32"):
        PayloadLayout(n=(1 << 41) + 1, n_esc=0)


def test_a_tensor_too_large_for_splitzip_is_stored_raw(monkeypatch):
    from szformat.codec import gate

    x = torch.ones(12, dtype=torch.bfloat16)
    raw = x.view(torch.uint8)
    assert gate.encode_tensor(raw, "BF16").encoding == "splitzip"
    monkeypatch.setattr(PayloadLayout, "max_elements", staticmethod(lambda chunk_size=CHUNK_SIZE: 11))
    encoded = gate.encode_tensor(raw, "BF16")
    assert (encoded.encoding, encoded.raw_reason) == ("raw", "more than 2^41 elements")


def test_the_version_names_the_kernel_and_the_reference_can_be_chosen(tmp_path, kernel):
    """``szconvert --version`` says which kernels a user got; ``SZFORMAT_CPU_CODEC=reference`` selects the PyTorch
    loops in a fresh process, which then convert and load exactly as the C kernels do."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    if kernel == "reference":
        env["SZFORMAT_CPU_CODEC"] = "reference"
    script = ("import sys, torch, szformat\n"
              "from szformat.cli.main import main\n"
              "from szformat.codec import cpu\n"
              "x = (torch.randn(10007, generator=torch.Generator().manual_seed(3)) * 0.02).to(torch.bfloat16)\n"
              "szformat.save_file({'w': x}, sys.argv[1])\n"
              "assert torch.equal(szformat.load_file(sys.argv[1])['w'].view(torch.int16), x.view(torch.int16))\n"
              "print(cpu._native is None)\n"
              "main(['--version'])\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "m.szt")], env=env, capture_output=True,
                          text=True, timeout=300)
    lines = done.stdout.splitlines()
    assert lines[0] == str(kernel == "reference"), done.stderr
    expected = "reference (PyTorch)" if kernel == "reference" else f"native ({BUILT.isa()})"
    assert lines[2] == f"CPU codec: {expected}"


def test_the_c_kernels_refuse_buffers_of_the_wrong_size_or_kind(kernel):
    """Lengths are checked in C before anything is read or written: a wrong call is an exception, never a write
    past a buffer."""
    if kernel == "reference":
        pytest.skip("the C kernels' own argument checks")
    native = BUILT
    pk, sm, lut, out = bytes(8), bytes(16), bytes(16), bytearray(32)
    native.decode_pairs(pk, sm, lut, out)
    for args in ((pk, bytes(15), lut, out), (pk, sm, bytes(15), out), (pk, sm, lut, bytearray(31))):
        with pytest.raises(ValueError, match="decode_pairs"):
            native.decode_pairs(*args)
    with pytest.raises(TypeError, match="out must be a C-contiguous writable buffer"):
        native.decode_pairs(pk, sm, lut, bytes(32))
    with pytest.raises(TypeError, match="takes 4 arguments"):
        native.decode_pairs(pk, sm, lut)
    with pytest.raises(ValueError, match="encode_pairs"):
        native.encode_pairs(bytes(32), bytes(256), bytearray(8), bytearray(15))
    with pytest.raises(ValueError, match="exponent_histogram"):
        native.exponent_histogram(bytes(32), bytearray(255 * 8))
    with pytest.raises(ValueError, match="mismatches"):
        native.mismatches(bytes(32), bytes(30), bytearray(16 * 8))
    payload = bytes(8 + 16 + 4 * 1 + 4 + 1)  # 16 elements, one escape: pk, sm, chunk id, local position + pad, value
    native.decode_payload(payload, lut, bytearray(32), 1, 1024)
    for args in ((payload[:-1], lut, bytearray(32), 1, 1024), (payload, bytes(15), bytearray(32), 1, 1024),
                 (payload, lut, bytearray(31), 1, 1024), (payload, lut, bytearray(32), 17, 1024),
                 (payload, lut, bytearray(32), -1, 1024), (payload, lut, bytearray(32), 1, 0),
                 (payload, lut, bytearray(32), 1, 65537)):
        with pytest.raises(ValueError, match="decode_payload"):
            native.decode_payload(*args)
    with pytest.raises(TypeError, match="takes 5 arguments"):
        native.decode_payload(payload, lut, bytearray(32), 1)
    with pytest.raises(TypeError):  # the counts are integers, checked before any buffer is taken
        native.decode_payload(payload, lut, bytearray(32), "1", 1024)
    bits, table = bytes(32), bytes([16]) * 256  # 16 elements, every one an escape
    assert native.encode_payload(bits, table, bytearray(len(payload)), 1, 1024) == 16
    # a table of more codes than a codebook has (exponents 0 and 16 escape): counted by the portable loop
    exponents = torch.arange(64, dtype=torch.int16).numpy() << 7
    assert native.encode_payload(exponents, bytes([16]) + bytes(range(1, 256)), bytearray(128), 1, 1024) == 2
    for args in ((bits, table, bytearray(len(payload) - 1), 1, 1024), (bits, bytes(255), bytearray(len(payload)), 1,
                 1024), (bytes(31), table, bytearray(len(payload)), 1, 1024), (bits, table, bytearray(64), 17, 1024),
                 (bits, table, bytearray(64), -1, 1024), (bits, table, bytearray(64), 1, 0),
                 (bits, table, bytearray(64), 1, 65537)):
        with pytest.raises(ValueError, match="encode_payload"):
            native.encode_payload(*args)
    with pytest.raises(TypeError, match="payload must be a C-contiguous writable buffer"):
        native.encode_payload(bits, table, bytes(len(payload)), 1, 1024)
    with pytest.raises(TypeError, match="takes 5 arguments"):
        native.encode_payload(bits, table, bytearray(len(payload)), 1)


def run_with_isa(isa: str, script: str) -> tuple[int, subprocess.CompletedProcess]:
    """Run ``script`` (given a fresh seed as its argument) in a fresh interpreter whose C kernels are capped to
    ``isa`` (``SZFORMAT_CPU_ISA``; "" for the best this CPU has); returns the seed and the finished process."""
    env = {**os.environ, "SZFORMAT_CPU_ISA": isa,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    seed = random.SystemRandom().randrange(2**32)
    return seed, subprocess.run([sys.executable, "-c", script, str(seed)], env=env, capture_output=True, text=True,
                                timeout=300)


ISAS_UNDER_CAP = {"scalar": ["scalar"], "avx2": ["avx2", "scalar"], "avx512bw": ["avx2+avx512bw", "avx2", "scalar"],
                  "": ["avx2+avx512bw+vpclmulqdq", "avx2+avx512bw", "avx2", "scalar"]}
"""What ``isa()`` may say under each ``SZFORMAT_CPU_ISA`` cap, by what the CPU has."""


def assert_runs_under_cap(isa: str, script: str) -> None:
    """Run ``script`` (which prints ``isa()``, then "ok" once its checks pass) with the C kernels capped to ``isa``."""
    seed, done = run_with_isa(isa, script)
    lines = done.stdout.split("\n")
    assert lines[0] in ISAS_UNDER_CAP[isa] and lines[1] == "ok", f"seed={seed}: {done.stdout} {done.stderr[-3000:]}"


def test_the_portable_c_loops_match_the_reference(tmp_path, kernel):
    """The C kernels' portable loops (what a CPU without AVX2 runs; ``SZFORMAT_CPU_ISA=scalar`` selects them here)
    encode and decode bit for bit as the reference does, odd sizes, escapes and partial ranges included."""
    if kernel == "reference":
        pytest.skip("compares the C extension's portable loops with the reference")
    script = ("import sys, torch\n"
              "from szformat.codec import cpu\n"
              "print(cpu._native.isa())\n"
              "g = torch.Generator().manual_seed(int(sys.argv[1]))\n"
              "for n in (1, 2, 31, 33, 1023, 4097, 100_003):\n"
              "    x = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)\n"
              "    x[torch.randint(0, n, (max(1, n // 50),), generator=g)] = float('inf')\n"
              "    payload, layout, codebook = cpu.encode(x)\n"
              "    native = cpu.decode(payload, layout, codebook, start=n // 3, stop=n)\n"
              "    assert torch.equal(cpu.decode(payload, layout, codebook).view(torch.int16), x.view(torch.int16)), n\n"
              "    cpu._native = None\n"
              "    again, layout2, codebook2 = cpu.encode(x)\n"
              "    reference = cpu.decode(payload, layout, codebook, start=n // 3, stop=n)\n"
              "    cpu._native = cpu.cpu_kernel.native\n"
              "    assert torch.equal(payload, again) and layout == layout2 and codebook == codebook2, n\n"
              "    assert torch.equal(native.view(torch.int16), reference.view(torch.int16)), n\n"
              "    assert torch.equal(native.view(torch.int16), x[n // 3:].view(torch.int16)), n\n"
              "    start = 2 * (n // 6)  # a checked range (the C call that checksums, where zlib-ng lends its CRC-32)\n"
              "    checked = torch.empty(n - start, dtype=torch.bfloat16)\n"
              "    cpu.PayloadDecoder(payload, layout, codebook).decode_checked(start, n, checked)\n"
              "    assert torch.equal(checked.view(torch.int16), x[start:].view(torch.int16)), n\n"
              "print('ok')\n")
    seed, done = run_with_isa("scalar", script)
    assert done.stdout.split() == ["scalar", "ok"], f"seed={seed}: {done.stderr[-3000:]}"


@pytest.mark.parametrize("kernel", ["native"], indirect=True)
@pytest.mark.parametrize("isa", ["", "avx512bw", "avx2", "scalar"])
def test_the_exponent_histogram_counts_exactly_with_every_instruction_set(isa):
    """The C histogram (AVX-512BW where the CPU has it, else the four tables; ``SZFORMAT_CPU_ISA`` caps it) against
    ``bincount``: sizes around its 64-element vectors and 65,536-element sample and blocks, clustered weights,
    exponents spread past what its compares count (the four tables take over), all-escape halves, random bits."""
    script = ("import sys, numpy as np, torch\n"
              "from szformat.codec import cpu\n"
              "print(cpu._native.isa())\n"
              "g = torch.Generator().manual_seed(int(sys.argv[1]))\n"
              "for n in (0, 1, 63, 64, 65, 65_535, 65_536, 65_537, 65_600, 65_601, 200_003, 1 << 20):\n"
              "    weights = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)\n"
              "    half_inf = weights.clone()\n"
              "    half_inf[n // 2:] = float('inf')\n"
              "    spread = (torch.randn(n, generator=g) * torch.logspace(-30, 30, n)).to(torch.bfloat16)\n"
              "    late = weights.clone()\n"
              "    late[70_000:] = spread[70_000:]\n"
              "    bits = torch.randint(-2**15, 2**15, (n,), generator=g, dtype=torch.int16).view(torch.bfloat16)\n"
              "    for name, x in (('weights', weights), ('half inf', half_inf), ('spread', spread),\n"
              "                    ('spread after the sample', late), ('random bits', bits)):\n"
              "        counts = np.full(256, 7, dtype=np.int64)  # the call adds to what is there\n"
              "        cpu._native.exponent_histogram(x.view(torch.int16).numpy(), counts)\n"
              "        expected = torch.bincount(cpu.split_bf16(x)[0].reshape(-1), minlength=256).numpy() + 7\n"
              "        assert np.array_equal(counts, expected), (n, name)\n"
              "print('ok')\n")
    assert_runs_under_cap(isa, script)


@pytest.mark.parametrize("kernel", ["native"], indirect=True)
@pytest.mark.parametrize("isa", ["", "avx512bw", "avx2", "scalar"])
def test_checked_ranges_give_zlibs_crc32s_with_every_instruction_set(isa):
    """A checked range's three CRC-32s (pk, sm, output) against zlib's, and its output against the unchecked
    decode's: with VPCLMULQDQ they are folded into the decode 64 elements at a time and only the tail goes through
    zlib-ng, so lengths around 64 and its multiples, escapes at a block's first and last element, in the tail, in
    every element, and runs of blocks with and without them."""
    script = ("import sys, zlib, numpy as np\n"
              "from szformat.codec import cpu, cpu_kernel\n"
              "native = cpu._native\n"
              "print(native.isa())\n"
              "assert cpu_kernel.checksums_in_kernel()\n"
              "rng = np.random.default_rng(int(sys.argv[1]))\n"
              "lut = rng.integers(0, 256, 16, dtype=np.uint8).tobytes()\n"
              "def escapes(n, kind):\n"
              "    if kind == 'none' or n == 0: return np.zeros(0, np.int64)\n"
              "    if kind == 'all': return np.arange(n, dtype=np.int64)\n"
              "    if kind == 'edges': return np.unique([p for b in range(0, n, 64) for p in (b, b + 63) if p < n])\n"
              "    if kind == 'tail': return np.arange(n - n % 64, n, dtype=np.int64)\n"
              "    return np.sort(rng.choice(n, int(rng.integers(1, n // 50 + 2)), replace=False)).astype(np.int64)\n"
              "sizes = list(range(0, 200)) + [255, 256, 257, 8191, 8192, 16384, 16447, 65_599, 1 << 20, 1_000_003]\n"
              "for n in sizes:\n"
              "    for kind in ('none', 'all', 'edges', 'tail', 'scattered'):\n"
              "        pk = rng.integers(0, 256, (n + 1) // 2, dtype=np.uint8)\n"
              "        sm = rng.integers(0, 256, n, dtype=np.uint8)\n"
              "        positions = escapes(n, kind)\n"
              "        exponents = rng.integers(0, 256, len(positions), dtype=np.uint8)\n"
              "        checked, plain = np.full(n, 7, np.uint16), np.full(n, 9, np.uint16)\n"
              "        crcs = native.decode_range(pk, sm, lut, checked, positions, exponents, True)\n"
              "        assert native.decode_range(pk, sm, lut, plain, positions, exponents, False) is None\n"
              "        assert np.array_equal(checked, plain), (n, kind)\n"
              "        assert crcs == (zlib.crc32(pk), zlib.crc32(sm), zlib.crc32(plain)), (n, kind)\n"
              "print('ok')\n")
    assert_runs_under_cap(isa, script)


@pytest.mark.parametrize("kernel", ["native"], indirect=True)
@pytest.mark.parametrize("isa", ["", "avx512bw", "avx2", "scalar"])
def test_payloads_checked_through_a_scratch_give_what_decoding_them_gives_with_every_instruction_set(isa):
    """``check_payloads`` (``szconvert verify``'s call: each payload decoded a block at a time into one 32 KiB buffer)
    against ``decode_payloads`` into whole outputs (on one thread and on three), the tensors encoded and zlib's CRC-32s:
    sizes around the folded path's 64 elements, the 16,384 of a checked block and a unit of the threads' work (a payload
    of more is cut into ranges, in both calls), escapes at their first and last elements and everywhere, an empty
    payload, and a payload whose escape stream is refused, with the same message."""
    script = ("import sys, struct, zlib, numpy as np, torch\n"
              "from szformat.codec import CHUNK_SIZE, Codebook, cpu, cpu_kernel\n"
              "native = cpu._native\n"
              "print(native.isa())\n"
              "assert cpu_kernel.checksums_in_kernel()\n"
              "g = torch.Generator().manual_seed(int(sys.argv[1]))\n"
              "every = Codebook(dec_lut=(250,) + (0,) * 15, n_used=1, coverage=0.0)\n"
              "cases, tensors = [], []\n"
              "u = native.UNIT_ELEMENTS\n"
              "for n in (0, 1, 2, 63, 64, 65, 127, 128, 16383, 16384, 16385, 32769, 100_003,\n"
              "          u - 1, u + 1, 2 * u + 3):\n"
              "    x = (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)\n"
              "    edges = [p for p in (0, 63, 64, 127, 16383, 16384, 16385, u - 1, u, u + 1, 2 * u, n - 1)\n"
              "             if 0 <= p < n]\n"
              "    x[edges] = float('inf')\n"
              "    x[torch.randint(0, max(n, 1), (n // 40,), generator=g)] = float('-inf')\n"
              "    cases.append(cpu.encode(x))\n"
              "    tensors.append(x)\n"
              "    if n:\n"
              "        cases.append(cpu.encode(x, every))\n"
              "        tensors.append(x)\n"
              "payloads = [(p.numpy().tobytes(), layout, codebook) for p, layout, codebook in cases]\n"
              "broken, layout, codebook = payloads[-2]\n"
              "assert layout.n_esc > 1\n"
              "broken = bytearray(broken)\n"
              "broken[layout.off_lpos: layout.off_lpos + 2] = struct.pack('<H', CHUNK_SIZE)\n"
              "payloads.append((bytes(broken), layout, codebook))\n"
              "for threads in (1, 3):\n"
              "    outs = [np.empty(layout.n, np.uint16) for _, layout, _ in payloads]\n"
              "    items = [(p, layout, codebook, out) for (p, layout, codebook), out in zip(payloads, outs)]\n"
              "    decoded = cpu_kernel.decode_payloads(native, items, checksums=True, threads=threads)\n"
              "    checked = cpu_kernel.check_payloads(native, payloads)\n"
              "    assert checked == decoded\n"
              "    assert checked[-1][2] is not None and checked[-1][0] == zlib.crc32(payloads[-1][0])\n"
              "    for (p, _, _), out, (stored, crc, error), x in zip(payloads, outs, checked, tensors):\n"
              "        assert error is None and stored == zlib.crc32(p) and crc == zlib.crc32(out.tobytes())\n"
              "        assert np.array_equal(out, x.view(torch.int16).numpy().view(np.uint16))\n"
              "print('ok')\n")
    assert_runs_under_cap(isa, script)


@pytest.mark.parametrize("kernel", ["native"], indirect=True)
def test_check_payloads_refuses_items_it_cannot_take():
    """Its items' checks: five fields, a whole element count, escapes within it, a payload and a codebook of the
    sizes they need; a list of items and an int64 progress buffer."""
    cpu.cpu_kernel.checksums_in_kernel()
    native, progress = cpu._native, np.zeros(1, dtype=np.int64)
    lut = bytes(range(16))
    payload = bytes(PayloadLayout(n=4, n_esc=0).comp_bytes)
    assert native.check_payloads([(payload, lut, 4, 0, CHUNK_SIZE)], progress, False) == [
        (zlib.crc32(payload), zlib.crc32(cpu.decode(torch.frombuffer(bytearray(payload), dtype=torch.uint8),
                                                    PayloadLayout(n=4, n_esc=0),
                                                    Codebook(dec_lut=tuple(lut), n_used=16, coverage=1.0))
                                         .view(torch.uint8).numpy().tobytes()), None)]
    assert native.check_payloads([], progress, False) == []
    with pytest.raises(TypeError, match="takes 3 arguments"):
        native.check_payloads([], progress)
    with pytest.raises(TypeError, match="must be a tuple of 5"):
        native.check_payloads([(payload, lut, 4, 0)], progress, False)
    for bad in ((payload, lut, -1, 0, CHUNK_SIZE), (payload, lut, 4, 5, CHUNK_SIZE), (payload, lut, 4, 0, 0),
                (payload[:-1], lut, 4, 0, CHUNK_SIZE), (payload, lut[:15], 4, 0, CHUNK_SIZE)):
        with pytest.raises(ValueError, match="check_payloads"):
            native.check_payloads([bad], progress, False)
    with pytest.raises(TypeError, match=r"check_payloads\(\): items must be a list or a tuple"):
        native.check_payloads(5, progress, False)
    with pytest.raises(ValueError, match="progress must hold an int64"):
        native.check_payloads([], np.zeros(1, dtype=np.int32), False)


@pytest.mark.parametrize("kernel", ["native"], indirect=True)
def test_without_zlib_ngs_crc32_function_the_kernels_take_no_checksums(monkeypatch):
    """Where zlib-ng's module exports no ``zng_crc32`` (or no C kernels are built), the hand-over says no, so checked
    ranges keep their separate checksum passes (the "checksums apart" cases above) instead of calling a null pointer."""
    from szformat import checksum

    monkeypatch.setattr(checksum, "crc32_function_address", lambda name: None)
    assert cpu.cpu_kernel._hand_over_crc32(cpu._native) is False
    monkeypatch.setattr(checksum, "crc32_function_address", lambda name: None if name == "zng_crc32_combine" else 1)
    assert cpu.cpu_kernel._hand_over_crc32(cpu._native) is False
    assert cpu.cpu_kernel._hand_over_crc32(None) is False
