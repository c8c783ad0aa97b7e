"""The GPU codec against the CPU reference, bit for bit.

On a machine with CUDA the kernels run on the GPU; without one they run under the Triton interpreter on CPU tensors
(``TRITON_INTERPRET=1`` must be set before the kernels are imported, hence the order below). Every decode writes into
an output poisoned twice with different patterns, so an element the kernels never wrote cannot pass.
"""

import os

import numpy as np
import torch
import pytest

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from szformat.codec import cpu, gpu, planes  # noqa: E402

if gpu.triton_missing() is not None:
    pytest.skip(gpu.triton_missing(), allow_module_level=True)
from szformat.codec.codebook import Codebook  # noqa: E402
from szformat.codec.layout import PayloadLayout  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
POISONS = (0x7FA5, -0x5A5B)  # a NaN and a negative normal: no element can equal both


def fresh_generator() -> tuple[torch.Generator, int]:
    seed = int.from_bytes(os.urandom(4), "little")
    return torch.Generator().manual_seed(seed), seed


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1).view(torch.int16).cpu()


def from_bits(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int16).view(torch.bfloat16)


def weights(n: int, g: torch.Generator) -> torch.Tensor:
    return (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)


def all_patterns(g: torch.Generator) -> torch.Tensor:
    return from_bits(torch.arange(-32768, 32768)[torch.randperm(65536, generator=g)])


def specials(g: torch.Generator) -> torch.Tensor:
    x = bits(weights(3001, g)).clone()
    special = torch.tensor([0x0000, -0x8000, 0x7F80, -0x0080,  # +0, -0, +Inf, -Inf
                            0x7FC0, 0x7F81, 0x7FFF, -0x003F, -0x0001,  # NaNs with payloads, both signs
                            0x0001, 0x007F, -0x7FFF, -0x7F81], dtype=torch.int16)  # subnormals, both signs
    x[torch.randint(0, 3001, (200,), generator=g)] = special[torch.randint(0, len(special), (200,), generator=g)]
    return from_bits(x)


def escape_heavy(g: torch.Generator) -> torch.Tensor:
    return from_bits(torch.randint(-32768, 32768, (5003,), generator=g))


def few_exponents(g: torch.Generator) -> torch.Tensor:
    exponent = torch.randint(118, 121, (2049,), generator=g)
    mantissa = torch.randint(0, 256, (2049,), generator=g)
    return from_bits(((exponent << 7) | (mantissa & 0x7F) | ((mantissa & 0x80) << 8)).to(torch.int16))


def low_exponents(g: torch.Generator) -> torch.Tensor:
    """Zeros, subnormals and exponents up to 12: the histogram's window then reaches exponent 0."""
    exponent = torch.randint(0, 13, (3001,), generator=g)
    mantissa = torch.randint(0, 256, (3001,), generator=g)
    return from_bits(((exponent << 7) | (mantissa & 0x7F) | ((mantissa & 0x80) << 8)).to(torch.int16))


CASES = {
    "all_patterns": all_patterns,
    "low_exponents": low_exponents,
    "specials": specials,
    "escape_heavy": escape_heavy,
    "few_exponents": few_exponents,
    "one_value": lambda g: torch.full((777,), -1.5, dtype=torch.bfloat16),
    **{f"n={n}": (lambda g, n=n: weights(n, g)) for n in (0, 1, 2, 3, 5, 1023, 1025, 8191, 8193, 40001)},
}


def decode_poisoned(payload: torch.Tensor, layout: PayloadLayout, codebook: Codebook) -> list[torch.Tensor]:
    outs = []
    for poison in POISONS:
        out = from_bits(torch.full((layout.n,), poison, dtype=torch.int16)).to(DEVICE)
        assert gpu.decode(payload.to(DEVICE), layout, codebook, out=out) is out
        outs.append(out)
    return outs


@pytest.mark.parametrize("case", list(CASES))
def test_gpu_decode_of_cpu_payload(case):
    g, seed = fresh_generator()
    x = CASES[case](g)
    payload, layout, codebook = cpu.encode(x)
    for out in decode_poisoned(payload, layout, codebook):
        assert torch.equal(bits(out), bits(x)), f"{case}, seed {seed}"


@pytest.mark.parametrize("case", list(CASES))
def test_gpu_encode_matches_cpu_bytes(case):
    g, seed = fresh_generator()
    x = CASES[case](g)
    expected = cpu.encode(x)
    payload, layout, codebook = gpu.encode(x.to(DEVICE))
    assert (layout, codebook) == expected[1:], f"{case}, seed {seed}"
    assert payload.device == x.to(DEVICE).device
    assert torch.equal(payload.cpu(), expected[0]), f"{case}, seed {seed}"
    assert torch.equal(bits(cpu.decode(payload.cpu(), layout, codebook)), bits(x)), f"{case}, seed {seed}"


def test_all_escape_with_a_given_codebook():
    g, seed = fresh_generator()
    x = few_exponents(g)  # exponents 118..120, none of them in the codebook below
    codebook = Codebook(dec_lut=tuple(range(1, 17)), n_used=16, coverage=0.0)
    payload, layout, _ = cpu.encode(x, codebook)
    assert layout.n_esc == layout.n
    gpu_payload, gpu_layout, gpu_codebook = gpu.encode(x.to(DEVICE), codebook)
    assert (gpu_layout, gpu_codebook) == (layout, codebook)
    assert torch.equal(gpu_payload.cpu(), payload), f"seed {seed}"
    for out in decode_poisoned(payload, layout, codebook):
        assert torch.equal(bits(out), bits(x)), f"seed {seed}"


def test_calibration_breaks_ties_by_smaller_exponent():
    # 20 exponents, each exactly 50 times: the Top-16 must be the 16 smallest, in ascending order
    exponent = torch.arange(100, 120).repeat(50)
    x = from_bits((exponent << 7).to(torch.int16))
    _, layout, codebook = gpu.encode(x.to(DEVICE))
    assert codebook.dec_lut == tuple(range(100, 116))
    assert codebook == cpu.calibrate(x)
    assert layout.n_esc == 4 * 50


def test_encode_to_host_returns_cpu_payload():
    g, _ = fresh_generator()
    x = weights(4097, g)
    payload, layout, codebook = gpu.encode_to_host(x)
    assert payload.device.type == "cpu"
    expected = cpu.encode(x)
    assert (layout, codebook) == expected[1:] and torch.equal(payload, expected[0])


def test_decode_in_place_reuses_scratch_and_stays_in_its_slot():
    g, seed = fresh_generator()
    scratch = gpu.DecodeScratch()
    for x in (weights(10001, g), escape_heavy(g), all_patterns(g)[:4097], weights(1, g), weights(0, g)):
        payload, layout, codebook = cpu.encode(x)
        slot = max(layout.raw_bytes, layout.comp_bytes)
        for poison in (0xA5, 0x5A):
            backing = torch.full((slot + 64,), poison, dtype=torch.uint8)
            backing[: layout.comp_bytes] = payload
            backing = backing.to(DEVICE)
            out = gpu.decode_in_place(backing[:slot], layout, codebook, scratch=scratch)
            assert layout.n == 0 or out.data_ptr() == backing.data_ptr()
            assert torch.equal(bits(out), bits(x)), f"n={layout.n}, seed {seed}"
            assert bool((backing[slot:] == poison).all()), "wrote past the slot"


def test_decode_batch_of_mixed_tensors():
    g, seed = fresh_generator()
    tensors = [weights(10001, g), torch.zeros(0, dtype=torch.bfloat16), weights(1, g), escape_heavy(g),
               few_exponents(g), all_patterns(g), specials(g), weights(3, g), weights(8192, g)]
    encoded = [cpu.encode(x) for x in tensors]
    entries, pay_off, out_off = [], 48, 8  # leading gaps: offsets need not start at 0
    for payload, layout, codebook in encoded:
        entries.append((layout, codebook, pay_off, out_off))
        pay_off += -(-layout.comp_bytes // 16) * 16 + 16
        out_off += -(-layout.n // 8) * 8 + 8  # a gap after each output, which must stay untouched
    payloads = torch.zeros(pay_off, dtype=torch.uint8)
    for (payload, layout, _), (_, _, offset, _) in zip(encoded, entries):
        payloads[offset: offset + layout.comp_bytes] = payload
    table = gpu.build_batch_table(entries, device=DEVICE)
    assert table.launches == 2 and table.count == len(tensors)
    for poison in POISONS:
        out = from_bits(torch.full((out_off,), poison, dtype=torch.int16)).to(DEVICE)
        gpu.decode_batch(payloads.to(DEVICE), table, out=out)
        written = torch.zeros(out_off, dtype=torch.bool)
        for x, (layout, _, _, offset) in zip(tensors, entries):
            assert torch.equal(bits(out[offset: offset + layout.n]), bits(x)), f"n={layout.n}, seed {seed}"
            written[offset: offset + layout.n] = True
        assert bool((bits(out)[~written] == poison).all()), "wrote outside the outputs"


def test_decode_batch_at_writes_separate_tensors_counted_from_the_lowest():
    """Outputs as separate tensor objects of one range (an arena's weights), listed out of address order."""
    g, seed = fresh_generator()
    tensors = [weights(4097, g), specials(g), escape_heavy(g), weights(7, g)]
    encoded = [cpu.encode(x) for x in tensors]
    arena = from_bits(torch.full((1 << 15,), POISONS[0], dtype=torch.int16)).to(DEVICE)
    starts = [20000, 8, 6016, 14000]  # elements, multiples of 8, not in order
    outputs = [arena[start: start + x.numel()] for start, x in zip(starts, tensors)]
    base = outputs[1]
    entries, pay_off = [], 0
    payloads = torch.zeros(1 << 16, dtype=torch.uint8)
    for (payload, layout, codebook), out in zip(encoded, outputs):
        payloads[pay_off: pay_off + layout.comp_bytes] = payload
        entries.append((layout, codebook, pay_off, (out.data_ptr() - base.data_ptr()) // 2))
        pay_off += -(-layout.comp_bytes // 16) * 16
    gpu.decode_batch_at(payloads.to(DEVICE), gpu.build_batch_table(entries, device=DEVICE), base)
    written = torch.zeros(arena.numel(), dtype=torch.bool)
    for x, out, start in zip(tensors, outputs, starts):
        assert torch.equal(bits(out), bits(x)), f"n={x.numel()}, seed {seed}"
        written[start: start + x.numel()] = True
    assert bool((bits(arena)[~written] == POISONS[0]).all()), "wrote outside the outputs"
    with pytest.raises(ValueError, match="base must be a bfloat16 tensor"):
        gpu.decode_batch_at(payloads.to(DEVICE), gpu.build_batch_table(entries, device=DEVICE), base.view(torch.int16))


def test_batch_table_refuses_misaligned_or_overlapping_entries():
    layout = PayloadLayout(n=100, n_esc=0)
    codebook = Codebook(dec_lut=(127,) + (0,) * 15, n_used=1, coverage=1.0)
    with pytest.raises(ValueError, match="payload offset 8"):
        gpu.build_batch_table([(layout, codebook, 8, 0)], device=DEVICE)
    with pytest.raises(ValueError, match="output offset 4"):
        gpu.build_batch_table([(layout, codebook, 0, 4)], device=DEVICE)
    with pytest.raises(ValueError, match="outputs overlap"):
        gpu.build_batch_table([(layout, codebook, 0, 0), (layout, codebook, 256, 96)], device=DEVICE)


def test_decode_refuses_short_payload_and_wrong_out():
    payload, layout, codebook = cpu.encode(weights(100, fresh_generator()[0]))
    payload = payload.to(DEVICE)
    with pytest.raises(ValueError, match="payload holds"):
        gpu.decode(payload[:-1], layout, codebook)
    with pytest.raises(ValueError, match="out must be"):
        gpu.decode(payload, layout, codebook, out=torch.empty(99, dtype=torch.bfloat16, device=DEVICE))
    misaligned = torch.empty(101, dtype=torch.bfloat16, device=DEVICE)[1:]
    with pytest.raises(ValueError, match="multiple of 4 bytes"):
        gpu.decode(payload, layout, codebook, out=misaligned)


def _set_escape(payload: torch.Tensor, layout: PayloadLayout, k: int, chunk: int, local: int) -> None:
    payload[layout.off_cid + 4 * k: layout.off_cid + 4 * k + 4] = torch.tensor([chunk], dtype=torch.int32).view(
        torch.uint8)
    payload[layout.off_lpos + 2 * k: layout.off_lpos + 2 * k + 2] = torch.tensor(
        [local if local < 32768 else local - 65536], dtype=torch.int16).view(torch.uint8)


def _refused(payload: torch.Tensor, layout: PayloadLayout) -> bool:
    try:
        cpu.escape_positions(payload, layout)
    except ValueError:
        return True
    return False


def test_escape_checks_on_the_device_flag_what_the_cpu_refuses():
    """With ``errors``, each entry point flags exactly the payloads whose escape streams the CPU check refuses
    (an escape out of its chunk, past the tensor, out of order, also across the escape pass's blocks), leaves the
    flags of valid ones at 0, and never writes outside the output, whatever the stream says."""
    g, seed = fresh_generator()
    x = escape_heavy(g)  # thousands of escapes: several blocks of the escape pass
    payload, layout, codebook = cpu.encode(x)
    assert layout.n_esc > 2 * 1024
    cases = [payload]
    for k, chunk, local in [(1024, 0, 0),  # first escape of the second block not above the last of the first
                            (5, 0, 1030), (7, layout.n_chunks, 0), (layout.n_esc - 1, layout.n_chunks - 1, 1023),
                            (9, -1, 3)]:
        broken = payload.clone()
        _set_escape(broken, layout, k, chunk, local)
        cases.append(broken)
    for _ in range(4):  # and random ones
        broken = payload.clone()
        k = int(torch.randint(layout.n_esc, (1,), generator=g))
        _set_escape(broken, layout, k, int(torch.randint(-1, layout.n_chunks + 1, (1,), generator=g)),
                    int(torch.randint(0, 1100, (1,), generator=g)))
        cases.append(broken)
    expected = [_refused(case, layout) for case in cases]
    assert expected[0] is False and all(expected[1:6]), f"seed {seed}"
    slot = max(layout.raw_bytes, layout.comp_bytes)
    gap = 4096  # poisoned elements around each output: wider than any position a broken escape above points to
    stride = -(-layout.n // 8) * 8 + gap
    entries = [(layout, codebook, i * -(-layout.comp_bytes // 16) * 16, gap + i * stride) for i in range(len(cases))]
    batch = torch.cat([torch.nn.functional.pad(c, (0, -(-layout.comp_bytes // 16) * 16 - layout.comp_bytes))
                       for c in cases]).to(DEVICE)
    out = from_bits(torch.full((gap + len(cases) * stride,), POISONS[0], dtype=torch.int16)).to(DEVICE)
    batch_errors = torch.zeros(len(cases), dtype=torch.int32, device=DEVICE)
    gpu.decode_batch(batch, gpu.build_batch_table(entries, device=DEVICE), out=out, errors=batch_errors)
    assert batch_errors.cpu().tolist() == [int(e) for e in expected], f"seed {seed}"
    written = torch.zeros(out.numel(), dtype=torch.bool)
    for *_, offset in entries:
        written[offset: offset + layout.n] = True
    assert bool((bits(out)[~written] == POISONS[0]).all()), "wrote outside the outputs"
    assert torch.equal(bits(out[gap: gap + layout.n]), bits(x)), f"seed {seed}"
    for case, refused in zip(cases, expected):
        errors = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        gpu.decode(case.to(DEVICE), layout, codebook, errors=errors)
        backing = torch.full((slot + 64,), 0xA5, dtype=torch.uint8)
        backing[: layout.comp_bytes] = case
        backing = backing.to(DEVICE)
        in_place = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        gpu.decode_in_place(backing[:slot], layout, codebook, errors=in_place)
        assert errors.item() == in_place.item() == int(refused), f"seed {seed}"
        assert bool((backing[slot:] == 0xA5).all()), "wrote past the slot"
    with pytest.raises(ValueError, match="errors must be"):
        gpu.decode(payload.to(DEVICE), layout, codebook, errors=torch.zeros(2, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("itemsize, sign_last", [(1, False), (2, False), (2, True), (4, True), (4, False), (8, True)])
def test_join_planes_undoes_the_writers_split_frame_by_frame(itemsize, sign_last):
    """Frames of byte planes, split by the CPU loops (tested against the spec's definition), joined by the kernel
    into exactly the elements, with a short last frame and odd frame counts; nothing written past the output."""
    seed = int.from_bytes(os.urandom(4), "little")
    rng = np.random.default_rng(seed)
    frame = itemsize * int(rng.integers(600, 1400))  # not a multiple of the kernel's block
    for count in (0, 1, 7, frame // itemsize, 3 * frame // itemsize + 5):
        data = rng.integers(0, 256, count * itemsize, dtype=np.uint8)
        split = np.empty_like(data)
        for start in range(0, data.size, frame):
            planes.split_planes(memoryview(data[start: start + frame]), memoryview(split[start: start + frame]),
                                itemsize, sign_last)
        out = torch.full((data.size + 64,), 0xA5, dtype=torch.uint8, device=DEVICE)
        gpu.join_planes(torch.from_numpy(split).to(DEVICE), out[: data.size], itemsize, frame, sign_last)
        assert np.array_equal(out[: data.size].cpu().numpy(), data), f"seed {seed}, {count} elements"
        assert bool((out[data.size:] == 0xA5).all()), "wrote past the output"


def test_join_planes_refuses_lengths_that_are_not_whole_elements():
    planes_in = torch.zeros(12, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="4-byte elements"):
        gpu.join_planes(planes_in, torch.zeros(12, dtype=torch.uint8, device=DEVICE), 4, 6, True)
    with pytest.raises(ValueError, match="4-byte elements"):
        gpu.join_planes(planes_in, torch.zeros(8, dtype=torch.uint8, device=DEVICE), 4, 4096, True)
    with pytest.raises(ValueError, match="flat uint8"):
        gpu.join_planes(planes_in.view(torch.int32), torch.zeros(3, dtype=torch.int32, device=DEVICE), 4, 4096, True)


def test_copy_ranges_copies_every_range_in_one_launch_and_nothing_else():
    """Ranges of odd lengths and offsets, one longer than a program's stride over it, the empty one too: each lands
    where it is sent, and every other byte of the output keeps its poison."""
    seed = int.from_bytes(os.urandom(4), "little")
    g = torch.Generator().manual_seed(seed)
    source = torch.randint(0, 256, (3 << 20,), generator=g, dtype=torch.uint8)
    ranges = [(5, 7, 1), (100, 3000, 4097), (9000, 50, 0), (1 << 20, 2 << 20, (1 << 20) + 3)]
    out = torch.full((4 << 20,), 0xA5, dtype=torch.uint8)
    expected = out.clone()
    for start, target, length in ranges:
        expected[target: target + length] = source[start: start + length]
    sources, targets, lengths = (torch.tensor(column, dtype=torch.int64, device=DEVICE) for column in zip(*ranges))
    out = out.to(DEVICE)
    gpu.copy_ranges(source.to(DEVICE), out, sources, targets, lengths, max(r[2] for r in ranges))
    assert torch.equal(out.cpu(), expected), f"seed {seed}"
    with pytest.raises(ValueError, match="flat uint8"):
        gpu.copy_ranges(source.to(DEVICE).view(torch.int16), out, sources, targets, lengths, 1)
